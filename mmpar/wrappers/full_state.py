"""Full (unsharded) model and optimizer state of a module, in the plain
model's names, whatever holds its tensors (FSDP1 or FSDP2 shards, tensor-
parallel DTensors, or whole tensors).

torch's ``torch.distributed.checkpoint.state_dict`` API gathers full state
for all of them; these functions fix its options once. The module is the
one whose names are the plain model's (``describe(model).state_module``).
Every function is a collective when the module holds shards: all ranks call
it.
"""
from collections import OrderedDict
from typing import Any, Dict

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from mmpar.device import uses_accelerator


def _options() -> StateDictOptions:
    # Offloading a full state dict to CPU crashes FSDP1 on a CPU-only machine
    # (segfault or "setStorage ... out of bounds"); there the tensors are in
    # host memory anyway. On CUDA, offload (rank 0 then gets the whole dict,
    # the other ranks an empty one).
    return StateDictOptions(
        full_state_dict=True, cpu_offload=uses_accelerator())


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded model state, keys exactly as the plain model's.

    An OrderedDict, as ``nn.Module.state_dict`` returns (MMEngine's
    ``weights_to_cpu`` sets ``_metadata`` on it).
    """
    return OrderedDict(get_model_state_dict(module, options=_options()))


def load_full_state_dict(module: nn.Module, state_dict: Dict[str, Any],
                         strict: bool = True) -> None:
    """Load a full (plain-model) state dict into the module: every rank cuts
    its own part of each tensor locally (a DTensor's shard through
    ``distribute_tensor(..., src_data_rank=None)``: no communication), so a
    memory-mapped checkpoint is read only where this rank keeps it, one
    tensor at a time. (FSDP1, whose flat parameters are no DTensors, loads
    through torch's state-dict API instead: :func:`load_through_torch`.)

    Raises:
        RuntimeError: with ``strict``, keys missing or unexpected.
    """
    own = module.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f'Error(s) in loading state_dict for {type(module).__name__}: '
            f'missing keys {missing[:5]}, unexpected keys {unexpected[:5]}')
    with torch.no_grad():
        for key, target in own.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if isinstance(target, DTensor):
                local = distribute_tensor(value.to(target.device),
                                          target.device_mesh,
                                          target.placements,
                                          src_data_rank=None).to_local()
                target.to_local().copy_(local)
            else:
                target.copy_(value)


def load_through_torch(module: nn.Module, state_dict: Dict[str, Any],
                       strict: bool = True) -> Any:
    """Load a full state dict with torch's state-dict API (FSDP1)."""
    return set_model_state_dict(
        module, state_dict,
        options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optim_state_dict(module: nn.Module,
                          optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state unsharded, keyed by parameter names."""
    return get_optimizer_state_dict(module, optimizer, options=_options())


def load_full_optim_state_dict(module: nn.Module,
                               optimizer: torch.optim.Optimizer,
                               state_dict: dict) -> None:
    """Load what :func:`full_optim_state_dict` returned (on every rank)."""
    set_optimizer_state_dict(module, optimizer, state_dict,
                             options=StateDictOptions(full_state_dict=True))
