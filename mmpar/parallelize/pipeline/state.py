"""Checkpoint state of a pipelined model, in the plain model's terms.

Each pp rank holds a few stage copies of the model (plain, DDP-, FSDP2- or
tensor-parallel-wrapped); stages keep the original parameter names, so
every rank can say which part of the plain model it holds. This mixin of
:class:`~mmpar.parallelize.pipeline.step.MMPipelineParallel` gives the
methods mmpar's checkpoint code calls on any wrapper:

* full format: ``full_state_dict`` / ``full_optim_state_dict`` gather every
  stage (DTensors made whole, then all pp ranks' parts into one) and
  ``load_full_state_dict`` / ``plain_param_names`` let each stage take its
  own keys back (:func:`mmpar.checkpoint.state.localize_optim_state`);
* sharded (DCP) format: ``distributed_state_dict`` hands DCP this rank's
  tensors (shards stay DTensors) with the non-tensor optimizer parts of
  every pp rank, and ``load_distributed_state_dict`` takes them back.

All are collectives over the pp group (and over a stage's own mesh for
DTensors): every rank calls them.
"""
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mmpar.checkpoint.full import to_cpu
from mmpar.checkpoint.named_optim import (localize_named_optim_state,
                                          merge_named_optim_states,
                                          named_optim_state)
from mmpar.parallelize.tensor import distribute_like


def _unwrap(module: nn.Module) -> nn.Module:
    return getattr(module, 'module', module)


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class PipelineStateMixin:
    """State methods for a module with ``stages`` and ``pp_group``."""

    stages: List[nn.Module]
    pp_group: object

    def _gather_pp(self, obj) -> list:
        parts = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(parts, obj, group=self.pp_group)
        return parts

    def _stage_states(self) -> List[Dict[str, torch.Tensor]]:
        return [_unwrap(stage).state_dict() for stage in self.stages]

    def plain_param_names(self) -> Dict[torch.Tensor, str]:
        """Each parameter of this rank's stages -> its plain-model name."""
        return {
            param: name
            for stage in self.stages
            for name, param in _unwrap(stage).named_parameters()
        }

    # -- full format --------------------------------------------------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every stage's state gathered into one plain-model state dict.

        Keys are the unsplit model's (stages keep the original names), so
        the result loads with ``strict=True`` into the unsplit model. Every
        rank gets it (on the CPU).
        """
        local = OrderedDict(
            (k, _whole(v).detach().cpu())
            for part in self._stage_states() for k, v in part.items())
        merged = OrderedDict()
        for part in self._gather_pp(local):
            merged.update(part)
        return merged

    def load_full_state_dict(self, state_dict: Dict[str, torch.Tensor],
                             strict: bool = True) -> None:
        """Load a plain-model state dict: each stage takes its own keys (cut
        to this rank's shard where the stage holds DTensors).

        Raises:
            RuntimeError: with ``strict``, a key of a stage missing from
                ``state_dict``.
        """
        for stage, own in zip(self.stages, self._stage_states()):
            part = {
                k: distribute_like(state_dict[k], own[k])
                for k in own if k in state_dict
            }
            _unwrap(stage).load_state_dict(part, strict=strict)

    def full_optim_state_dict(self, optim_wrapper) -> dict:
        """The optimizer state of every stage, keyed by plain names (the form
        full checkpoints of sharded runs have; it resumes at any layout).
        The optim wrapper's own entries (e.g. an AMP loss scaler) are kept.
        """
        state = optim_wrapper.state_dict()
        local = named_optim_state(optim_wrapper.optimizer,
                                  self.plain_param_names(), full=True)
        local['state'] = to_cpu(local['state'])  # before pickling
        state.update(merge_named_optim_states(self._gather_pp(local)))
        return state

    def localize_optim_state(self, optimizer: torch.optim.Optimizer,
                             saved: dict) -> dict:
        """Name-keyed optimizer state as this rank's ``optimizer.state_dict()``
        (see :func:`mmpar.checkpoint.named_optim.localize_named_optim_state`).
        """
        return localize_named_optim_state(optimizer,
                                          self.plain_param_names(), saved)

    # -- sharded (DCP) format -----------------------------------------------
    def distributed_state_dict(
            self, optimizer: Optional[torch.optim.Optimizer]
    ) -> Tuple[Dict[str, torch.Tensor], Optional[dict]]:
        """``(model_state, optim_state)`` for DCP, as torch's
        ``get_state_dict`` gives them for an unsplit model: plain names, this
        rank's tensors (DTensors stay sharded); the optimizer's non-tensor
        parts (param groups) are every pp rank's, since only rank 0 writes
        them."""
        model_state = OrderedDict(
            (k, v) for part in self._stage_states() for k, v in part.items())
        if optimizer is None:
            return model_state, None
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        _init_optim_state(optimizer)  # DCP needs tensors to load into
        local = named_optim_state(optimizer, self.plain_param_names(),
                                  full=False)
        others = self._gather_pp(
            dict(state={}, param_groups=local['param_groups']))
        local['param_groups'] = merge_named_optim_states(
            others)['param_groups']
        return model_state, local

    def load_distributed_state_dict(
            self, optimizer: Optional[torch.optim.Optimizer],
            model_state: Dict[str, torch.Tensor], optim_state: Optional[dict],
            strict: bool) -> None:
        """Load what DCP read into :meth:`distributed_state_dict`'s dicts."""
        for stage, own in zip(self.stages, self._stage_states()):
            part = {k: model_state[k] for k in own if k in model_state}
            _unwrap(stage).load_state_dict(part, strict=strict)
        if optimizer is not None and optim_state is not None:
            optimizer.load_state_dict(
                self.localize_optim_state(optimizer, optim_state))
