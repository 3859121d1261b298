"""The ``parallel`` config section as a typed, validated object.

A config says::

    parallel = dict(model_parallelism=1, pipeline_parallelism=1,
                    use_fsdp=False, cpu_offload=False,
                    sharding_strategy='FULL_SHARD', sync_module_states=True)

:meth:`ParallelConfig.from_cfg` turns that dict into one typed object at the
edge; the Runner and the plan tool read fields, never nested dict keys.
"""
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Mapping, Optional

import torch.distributed as dist

from mmpar.parallel.topology import (ParallelTopology, init_parallelism,
                                     parallel_group_info,
                                     parallelism_is_initialized)

SHARDING_STRATEGIES = ('FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD',
                       'HYBRID_SHARD', '_HYBRID_SHARD_ZERO2')
DDP_WRAPPER = 'MMDistributedDataParallel'
FSDP_WRAPPER = 'MMFullyShardedDataParallel'


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is split; every field is checked on construction.

    Attributes:
        model_parallelism: ranks per model-parallel group.
        pipeline_parallelism: ranks per pipeline-parallel group.
        use_fsdp: when ``model_wrapper_cfg`` is absent, wrap with FSDP
            (``MMFullyShardedDataParallel``) instead of DDP.
        cpu_offload: FSDP only: keep parameters and gradients on the CPU.
        sharding_strategy: FSDP only: one of ``SHARDING_STRATEGIES``.
        sync_module_states: FSDP only: broadcast rank 0's weights at wrap.

    Raises:
        ValueError: a field with a wrong type or value, or an FSDP option
            set while ``use_fsdp`` is False; the message names the key, the
            value and what is allowed.
    """
    model_parallelism: int = 1
    pipeline_parallelism: int = 1
    use_fsdp: bool = False
    cpu_offload: bool = False
    sharding_strategy: str = 'FULL_SHARD'
    sync_module_states: bool = True

    def __post_init__(self) -> None:
        for key in ('model_parallelism', 'pipeline_parallelism'):
            value = getattr(self, key)
            # bool is an int subclass; True is no size.
            if isinstance(value, bool) or not isinstance(value,
                                                         int) or value < 1:
                raise ValueError(f'parallel.{key}={value!r} is not allowed; '
                                 'allowed: an int >= 1')
        for key in ('use_fsdp', 'cpu_offload', 'sync_module_states'):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f'parallel.{key}={value!r} is not allowed; '
                                 'allowed: True or False')
        if self.sharding_strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f'parallel.sharding_strategy={self.sharding_strategy!r} is '
                f'not allowed; allowed: {", ".join(SHARDING_STRATEGIES)}')
        if not self.use_fsdp:
            # FSDP options without FSDP would be silently ignored.
            for key, default in (('cpu_offload', False),
                                 ('sharding_strategy', 'FULL_SHARD')):
                if getattr(self, key) != default:
                    raise ValueError(
                        f'parallel.{key}={getattr(self, key)!r} is an FSDP '
                        'option but parallel.use_fsdp=False; set '
                        f'use_fsdp=True or leave {key} at {default!r}')

    @classmethod
    def from_cfg(cls, cfg: Optional[Mapping]) -> 'ParallelConfig':
        """Build from a config's ``parallel`` dict (None: all defaults).

        Raises:
            ValueError: an unknown key or a bad value, naming it and the
                allowed keys or values.
        """
        if cfg is None:
            return cls()
        if isinstance(cfg, cls):
            return cfg
        if not isinstance(cfg, Mapping):
            raise ValueError(f'parallel={cfg!r} is not allowed; allowed: a '
                             'dict with keys ' + ', '.join(field_names()))
        unknown = [key for key in cfg if key not in field_names()]
        if unknown:
            raise ValueError(
                f'parallel.{unknown[0]}={cfg[unknown[0]]!r} is not a known '
                f'key; allowed: {", ".join(field_names())}')
        return cls(**dict(cfg))

    @property
    def fsdp_kwargs(self) -> dict:
        """The FSDP wrapper arguments this section sets."""
        return dict(
            cpu_offload=self.cpu_offload,
            sharding_strategy=self.sharding_strategy,
            sync_module_states=self.sync_module_states)


def field_names() -> tuple:
    """The keys a ``parallel`` section may have, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(ParallelConfig))


def default_wrapper_cfg(parallel_cfg=None) -> dict:
    """The ``model_wrapper_cfg`` to use when a config has none.

    Args:
        parallel_cfg: a :class:`ParallelConfig`, a ``parallel`` dict or None.

    Returns:
        ``dict(type='MMFullyShardedDataParallel', cpu_offload=...,
        sharding_strategy=..., sync_module_states=...)`` when ``use_fsdp``,
        else ``dict(type='MMDistributedDataParallel')``. A new dict each call.
    """
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    if parallel.use_fsdp:
        return dict(type=FSDP_WRAPPER, **parallel.fsdp_kwargs)
    return dict(type=DDP_WRAPPER)


def setup_parallelism(parallel_cfg=None) -> Optional[ParallelTopology]:
    """Build the topology a ``parallel`` section asks for, at start-up.

    Call after the default process group exists (``init_dist``). Without
    one (a single-process run) there is nothing to split: sizes above 1 are
    clamped to 1 with a warning and None is returned. If an identical
    topology is already initialised (a second Runner in one process) it is
    reused.

    Args:
        parallel_cfg: a :class:`ParallelConfig`, a ``parallel`` dict or None.

    Returns:
        The topology, or None in a single-process run.

    Raises:
        ValueError: a bad ``parallel`` section.
        ParallelismError: sizes that do not divide the world size, or a
            different topology already initialised.
    """
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    mp, pp = parallel.model_parallelism, parallel.pipeline_parallelism
    if not (dist.is_available() and dist.is_initialized()):
        if mp > 1 or pp > 1:
            warnings.warn(f'parallel.model_parallelism={mp}, '
                          f'pipeline_parallelism={pp} in a single-process '
                          'run: using 1 for both')
        return None
    if parallelism_is_initialized():
        current = parallel_group_info()
        layout = current.layout
        if (layout.pp, min(mp, layout.world_size)) == (pp, layout.mp):
            return current
    return init_parallelism(mp, pp)
