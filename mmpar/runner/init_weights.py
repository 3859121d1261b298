"""``init_weights()`` of a sharded or split model, where MMEngine runs it.

MMEngine's ``Runner.train()`` builds the train loop, the optim wrapper, the
schedulers and the val loop and calls the hooks' ``before_run`` *before*
``_init_model_weights``; each may draw from the generator (an
iteration-based loop makes its data-loader iterator, which draws a seed).
A model whose ``init_weights`` draws random numbers (timm's ViT,
MMEngine's ``init_cfg`` initialisers) must therefore be initialised at that
moment, not when it is built or wrapped, to start from one process's
weights and leave the generator where one process leaves it (dropout and
data order after it agree).

Once sharded or split, the plain model no longer exists, and MMEngine's own
step (``init_weights`` on the wrapped module, then a broadcast of every
tensor) would run on shards. So the Runner keeps a stand-in of the plain
model from before the layout was applied, and :meth:`DeferredInit.run`, from
``_init_model_weights``, runs ``init_weights`` on it and loads the result
the way a full checkpoint loads (:func:`mmpar.checkpoint.load_model_state`):

* built on the meta device: a copy of the meta model (no parameter memory);
  its ``init_weights`` is recorded (:meth:`MetaInit.record_init_weights`),
  and the parameters it changed are replayed whole, one part at a time;
* built whole (``meta_init=False``, or a model given as a module): a CPU
  copy of the plain model; its ``init_weights`` runs on the device, every
  tensor is broadcast from rank 0 (MMEngine's step), and the whole state
  loads. Each rank holds this copy until training starts.
"""
import copy
import itertools
from typing import Dict, Iterator, Optional, Tuple

import torch
from mmengine.dist import broadcast
from torch import nn

from mmpar.checkpoint import load_model_state
from mmpar.parallelize.meta import MetaInit

# The largest part (bytes of whole tensors) a meta-built model loads at once.
PART_BYTES = 256 << 20


class DeferredInit:
    """A plain model's ``init_weights``, kept for ``Runner.train()``.

    Build it with :meth:`of_meta` or :meth:`of_whole` before the layout is
    applied; call :meth:`run` (every rank) where MMEngine initialises.
    """

    def __init__(self, plain: nn.Module, meta_init: Optional[MetaInit],
                 device: torch.device):
        self._plain = plain
        self._meta_init = meta_init
        self._device = device

    @classmethod
    def of_meta(cls, model: nn.Module,
                meta_init: MetaInit) -> Optional['DeferredInit']:
        """For a model :func:`~mmpar.parallelize.meta.build_on_meta` built
        with ``init_weights=False``; None when it has no ``init_weights``."""
        if not hasattr(model, 'init_weights'):
            return None
        return cls(copy.deepcopy(model), meta_init, torch.device('cpu'))

    @classmethod
    def of_whole(cls, model: nn.Module,
                 device: torch.device) -> Optional['DeferredInit']:
        """For a model built whole, initialised on ``device`` (as MMEngine
        initialises it after moving it there); None when it has no
        ``init_weights``."""
        if not hasattr(model, 'init_weights'):
            return None
        return cls(copy.deepcopy(model).cpu(), None, device)

    def run(self, model: nn.Module) -> None:
        """Initialise ``model`` (the wrapped, sharded or split one) as
        MMEngine initialises a plain one. A collective: every rank calls it.
        """
        plain, self._plain = self._plain, None  # once, then freed
        if self._meta_init is None:
            _init_whole(model, plain.to(self._device))
        else:
            _init_from_meta(model, plain, self._meta_init)


def _init_whole(model: nn.Module, plain: nn.Module) -> None:
    """MMEngine's step on the whole copy, then its state into ``model``."""
    plain.init_weights()
    state = plain.state_dict()
    for tensor in state.values():
        broadcast(tensor)
    load_model_state(model, state, strict=True, revise_keys=[])


def _init_from_meta(model: nn.Module, plain: nn.Module,
                    meta_init: MetaInit) -> None:
    """``init_weights`` recorded on the meta copy; what it changed into
    ``model``, a part at a time."""
    changed = meta_init.record_init_weights(plain)
    # Buffers are real in the copy: rank 0's, as MMEngine broadcasts.
    params = {n for n, _ in plain.named_parameters(remove_duplicate=False)}
    buffers = {n: t for n, t in plain.state_dict().items() if n not in params}
    for tensor in buffers.values():
        broadcast(tensor)
    # Each changed parameter is made whole only as its part is loaded.
    values = itertools.chain(((n, meta_init.value(n)) for n in changed),
                             buffers.items())
    for part in _parts(values, PART_BYTES):
        load_model_state(model, part, strict=False, revise_keys=[])


def _parts(values: Iterator[Tuple[str, torch.Tensor]],
           limit: int) -> Iterator[Dict[str, torch.Tensor]]:
    """``values`` in dicts of about ``limit`` bytes, in order (every rank
    the same parts: each is a collective load)."""
    part, size = {}, 0
    for name, value in values:
        part[name] = value
        size += value.numel() * value.element_size()
        if size >= limit:
            yield part
            part, size = {}, 0
    if part:
        yield part
