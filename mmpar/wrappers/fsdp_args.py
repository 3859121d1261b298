"""Config values shared by both FSDP wrappers, each normalised once.

Every function here takes what a config may hold (a name, a bool, a dict of
dtype names, an enum or torch object) and returns one type, or raises an error
that names the key, the bad value and what is allowed.
"""
from typing import Optional, Union

import torch
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload,
                                    MixedPrecision, MixedPrecisionPolicy,
                                    ShardingStrategy)

from mmpar.parallel.sharding import strategy_name

DTYPES = {
    'bf16': torch.bfloat16, 'bfloat16': torch.bfloat16,
    'fp16': torch.float16, 'float16': torch.float16, 'half': torch.float16,
    'fp32': torch.float32, 'float32': torch.float32, 'float': torch.float32,
    'fp64': torch.float64, 'float64': torch.float64, 'double': torch.float64,
}
BACKWARD_PREFETCH = dict(pre=BackwardPrefetch.BACKWARD_PRE,
                         post=BackwardPrefetch.BACKWARD_POST,
                         **BackwardPrefetch.__members__)


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
    return ShardingStrategy[strategy_name(value)]


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
