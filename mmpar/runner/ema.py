"""MMEngine's ``EMAHook`` (and downstream subclasses) under every layout.

``EMAHook.before_run`` builds its averaged copy with
``MODELS.build(ema_cfg, default_args=dict(model=runner.model.module))``,
and MMEngine's averaging classes (``BaseAveragedModel``) deep-copy that
model: FSDP2 refuses (``FSDP does not support deepcopy``), FSDP1 cannot be
pickled, and a tensor-parallel or pipelined model would be copied as
whatever part this rank holds, without a way to save it. Everything else
``BaseAveragedModel`` and ``EMAHook`` do goes tensor by tensor and element
by element (``avg_func`` on each parameter, swaps of ``.data``), so it is
just as right on this rank's shards as on whole tensors.

So the hook and its averaging class stay as they are (subclasses, other
scopes, ``interval``, ``begin_iter``, ``update_buffers``), and the Runner
changes two things around them:

* while the hook builds its copy, ``runner.model`` is a
  :class:`LocalShardsView` of the model: its parameters, buffers and state
  dict are this rank's local tensors (live), and its deep copy holds one
  shard of each (:func:`mmpar.wrappers.local_state.local_module`). The
  hook keeps the view as ``src_model``; updates and swaps land in the
  model's own shards. A model every rank holds whole (one process, DDP) is
  left as MMEngine has it.
* the averaged copy's state dict goes through the model, as a shadow of it
  (:mod:`mmpar.checkpoint.shadow`): for a full checkpoint the Runner
  gathers it on every rank before the rank-0 hooks run, and
  ``ema_model.state_dict()`` then returns the gathered plain-model tensors;
  loading a full state dict into the copy cuts it through the model; a
  sharded checkpoint holds it as a DCP directory ``ema/``, and the hooks
  see stand-ins for its tensors (:mod:`mmpar.checkpoint.refs`).
"""
import contextlib
import copy
import functools
from typing import Dict, Iterator, Optional

from mmengine.hooks import EMAHook
from mmengine.model import BaseAveragedModel
from torch import nn

from mmpar.checkpoint.refs import StoredTensor, stand_ins, stored_part
from mmpar.checkpoint.shadow import full_shadow_state, load_full_shadow_state
from mmpar.checkpoint.sharded import load_into_shadow
from mmpar.wrappers.local_state import holds_whole_model, local_module

#: The part of a sharded checkpoint that holds the averaged copy.
EMA_PART = 'ema'


