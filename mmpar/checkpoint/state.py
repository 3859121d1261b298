"""Model and optimizer state under any wrapper, in the plain model's terms.

Sharded wrappers (FSDP1, FSDP2) provide ``full_state_dict`` /
``full_optim_state_dict`` / ``load_full_*`` (collectives: every rank calls
them); DDP-like wrappers hold the plain model as ``.module``. Full
checkpoints of sharded runs key the optimizer state by parameter names, DDP
and one-process runs by index; :func:`localize_optim_state` turns either into
what this process's optim wrapper loads.
"""
import copy
import re
from collections import OrderedDict

import torch
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapper
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     set_optimizer_state_dict)

from mmpar.checkpoint.files import CheckpointLoadError
from mmpar.parallelize.compose import is_sharded


def model_state(model: torch.nn.Module) -> dict:
    """The plain model's full state dict, keys as ``model.state_dict()``.

    A wrapper whose parameters are sharded provides ``full_state_dict()``
    (collective: every rank must call it); otherwise the inner module's state
    dict is used.
    """
    if hasattr(model, 'full_state_dict'):
        return model.full_state_dict()
    module = model.module if is_model_wrapper(model) else model
    return module.state_dict()


def optimizer_state(model: torch.nn.Module, optim_wrapper) -> dict:
    """Optimizer state in a form that loads under any wrapper.

    Sharded wrappers provide ``full_optim_state_dict(optim_wrapper)``
    (collective); otherwise the optim wrapper's own state dict.
    """
    if hasattr(model, 'full_optim_state_dict'):
        return model.full_optim_state_dict(optim_wrapper)
    return optim_wrapper.state_dict()


def stateful_module(model: nn.Module) -> nn.Module:
    """The module whose ``get_state_dict`` keys are the plain model's.

    Sharded wrappers name their FSDP root (FSDP1: the wrapper itself; FSDP2:
    the ``fully_shard``-ed model); DDP-like wrappers their inner module.
    """
    if hasattr(model, '_sharded_root'):
        return model._sharded_root
    return model.module if is_model_wrapper(model) else model


def _revise(state: dict, revise_keys: list) -> dict:
    for pattern, replacement in revise_keys:
        state = OrderedDict(
            (re.sub(pattern, replacement, k), v) for k, v in state.items())
    return state


def load_full_model_state(model: nn.Module, checkpoint: dict,
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


def localize_optim_state(model: nn.Module, optim_wrapper,
                         checkpoint: dict, resuming: bool = False) -> None:
    """Turn name-keyed optimizer state into this process's form, in place.

    ``checkpoint['optimizer']`` in the full form sharded runs save (or, for a
    sharded model, the index-keyed form DDP and one-process runs save) becomes
    what ``optim_wrapper.state_dict()`` would return here (sharded or plain
    model), so MMEngine's ``resume`` loads it with
    ``optim_wrapper.load_state_dict`` as usual. The optimizer itself is left
    as it was (``load_from`` does not restore optimizer state). Anything
    else is left untouched.

    A pipelined model (``plain_param_names``: its optimizer holds only this
    rank's stages) takes name-keyed state only; index-keyed state (a DDP or
    one-process run) cannot say which index is which of its parameters.

    Raises:
        CheckpointLoadError: ``resuming`` a pipelined model from index-keyed
            optimizer state.
    """
    saved = checkpoint.get('optimizer')
    if not (isinstance(saved, dict) and 'param_groups' in saved
            and isinstance(optim_wrapper, OptimWrapper)):
        return
    optimizer = optim_wrapper.optimizer
    if hasattr(model, 'plain_param_names'):
        if _is_full_optim_state(saved):
            local = dict(saved)
            local.update(model.localize_optim_state(optimizer, saved))
            checkpoint['optimizer'] = local
        elif resuming:
            raise CheckpointLoadError(
                'resume: this checkpoint holds the optimizer state of a '
                'one-process or DDP run (keyed by index), which a pipelined '
                'model (parallel.pp > 1) cannot match to its stages; allowed: '
                'a checkpoint saved under pp, FSDP or FSDP2, any '
                "checkpoint_format='sharded' one, or load_from (weights only)")
        return
    if _is_full_optim_state(saved):
        full = {k: saved[k] for k in ('state', 'param_groups')}
    elif is_sharded(model):
        # Saved unsharded by index (DDP, one process): resuming it sharded.
        # Names as the plain model has them: FSDP2's wrapper holds the model
        # as `module` (FSDP1's prefixes are cleaned by clean_tensor_name).
        full = _names_for_indices(model.module, optimizer, saved)
    else:
        return
    before = copy.deepcopy(optimizer.state_dict())
    if is_sharded(model):
        model.load_full_optim_state_dict(optimizer, full)
    else:
        model = model.module if is_model_wrapper(model) else model
        set_optimizer_state_dict(
            model, optimizer, full,
            options=StateDictOptions(full_state_dict=True))
    local = dict(saved)
    local.update(optimizer.state_dict())
    optimizer.load_state_dict(before)
    checkpoint['optimizer'] = local
