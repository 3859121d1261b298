"""Full (unsharded) model and optimizer state for both FSDP wrappers.

Checkpoints must hold the whole model with the plain model's keys, whatever
the sharding, so a checkpoint from FSDP training loads into a single-process
model with ``strict=True``. torch's ``torch.distributed.checkpoint.state_dict``
API gathers full state for FSDP1 and FSDP2 alike. Every method here is a
collective: all ranks must call it.
"""
from collections import OrderedDict
from typing import Any, Dict, Union

import torch
from mmengine.optim import OptimWrapper
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


class FullStateMixin:
    """``full_state_dict`` and friends; ``_sharded_root`` is the FSDP root."""

    @property
    def _sharded_root(self) -> nn.Module:
        return self

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The unsharded model state; keys exactly as the plain model's.

        An OrderedDict, as ``nn.Module.state_dict`` returns (MMEngine's
        ``weights_to_cpu`` sets ``_metadata`` on it).
        """
        return OrderedDict(
            get_model_state_dict(self._sharded_root, options=_options()))

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor],
                             strict: bool = True) -> Any:
        """Load a full (plain-model) state dict into the sharded model."""
        return set_model_state_dict(
            self._sharded_root,
            state_dict,
            options=StateDictOptions(full_state_dict=True, strict=strict))

    def full_optim_state_dict(
            self, optimizer: Union[torch.optim.Optimizer,
                                   OptimWrapper]) -> dict:
        """The optimizer state unsharded, keyed by parameter names.

        Given an ``OptimWrapper``, its own entries (e.g. an AMP loss scaler)
        are kept and its optimizer's ``state``/``param_groups`` replaced.
        """
        if isinstance(optimizer, OptimWrapper):
            state = optimizer.state_dict()
            state.update(self.full_optim_state_dict(optimizer.optimizer))
            return state
        return get_optimizer_state_dict(
            self._sharded_root, optimizer, options=_options())

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer,
                                   state_dict: dict) -> None:
        """Load what :meth:`full_optim_state_dict` returned (on every rank)."""
        set_optimizer_state_dict(
            self._sharded_root,
            optimizer,
            state_dict,
            options=StateDictOptions(full_state_dict=True))
