"""This rank's part of tensors laid out on a mesh (DTensors), and back.

Wrappers, the pipeline and checkpoints work on local shards: ranks at the
same tensor-parallel coordinate hold the same shard, so reducing local
shards over the data axis is plain data parallelism for a TP model, and a
whole tensor from a full checkpoint is cut to this rank's shard locally.
"""
from typing import List

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
# Private: the layout of a fused projection split part by part
# (docs/architecture.md, private names).
from torch.distributed.tensor.placement_types import _StridedShard


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if a DTensor."""
    if isinstance(tensor, DTensor):
        # Outside autograd: the shard itself (a parameter's: a plain view of
        # it), not a differentiable view, so in-place edits (a bucket copy,
        # an all-reduce) land in the parameter's storage.
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param.grad``, laid out as ``param`` is.

    DTensor's backward may leave a gradient in another layout than its
    parameter (a vocabulary-split embedding gets a replicated gradient); it
    is redistributed to the parameter's layout first (from Replicate no
    communication, from Partial a reduce-scatter every tp rank joins).
    """
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(
            param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return local_tensor(grad)


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with its layout if
    ``param`` is one (sharing ``local``'s memory), else ``local``."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements,
                              run_check=False, shape=param.shape,
                              stride=param.stride())


def distribute_like(value, like: torch.Tensor):
    """A whole tensor (as a full checkpoint holds it) as this rank's part of
    DTensor ``like``, cut locally (no collective: every rank has the whole
    value); anything else (``like`` not a DTensor, ``value`` already one or
    of another shape, e.g. an optimizer's step count) unchanged."""
    if isinstance(like, DTensor) and isinstance(value, torch.Tensor) and \
            not isinstance(value, DTensor) and value.shape == like.shape:
        return distribute_tensor(value.to(like.device), like.device_mesh,
                                 like.placements, src_data_rank=None)
    return value


def packed_parameters(model: nn.Module) -> List[str]:
    """Names of ``model``'s parameters split part by part (a fused
    projection's ``dict(style='colwise', fused=k)``: torch's strided
    layout on the 1-D tp mesh), which FSDP2 and DCP (sharded checkpoints)
    do not lay out correctly. (FSDP2 over a plain tp split uses the same
    placement on its own mesh dimension of a 2-D mesh, which both handle.)
    """
    return [name for name, param in model.named_parameters()
            if isinstance(param, DTensor) and param.device_mesh.ndim == 1
            and any(isinstance(p, _StridedShard) for p in param.placements)]
