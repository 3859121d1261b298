"""Expert parallelism: each MoE layer's experts split over ``mesh['ep']``.

:func:`apply_expert_parallel` turns every stacked expert parameter of a
module that meets the expert-parallel protocol
(:mod:`mmpar.parallel.experts`) into a DTensor sharded on dim 0 (the
expert dim) over the ep mesh, and hooks the module's forward: its routed
tokens go to the ranks of their experts before it (``dispatch``) and come
back after it (``combine``), as torchtitan's ``ExpertParallel`` style
hooks its experts' inputs and outputs (a module of the protocol's second
form, which sorts its tokens inside its forward, gets the ep group in its
``expert_parallel_group`` instead and dispatches through
``run_local_experts``). As DTensors the experts load and
save whole (full and sharded checkpoints), their norm is taken over every
rank by the one global-norm clip, and FSDP2 shards them further over
``mesh['efsdp']`` (:class:`mmpar.wrappers.fully_shard.MMFullyShard`'s
``expert_mesh``).

It also tells each MoE layer the gradient axis's group, over which the
auxiliary-loss-free balancing bias sums the loads (every layout, ep or
not).
"""
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mmpar.failures import ConfigError
from mmpar.parallel.experts import (Dispatched, ExpertGroup, SharedGroup,
                                    combine, dispatch, expert_modules,
                                    protocol_params)


def apply_expert_parallel(model: nn.Module, ep_mesh: Optional[DeviceMesh],
                          balance_group: Optional[dist.ProcessGroup] = None
                          ) -> nn.Module:
    """Split ``model``'s experts over ``ep_mesh`` in place.

    Args:
        model: the plain model (its experts modules declare
            ``expert_parallel_params``).
        ep_mesh: the 1-D ep mesh (None or size 1: experts stay whole).
        balance_group: the group load counts are summed over (MoE layers
            with a ``balance_group`` attribute).

    Returns:
        ``model``.

    Raises:
        ConfigError: under ep, a model with no experts module, or one that
            breaks the protocol or whose experts ``ep`` does not divide
            (naming the module).
    """
    for module in model.modules():
        if hasattr(module, 'balance_group'):
            module.balance_group = None if balance_group is None else \
                SharedGroup(balance_group)
    if ep_mesh is None or ep_mesh.size() == 1:
        return model
    found = check_experts_modules(model, ep_mesh.size())
    group = ExpertGroup(ep_mesh.get_group(), ep_mesh.size())
    for _, module, params in found:
        for param_name in params:
            param = getattr(module, param_name)
            setattr(module, param_name, nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                requires_grad=param.requires_grad))
        if hasattr(module, 'expert_parallel_group'):
            # The protocol's second form: it dispatches inside its forward
            # (run_local_experts).
            module.expert_parallel_group = group
        else:
            _hook_dispatch(module, group)
    return model


def check_experts_modules(model: nn.Module, ep: int
                          ) -> List[Tuple[str, nn.Module, Sequence[str]]]:
    """The experts modules of ``model`` that ``ep`` ranks split, checked
    against the expert-parallel protocol.

    Returns:
        ``(name, module, stacked parameter names)`` for each.

    Raises:
        ConfigError: no module declares ``expert_parallel_params``, one
            breaks the protocol, or ``ep`` does not divide its experts;
            naming ``parallel.ep`` and the module.
    """
    found = expert_modules(model)
    if not found:
        raise ConfigError(
            f'parallel.ep={ep} is not allowed for model '
            f'{type(model).__name__}: none of its modules declares '
            'expert_parallel_params (the expert-parallel protocol, '
            'docs/expert_parallel.md); allowed: parallel.ep=1, or a model '
            'with experts modules that meet the protocol')
    checked = []
    for name, module in found:
        try:
            params = protocol_params(name, module)
        except ValueError as err:
            raise ConfigError(f'parallel.ep={ep}: {err}') from None
        split = [p for p in params
                 if isinstance(getattr(module, p), DTensor)]
        if split:
            # Sharding a DTensor over ep would need the experts on a 2-D
            # (ep, tp) mesh, which neither the dispatch nor the wrapper's
            # expert mesh handle.
            raise ConfigError(
                f'parallel.ep={ep}: parallel.tp_plan splits the experts '
                f'{split} of {name} ({type(module).__name__}) over tp; '
                'allowed: a tp plan that leaves the experts module out (it '
                'runs whole on every tp rank, docs/expert_parallel.md)')
        num_experts = getattr(module, params[0]).shape[0]
        if num_experts % ep:
            raise ConfigError(
                f'parallel.ep={ep} does not divide the {num_experts} experts '
                f'of {name} ({type(module).__name__}); allowed: a divisor '
                f'of {num_experts}')
        checked.append((name, module, params))
    return checked


def _hook_dispatch(module: nn.Module, group: ExpertGroup) -> None:
    # What each call's combine needs, pushed by the pre-hook and popped by
    # the hook of the same call (a recomputed forward under activation
    # checkpointing runs both again).
    pending: List[Dispatched] = []

    def before(mod: nn.Module, args: tuple) -> tuple:
        if len(args) < 2:
            raise TypeError(
                f'{type(mod).__name__} is expert-parallel: call it as '
                'forward(routed, counts, ...) with both positional '
                '(docs/expert_parallel.md)')
        tokens, local_counts, sent = dispatch(args[0], args[1], group)
        pending.append(sent)
        return (tokens, local_counts, *args[2:])

    def after(mod: nn.Module, args: tuple, output):
        return combine(output, pending.pop(), group)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
