"""What the Runner does differently for wrappers that shard parameters.

MMEngine's Runner assumes every rank holds the whole model:

* ``_init_model_weights`` broadcasts every tensor of the state dict after
  ``init_weights``; on sharded parameters that aborts (gloo) or fails
  (``c10d.broadcast_ ... does not have a sharding strategy``). mmpar
  initialises and broadcasts the plain model *before* sharding instead.
* ``save_checkpoint`` runs on rank 0 only (``@master_only``) and reads
  ``model.state_dict()`` and ``optim_wrapper.state_dict()``: under FSDP that is
  rank 0's shards (FSDP2) or a collective only rank 0 joins (FSDP1, a hang).
  mmpar gathers the full model and optimizer state on every rank first, then
  lets rank 0 write them in MMEngine's usual checkpoint layout.
* Loading a full checkpoint into a sharded model must scatter it, on every
  rank; the optimizer state is turned into this rank's local form so that
  MMEngine's ``resume`` loads it as usual.

The wrappers that shard provide ``full_state_dict`` and friends
(:class:`mmpar.wrappers.full_state.FullStateMixin`).
"""
import contextlib
import copy
import re
from collections import OrderedDict
from typing import Iterator, List, Optional, Tuple

from mmengine.dist import broadcast
from mmengine.optim import OptimWrapper
from torch import nn

from mmpar.wrappers.builder import DEFAULT_WRAPPER, wrapper_class
from mmpar.wrappers.full_state import FullStateMixin


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a wrapper that shards its parameters."""
    return isinstance(model, FullStateMixin)


def wrapper_shards(model_wrapper_cfg: Optional[dict]) -> bool:
    """Whether the wrapper this config builds shards its parameters."""
    cls = wrapper_class((model_wrapper_cfg or {}).get('type', DEFAULT_WRAPPER))
    return issubclass(cls, FullStateMixin)


def init_weights_before_sharding(model: nn.Module) -> None:
    """MMEngine's ``_init_model_weights``, on the plain model.

    Runs ``init_weights`` and broadcasts rank 0's tensors, as MMEngine does
    after wrapping; the Runner then skips its own (sharded) version.
    """
    if hasattr(model, 'init_weights'):
        model.init_weights()
        for tensor in model.state_dict().values():
            broadcast(tensor)


def _full_optim_state(runner) -> Optional[dict]:
    optim_wrapper = runner.optim_wrapper
    if not isinstance(optim_wrapper, OptimWrapper):
        return None
    # The wrapper's own entries (e.g. an AMP loss scaler) stay; the
    # optimizer's 'state' and 'param_groups' become the full, name-keyed form.
    state = optim_wrapper.state_dict()
    state.update(runner.model.full_optim_state_dict(optim_wrapper.optimizer))
    return state


@contextlib.contextmanager
def full_state_for_saving(runner) -> Iterator[None]:
    """Inside the block, MMEngine's ``save_checkpoint`` sees full state.

    A collective: every rank must enter. The full model and optimizer state
    are gathered here; while the block runs, ``runner.model.module.state_dict``
    and ``runner.optim_wrapper.state_dict`` return them (instance attributes
    shadowing the methods, removed on exit), so MMEngine's checkpoint layout,
    hooks and file handling are reused unchanged.
    """
    # An OrderedDict, as nn.Module.state_dict returns: MMEngine's
    # weights_to_cpu sets ``_metadata`` on it.
    model_state = OrderedDict(runner.model.full_state_dict())
    optim_state = _full_optim_state(runner)
    patched: List[Tuple[object, str]] = []

    def shadow(obj, name, value):
        setattr(obj, name, lambda *args, **kwargs: value)
        patched.append((obj, name))

    shadow(runner.model.module, 'state_dict', model_state)
    if optim_state is not None:
        shadow(runner.optim_wrapper, 'state_dict', optim_state)
    try:
        yield
    finally:
        for obj, name in patched:
            delattr(obj, name)


def _revise(state: dict, revise_keys: list) -> dict:
    for pattern, replacement in revise_keys:
        state = OrderedDict(
            (re.sub(pattern, replacement, k), v) for k, v in state.items())
    return state


def _is_full_optim_state(state: dict) -> bool:
    # Full state is keyed by parameter names; a plain optimizer's by index.
    groups = state.get('param_groups') or [{}]
    params = groups[0].get('params') or [None]
    return isinstance(params[0], str)


def load_full_checkpoint(runner, checkpoint: dict, strict: bool,
                         revise_keys: list) -> dict:
    """Load a full checkpoint's weights into a sharded model (every rank).

    ``checkpoint['optimizer']``, when in the full form this module saves, is
    replaced by this rank's local form, which MMEngine's ``resume`` then loads
    with ``optim_wrapper.load_state_dict``; the optimizer itself is left as it
    was (``load_from`` does not restore optimizer state).

    Returns:
        The checkpoint.
    """
    state = checkpoint.get('state_dict', checkpoint)
    runner.model.load_full_state_dict(_revise(state, revise_keys),
                                      strict=strict)
    saved_optim = checkpoint.get('optimizer')
    optim_wrapper = runner.optim_wrapper
    if (isinstance(saved_optim, dict) and _is_full_optim_state(saved_optim)
            and isinstance(optim_wrapper, OptimWrapper)):
        optimizer = optim_wrapper.optimizer
        before = copy.deepcopy(optimizer.state_dict())
        runner.model.load_full_optim_state_dict(
            optimizer, {k: saved_optim[k]
                        for k in ('state', 'param_groups')})
        local = dict(saved_optim)
        local.update(optimizer.state_dict())
        optimizer.load_state_dict(before)
        checkpoint['optimizer'] = local
    return checkpoint
