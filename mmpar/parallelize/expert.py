"""Expert parallelism: each MoE layer's experts split over ``mesh['ep']``.

:func:`apply_expert_parallel` turns every stacked expert parameter of a
module that meets the expert-parallel protocol
(:mod:`mmpar.parallel.experts`) into a DTensor sharded on dim 0 (the
expert dim) over the ep mesh, and gives the module its expert group, so
its forward sends routed tokens to the ranks of their experts. As DTensors
the experts load and save whole (full and sharded checkpoints), their norm
is taken over every rank by the one global-norm clip, and FSDP2 shards them
further over ``mesh['efsdp']`` (:class:`mmpar.wrappers.fully_shard.
MMFullyShard`'s ``expert_mesh``).

It also tells each MoE layer the gradient axis's group, over which the
auxiliary-loss-free balancing bias sums the loads (every layout, ep or
not).
"""
from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from mmpar.parallel.experts import ExpertGroup, expert_modules


def apply_expert_parallel(model: nn.Module, ep_mesh: Optional[DeviceMesh],
                          balance_group: Optional[dist.ProcessGroup] = None
                          ) -> nn.Module:
    """Split ``model``'s experts over ``ep_mesh`` in place.

    Args:
        model: the plain model (its expert modules declare
            ``expert_parallel_params``).
        ep_mesh: the 1-D ep mesh (None or size 1: experts stay whole).
        balance_group: the group load counts are summed over (MoE layers
            with a ``balance_group`` attribute).

    Returns:
        ``model``.
    """
    for module in model.modules():
        if hasattr(module, 'balance_group'):
            module.balance_group = balance_group
    if ep_mesh is None or ep_mesh.size() == 1:
        return model
    group = ExpertGroup(ep_mesh.get_group(), ep_mesh.size())
    for _, module in expert_modules(model):
        for name in module.expert_parallel_params:
            param = getattr(module, name)
            setattr(module, name, nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                requires_grad=param.requires_grad))
        module.expert_group = group
    return model
