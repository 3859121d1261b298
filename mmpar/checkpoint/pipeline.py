"""Checkpoint state of a pipelined model, in the plain model's terms.

Each pp rank holds a few stage copies of the model (plain, DDP-, FSDP2- or
tensor-parallel-wrapped); stages keep the original parameter names, so
every rank can say which part of the plain model it holds. The model's
description (:class:`mmpar.wrappers.PipelineParts`) gives the stages; the
functions here are what the two formats do with them:

* full format: :func:`full_state_dict` / :func:`full_optim_state_dict`
  gather every stage (DTensors made whole, then all pp ranks' parts into
  one); :func:`load_full_state_dict` / :func:`localize_optim_state` let each
  stage take its own keys back;
* sharded (DCP) format: :func:`distributed_state_dict` hands DCP this rank's
  tensors (shards stay DTensors) with the non-tensor optimizer parts of
  every pp rank, and :func:`load_distributed_state_dict` takes them back.

All are collectives over the pp group (and over a stage's own mesh for
DTensors): every rank calls them.
"""
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from mmpar.checkpoint.files import to_cpu
from mmpar.checkpoint.named_optim import (localize_named_optim_state,
                                          merge_named_optim_states,
                                          named_optim_state)
from mmpar.dist import all_gather_objects
from mmpar.parallel.dtensor import distribute_like
from mmpar.wrappers.description import PipelineParts


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _stage_states(parts: PipelineParts) -> List[Dict[str, torch.Tensor]]:
    return [stage.state_dict() for stage in parts.stage_modules]


def plain_param_names(parts: PipelineParts) -> Dict[torch.Tensor, str]:
    """Each parameter of this rank's stages -> its plain-model name."""
    return {
        param: name
        for stage in parts.stage_modules
        for name, param in stage.named_parameters()
    }


# -- full format --------------------------------------------------------
def full_state_dict(parts: PipelineParts) -> Dict[str, torch.Tensor]:
    """Every stage's state gathered into one plain-model state dict.

    Keys are the unsplit model's (stages keep the original names), so the
    result loads with ``strict=True`` into the unsplit model. Every rank
    gets it (on the CPU).
    """
    local = OrderedDict(
        (k, _whole(v).detach().cpu())
        for part in _stage_states(parts) for k, v in part.items())
    merged = OrderedDict()
    for part in all_gather_objects(local, parts.pp_group):
        merged.update(part)
    return merged


def load_full_state_dict(parts: PipelineParts,
                         state_dict: Dict[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Load a plain-model state dict: each stage takes its own keys (cut to
    this rank's shard where the stage holds DTensors).

    Raises:
        RuntimeError: with ``strict``, a key of a stage missing from
            ``state_dict``.
    """
    for stage, own in zip(parts.stage_modules, _stage_states(parts)):
        part = {
            k: distribute_like(state_dict[k], own[k])
            for k in own if k in state_dict
        }
        stage.load_state_dict(part, strict=strict)


def full_optim_state_dict(parts: PipelineParts, optim_wrapper) -> dict:
    """The optimizer state of every stage, keyed by plain names (the form
    full checkpoints of sharded runs have; it resumes at any layout). The
    optim wrapper's own entries (e.g. an AMP loss scaler) are kept.
    """
    state = optim_wrapper.state_dict()
    local = named_optim_state(optim_wrapper.optimizer,
                              plain_param_names(parts), full=True)
    local['state'] = to_cpu(local['state'])  # before pickling
    state.update(merge_named_optim_states(
        all_gather_objects(local, parts.pp_group)))
    return state


def localize_optim_state(parts: PipelineParts,
                         optimizer: torch.optim.Optimizer,
                         saved: dict) -> dict:
    """Name-keyed optimizer state as this rank's ``optimizer.state_dict()``
    (see :func:`mmpar.checkpoint.named_optim.localize_named_optim_state`)."""
    return localize_named_optim_state(optimizer, plain_param_names(parts),
                                      saved)


# -- sharded (DCP) format -------------------------------------------------
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh ``optimizer`` its state tensors, for DCP to load into.

    What torch's ``get_state_dict`` does first: one step on zero gradients
    with the learning rates at 0, so the parameters do not move (the
    restored state replaces what the step wrote). Nothing if the optimizer
    has state already or a parameter has a gradient (a stateless optimizer
    mid-step).
    """
    groups = optimizer.param_groups
    if optimizer.state or any(p.grad is not None for group in groups
                              for p in group['params']):
        return
    for group in groups:
        for param in group['params']:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    lrs = [group.get('lr') for group in groups]
    for group in groups:
        if 'lr' in group:
            group['lr'] = torch.tensor(0.0) if isinstance(
                group['lr'], torch.Tensor) else 0.0
    optimizer.step()
    for group, lr in zip(groups, lrs):
        if 'lr' in group:
            group['lr'] = lr
    optimizer.zero_grad(set_to_none=True)


def distributed_state_dict(
        parts: PipelineParts, optimizer: Optional[torch.optim.Optimizer]
) -> Tuple[Dict[str, torch.Tensor], Optional[dict]]:
    """``(model_state, optim_state)`` for DCP, as torch's ``get_state_dict``
    gives them for an unsplit model: plain names, this rank's tensors
    (DTensors stay sharded); the optimizer's non-tensor parts (param groups)
    are every pp rank's, since only rank 0 writes them."""
    model_state = OrderedDict(
        (k, v) for part in _stage_states(parts) for k, v in part.items())
    if optimizer is None:
        return model_state, None
    _init_optimizer_state(optimizer)
    local = named_optim_state(optimizer, plain_param_names(parts), full=False)
    others = all_gather_objects(
        dict(state={}, param_groups=local['param_groups']), parts.pp_group)
    local['param_groups'] = merge_named_optim_states(others)['param_groups']
    return model_state, local


def load_distributed_state_dict(parts: PipelineParts,
                                optimizer: Optional[torch.optim.Optimizer],
                                model_state: Dict[str, torch.Tensor],
                                optim_state: Optional[dict],
                                strict: bool) -> None:
    """Load what DCP read into :func:`distributed_state_dict`'s dicts."""
    for stage, own in zip(parts.stage_modules, _stage_states(parts)):
        part = {k: model_state[k] for k in own if k in model_state}
        stage.load_state_dict(part, strict=strict)
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(
            localize_optim_state(parts, optimizer, optim_state))
