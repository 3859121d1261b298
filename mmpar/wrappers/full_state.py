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
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from mmpar.dist import uses_cuda


def _options(**kwargs) -> StateDictOptions:
    # Offloading a full state dict to CPU crashes FSDP1 on a CPU-only machine
    # (segfault or "setStorage ... out of bounds"); there the tensors are in
    # host memory anyway. On CUDA, offload (rank 0 then gets the whole dict,
    # the other ranks an empty one).
    return StateDictOptions(
        full_state_dict=True, cpu_offload=uses_cuda(), **kwargs)


def full_state_dict(module: nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded model state, keys exactly as the plain model's.

    An OrderedDict, as ``nn.Module.state_dict`` returns (MMEngine's
    ``weights_to_cpu`` sets ``_metadata`` on it).
    """
    return OrderedDict(get_model_state_dict(module, options=_options()))


def load_full_state_dict(module: nn.Module, state_dict: Dict[str, Any],
                         strict: bool = True) -> Any:
    """Load a full (plain-model) state dict into the (sharded) module."""
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
