"""FSDP sharding strategies by name: the one table.

A strategy says two things about the data axis: whether it is split into a
replicate x shard mesh (HYBRID: HSDP) and whether parameters are resharded
after forward (FULL_SHARD) or kept gathered until backward (SHARD_GRAD_OP,
ZeRO-2). ``parallel.sharding_strategy``, the layout's reading of
``model_parallelism`` under HYBRID, and both FSDP wrappers read this table;
the wrappers map the names to torch's ``ShardingStrategy`` enum.
"""
from typing import Any, NamedTuple


class Strategy(NamedTuple):
    hybrid: bool  # replicate x shard (HSDP)
    shards: bool  # parameters sharded at all (NO_SHARD: replicated)
    reshard_after_forward: bool


SHARDING_STRATEGIES = {
    'FULL_SHARD': Strategy(hybrid=False, shards=True,
                           reshard_after_forward=True),
    'SHARD_GRAD_OP': Strategy(hybrid=False, shards=True,
                              reshard_after_forward=False),
    'NO_SHARD': Strategy(hybrid=False, shards=False,
                         reshard_after_forward=False),
    'HYBRID_SHARD': Strategy(hybrid=True, shards=True,
                             reshard_after_forward=True),
    '_HYBRID_SHARD_ZERO2': Strategy(hybrid=True, shards=True,
                                    reshard_after_forward=False),
}
# The strategy of a hybrid one on a one-rank replicate side, and back.
UNHYBRID = {'HYBRID_SHARD': 'FULL_SHARD', '_HYBRID_SHARD_ZERO2': 'SHARD_GRAD_OP'}
HYBRID = {v: k for k, v in UNHYBRID.items()}


def strategy_name(value: Any, key: str = 'sharding_strategy',
                  allowed=tuple(SHARDING_STRATEGIES), hint: str = '') -> str:
    """The name of a strategy given by name or as torch's enum (None:
    FULL_SHARD).

    Raises:
        ValueError: a name not in ``allowed``, naming ``key`` and them (and
            ``hint``).
    """
    name = 'FULL_SHARD' if value is None else getattr(value, 'name', value)
    if name not in allowed:
        raise ValueError(f'{key}={value!r} is not supported; allowed: '
                         f'{", ".join(allowed)}{hint}')
    return name


def is_hybrid(value: Any) -> bool:
    """Whether a strategy (name or enum; None: FULL_SHARD) is HYBRID."""
    name = getattr(value, 'name', value)
    return name in SHARDING_STRATEGIES and SHARDING_STRATEGIES[name].hybrid
