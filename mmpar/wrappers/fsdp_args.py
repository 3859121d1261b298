"""Config values shared by both FSDP wrappers, each normalised once.

Every function here takes what a config may hold (a name, a bool, a dict of
dtype names, an enum or torch object) and returns one type, or raises an error
that names the key, the bad value and what is allowed.
"""
import functools
import os
from typing import Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload,
                                    MixedPrecision, MixedPrecisionPolicy,
                                    ShardingStrategy)

from mmpar.wrappers.policies import resolve_module_classes

DTYPES = {
    'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16,
    'fp16': torch.float16, 'float16': torch.float16, 'half': torch.float16,
    'fp32': torch.float32, 'float32': torch.float32, 'float': torch.float32,
    'fp64': torch.float64, 'float64': torch.float64, 'double': torch.float64,
}
BACKWARD_PREFETCH = {
    'pre': BackwardPrefetch.BACKWARD_PRE,
    'post': BackwardPrefetch.BACKWARD_POST,
    'BACKWARD_PRE': BackwardPrefetch.BACKWARD_PRE,
    'BACKWARD_POST': BackwardPrefetch.BACKWARD_POST,
}
SHARDING_STRATEGIES = tuple(s.name for s in ShardingStrategy)
HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD,
                     ShardingStrategy._HYBRID_SHARD_ZERO2)


