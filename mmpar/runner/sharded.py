"""What the Runner does differently for wrappers that shard parameters.

MMEngine's Runner assumes every rank holds the whole model:

* ``_init_model_weights`` broadcasts every tensor of the state dict after
  ``init_weights``; on sharded parameters that aborts (gloo) or fails
  (``c10d.broadcast_ ... does not have a sharding strategy``). mmpar
  initialises and broadcasts the plain model *before* sharding instead
  (:mod:`mmpar.parallelize.compose`).
* Loading a full checkpoint into a sharded model must scatter it, on every
  rank.
* Sharded runs save the optimizer state in full, keyed by parameter names
  (``collect_checkpoint`` calls the wrapper's ``full_optim_state_dict``);
  before MMEngine's ``resume`` loads it, it becomes this process's own form,
  under any wrapper or none.

Saving needs nothing here: mmpar's ``save_checkpoint`` runs on every rank and
asks sharded wrappers for ``full_state_dict`` / ``full_optim_state_dict``
(:class:`mmpar.wrappers.full_state.FullStateMixin`).
"""
import copy
import re
from collections import OrderedDict

from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     set_optimizer_state_dict)

# One answer to "is it sharded?", kept importable from here.
from mmpar.parallelize.compose import is_sharded, wrapper_shards  # noqa: F401
from mmpar.wrappers.full_state import FullStateMixin


def _revise(state: dict, revise_keys: list) -> dict:
    for pattern, replacement in revise_keys:
        state = OrderedDict(
            (re.sub(pattern, replacement, k), v) for k, v in state.items())
    return state


def load_full_model_state(model: FullStateMixin, checkpoint: dict,
                          strict: bool, revise_keys: list) -> None:
    """Load a full checkpoint's weights into a sharded model (every rank)."""
    state = checkpoint.get('state_dict', checkpoint)
    model.load_full_state_dict(_revise(state, revise_keys), strict=strict)


def _is_full_optim_state(state: dict) -> bool:
    # Full state is keyed by parameter names; a plain optimizer's by index.
    groups = state.get('param_groups') or [{}]
    params = groups[0].get('params') or [None]
    return isinstance(params[0], str)


def _names_for_indices(model: nn.Module, optimizer, saved: dict) -> dict:
    """Index-keyed optimizer state (a DDP or one-process run) by names.

    Index ``i`` is the optimizer's i-th parameter across its groups; this run
    builds its optimizer from the same model in the same order, so the
    current optimizer's parameters name the indices.
    """
    from torch.distributed.fsdp._common_utils import clean_tensor_name
    names = {p: clean_tensor_name(n) for n, p in model.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g['params']]
    return dict(
        state={order[i]: v for i, v in saved['state'].items()},
        param_groups=[
            dict(g, params=[order[i] for i in g['params']])
            for g in saved['param_groups']
        ])


def localize_optim_state(runner, checkpoint: dict) -> None:
    """Turn name-keyed optimizer state into this process's form, in place.

    ``checkpoint['optimizer']`` in the full form sharded runs save (or, for a
    sharded model, the index-keyed form DDP and one-process runs save) becomes
    what ``optim_wrapper.state_dict()`` would return here (sharded or plain
    model), so MMEngine's ``resume`` loads it with
    ``optim_wrapper.load_state_dict`` as usual. The optimizer itself is left
    as it was (``load_from`` does not restore optimizer state). Anything
    else is left untouched.
    """
    saved = checkpoint.get('optimizer')
    optim_wrapper = runner.optim_wrapper
    if not (isinstance(saved, dict) and 'param_groups' in saved
            and isinstance(optim_wrapper, OptimWrapper)):
        return
    optimizer = optim_wrapper.optimizer
    if _is_full_optim_state(saved):
        full = {k: saved[k] for k in ('state', 'param_groups')}
    elif is_sharded(runner.model):
        # Saved unsharded by index (DDP, one process): resuming it sharded.
        full = _names_for_indices(runner.model, optimizer, saved)
    else:
        return
    before = copy.deepcopy(optimizer.state_dict())
    if is_sharded(runner.model):
        runner.model.load_full_optim_state_dict(optimizer, full)
    else:
        model = runner.model
        model = model.module if is_model_wrapper(model) else model
        set_optimizer_state_dict(
            model, optimizer, full,
            options=StateDictOptions(full_state_dict=True))
    local = dict(saved)
    local.update(optimizer.state_dict())
    optimizer.load_state_dict(before)
    checkpoint['optimizer'] = local