class LocalShardsView(nn.Module):
    """This rank's part of a model, as MMEngine's averaging reads a model.

    ``parameters()``, ``buffers()``, their named forms and ``state_dict()``
    give the model's local tensors under the plain model's names, read anew
    on each call (FSDP may move its shards, and frees gathered parameters
    first); a deep copy is a plain module of copies of them. It has no
    forward: no rank can run the model from its shards alone.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        # Not a submodule: the view has no tensors of its own.
        object.__setattr__(self, 'wrapped', model)

    def named_parameters(self, *args, **kwargs):
        return local_module(self.wrapped).named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return local_module(self.wrapped).named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return local_module(self.wrapped).state_dict(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        return copy.deepcopy(local_module(self.wrapped), memo)

    def forward(self, *args, **kwargs):
        raise RuntimeError('a LocalShardsView holds one rank\'s shards of '
                           'the model and cannot run forward; run the model')


class AveragedCopy:
    """One ``EMAHook``'s averaged copy, kept as a shadow of the model.

    Adds two hooks to the copy the ``EMAHook`` built: its ``state_dict()``
    returns what the Runner staged (gathered tensors, or stand-ins), and a
    load of plain-model tensors or stand-ins goes through the model.
    """

    def __init__(self, hook: EMAHook, model: nn.Module):
        self.hook = hook
        self.model = model
        self.whole = holds_whole_model(model)
        self._staged: Optional[dict] = None
        averaged = hook.ema_model
        # (A partial: torch marks the hook with an attribute, which a bound
        # method cannot take.)
        averaged.register_state_dict_post_hook(
            functools.partial(self._staged_state))
        averaged.module.register_load_state_dict_pre_hook(self._load)

    @property
    def shadow(self) -> nn.Module:
        """The averaged tensors (shaped as the model's local ones)."""
        return self.hook.ema_model.module

    @contextlib.contextmanager
    def staged(self, entries: Dict) -> Iterator[None]:
        """Within the block ``ema_model.state_dict()`` holds ``entries``
        (plain-model keys) under ``module.``."""
        self._staged = entries
        try:
            yield
        finally:
            self._staged = None

    def _staged_state(self, module, state_dict, prefix, local_metadata):
        if self._staged is None:
            return
        inner = prefix + 'module.'
        kept = [(k, v) for k, v in state_dict.items()
                if not k.startswith(inner)]
        state_dict.clear()
        state_dict.update(kept)
        state_dict.update((inner + k, v) for k, v in self._staged.items())

    def _load(self, module, state_dict, prefix, local_metadata, strict,
              missing_keys, unexpected_keys, error_msgs):
        incoming = {k[len(prefix):]: v for k, v in state_dict.items()
                    if k.startswith(prefix)}
        part = stored_part(incoming)
        if part is not None:  # a sharded checkpoint's part
            path = next(v.path for v in incoming.values()
                        if isinstance(v, StoredTensor))
            load_into_shadow(self.model, module, path, part)
        elif self.whole or not incoming:
            return  # MMEngine's own load: the copy is the model's shape
        else:  # a plain model's full tensors
            load_full_shadow_state(self.model, module, incoming)
        # torch's own load of the copy then takes what it now holds; keys
        # that differ are reported by it as usual (strict_load).
        own = module.state_dict()
        for name in incoming:
            if name in own:
                state_dict[prefix + name] = own[name]


class EMAHooks:
    """The Runner's side: builds, gathers and stages the averaged copy."""

    def __init__(self):
        self.copies: Dict[int, AveragedCopy] = {}

    @contextlib.contextmanager
    def building(self, runner, hook) -> Iterator[None]:
        """Around ``hook.before_run(runner)``: an ``EMAHook`` builds its
        averaged copy from a :class:`LocalShardsView` of a model that is not
        whole on every rank."""
        if not isinstance(hook, EMAHook):
            yield
            return
        model = runner.model
        if not holds_whole_model(model):
            runner.model = LocalShardsView(model)
        try:
            yield
        finally:
            runner.model = model
        averaged = hook.ema_model
        if not isinstance(averaged, BaseAveragedModel):
            raise TypeError(
                f'{type(hook).__name__}(ema_type={hook.ema_cfg["type"]!r}) '
                f'built a {type(averaged).__name__}; mmpar needs a '
                'mmengine.model.BaseAveragedModel (it averages tensor by '
                'tensor, so it works on this rank\'s shards); allowed: '
                'ExponentialMovingAverage, MomentumAnnealingEMA, '
                'StochasticWeightAverage or a subclass')
        self.copies[id(hook)] = AveragedCopy(hook, model)

    def _sharded(self):
        return [c for c in self.copies.values() if not c.whole]

    @contextlib.contextmanager
    def full_states_staged(self, model: nn.Module) -> Iterator[None]:
        """Every rank, before a full checkpoint's rank-0 hooks: gathers each
        averaged copy of a sharded or pipelined model (a collective) and
        stages it as its ``state_dict()``."""
        with contextlib.ExitStack() as stack:
            for averaged in self._sharded():
                stack.enter_context(averaged.staged(
                    full_shadow_state(model, averaged.shadow)))
            yield

    @contextlib.contextmanager
    def stand_ins_staged(self, model_keys) -> Iterator[None]:
        """Rank 0, around a sharded checkpoint's hooks: the averaged copy's
        ``state_dict()`` names its part of the checkpoint."""
        with contextlib.ExitStack() as stack:
            for averaged in self.copies.values():
                stack.enter_context(averaged.staged(
                    stand_ins(EMA_PART, model_keys)))
            yield

    def shadows(self) -> Dict[str, nn.Module]:
        """Part name -> averaged tensors, for a sharded checkpoint."""
        return {EMA_PART: c.shadow for c in self.copies.values()}