def to_dtype(value: Union[str, torch.dtype], key: str) -> torch.dtype:
    """A dtype from its name (``'bf16'``, ``'fp32'``, ...) or itself."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    raise ValueError(f'{key}={value!r} is not a dtype; allowed: '
                     f'{", ".join(DTYPES)} or a torch.dtype')


def normalize_cpu_offload(value) -> Optional[CPUOffload]:
    """None, a bool (``CPUOffload(offload_params=b)``) or a ``CPUOffload``.

    Raises:
        TypeError: any other value.
    """
    if value is None or isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    raise TypeError(f'cpu_offload={value!r} must be None, a bool or a '
                    'torch.distributed.fsdp.CPUOffload')


def normalize_backward_prefetch(value) -> Optional[BackwardPrefetch]:
    """None, ``'pre'``/``'post'``, the enum names, or a ``BackwardPrefetch``.

    Raises:
        ValueError: any other value, listing the allowed ones.
    """
    if value is None or isinstance(value, BackwardPrefetch):
        return value
    if isinstance(value, str) and value in BACKWARD_PREFETCH:
        return BACKWARD_PREFETCH[value]
    raise ValueError(f'backward_prefetch={value!r} is not supported; '
                     f'allowed: None, {", ".join(BACKWARD_PREFETCH)} or a '
                     'BackwardPrefetch')


def normalize_sharding_strategy(value) -> ShardingStrategy:
    """A ``ShardingStrategy`` from itself or its name (None: FULL_SHARD).

    Raises:
        ValueError: an unknown name, listing the allowed ones.
    """
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str) and value in SHARDING_STRATEGIES:
        return ShardingStrategy[value]
    raise ValueError(f'sharding_strategy={value!r} is not supported; '
                     f'allowed: {", ".join(SHARDING_STRATEGIES)}')


def _precision(value, policy_cls: type):
    if value is None or isinstance(value, policy_cls):
        return value
    if not isinstance(value, dict):
        raise TypeError(f'mixed_precision={value!r} must be None, a dict of '
                        f'dtype names or a {policy_cls.__name__}')
    allowed = tuple(policy_cls.__dataclass_fields__)
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f'mixed_precision has unknown keys {unknown}; '
                         f'allowed: {", ".join(allowed)}')
    return policy_cls(**{
        k: to_dtype(v, f'mixed_precision.{k}')
        if k.endswith('_dtype') and v is not None else v
        for k, v in value.items()
    })


def normalize_mixed_precision(value) -> Optional[MixedPrecision]:
    """FSDP1 mixed precision from None, a ``MixedPrecision`` or a dict.

    A dict holds dtype names, e.g. ``dict(param_dtype='bf16',
    reduce_dtype='fp32', buffer_dtype='fp32')``, and any other
    ``MixedPrecision`` field.

    Raises:
        ValueError: an unknown key or dtype name.
        TypeError: any other type.
    """
    return _precision(value, MixedPrecision)


def normalize_mp_policy(value) -> Optional[MixedPrecisionPolicy]:
    """FSDP2 mixed precision from None, a ``MixedPrecisionPolicy`` or a dict.

    Same dtype names as :func:`normalize_mixed_precision`; the allowed keys
    are ``MixedPrecisionPolicy``'s (``param_dtype``, ``reduce_dtype``,
    ``output_dtype``, ``cast_forward_inputs``). FSDP2 has no buffer dtype.
    """
    return _precision(value, MixedPrecisionPolicy)


def check_activation_checkpointing(value) -> None:
    """None, a class name or class, or a list of them."""
    if value is None or isinstance(value, (str, type)):
        return
    if isinstance(value, (list, tuple)) and all(
            isinstance(v, (str, type)) for v in value):
        return
    raise TypeError(f'activation_checkpointing={value!r} must be None or '
                    'module class names/classes (a list of them)')


def apply_activation_checkpointing(model: nn.Module,
                                   classes: Union[None, str, type,
                                                  Iterable]) -> None:
    """Checkpoint every instance of ``classes`` inside ``model`` in place.

    Non-reentrant checkpointing: it composes with FSDP's hooks and keeps the
    state-dict keys unchanged (torch's wrapper strips its own prefix).
    """
    if not classes:
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl, apply_activation_checkpointing as apply_ac,
        checkpoint_wrapper)
    classes = resolve_module_classes(
        model, classes, key='activation_checkpointing')
    apply_ac(
        model,
        checkpoint_wrapper_fn=functools.partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, classes))


def check_sync_strategy_supported(sync_strategy: str, wrapper: str) -> None:
    """FSDP wrappers support every sync strategy but ``forced_sync``.

    Raises:
        ValueError: for ``forced_sync``: FSDP reduce-scatters gradients in
            its own backward hooks, so there is no separate "all-reduce after
            the last backward" step to force; ``single_auto_sync`` gives the
            same one-sync-per-accumulation-window communication.
    """
    if sync_strategy == 'forced_sync':
        raise ValueError(
            f"sync_strategy='forced_sync' is not supported by {wrapper}: "
            'FSDP reduce-scatters gradients inside backward, so there is no '
            'separate all-reduce to force; use single_auto_sync (one sync per '
            'accumulation window) or multi_auto_sync')


def _topology():
    # mmpar.parallel (the topology issue) may not be installed with this
    # branch; without it, or before init_parallelism, there is no topology.
    try:
        from mmpar.parallel import (parallel_group_info,
                                    parallelism_is_initialized)
    except ImportError:
        return None
    return parallel_group_info() if parallelism_is_initialized() else None


def topology_hybrid_groups() -> Optional[Tuple[dist.ProcessGroup,
                                               dist.ProcessGroup]]:
    """(shard group, replicate group) from mmpar's parallel topology.

    HYBRID_SHARD shards within the model-parallel group and replicates across
    the data-parallel group. None while no topology is initialised.
    """
    topology = _topology()
    return None if topology is None else (topology.mp.group,
                                          topology.dp.group)


def topology_hsdp_mesh() -> Optional[DeviceMesh]:
    """The topology's 2-D ``(dp, mp)`` mesh for FSDP2 HSDP, or None.

    Replicate across the data-parallel dim, shard across model-parallel.
    """
    topology = _topology()
    return None if topology is None else topology.mesh['dp', 'mp']


def hybrid_shard_size(explicit: Optional[int] = None) -> int:
    """Ranks per shard group for HYBRID_SHARD.

    ``explicit`` if given, else ``LOCAL_WORLD_SIZE`` (ranks on this node,
    torch's default node-local split), else the whole world.

    Raises:
        ValueError: a size that does not divide the world size.
    """
    world = dist.get_world_size()
    size = explicit or int(os.environ.get('LOCAL_WORLD_SIZE', world))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 \
            or world % size:
        raise ValueError(f'hybrid_shard_size={size!r} must be an int >= 1 '
                         f'that divides the world size {world}')
    return size


def hybrid_groups(shard_size: int) -> Tuple[dist.ProcessGroup,
                                            dist.ProcessGroup]:
    """This rank's (shard, replicate) groups, shard groups node-local.

    Ranks ``[k*shard_size, (k+1)*shard_size)`` share a shard group; ranks
    with the same offset inside their shard group share a replicate group.
    Every rank creates every group (``new_group`` is collective).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    shard = replicate = None
    for start in range(0, world, shard_size):
        group = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            shard = group
    for offset in range(shard_size):
        group = dist.new_group(list(range(offset, world, shard_size)))
        if rank % shard_size == offset:
            replicate = group
    return shard, replicate
