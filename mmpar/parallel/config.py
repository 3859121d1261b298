"""The ``parallel`` config section as a typed, validated object.

A config says, with the named axes (docs/topology.md)::

    parallel = dict(dp_replicate=1, dp_shard=-1, tp=1, pp=1,
                    tp_plan=None, pipeline=None,
                    use_fsdp=False, cpu_offload=False,
                    sharding_strategy='FULL_SHARD', sync_module_states=True)

or with the seed names ``model_parallelism`` (= ``tp``; with FSDP
``HYBRID_SHARD`` and no ``tp_plan`` it means ``dp_shard``) and
``pipeline_parallelism`` (= ``pp``). :meth:`ParallelConfig.from_cfg` turns
the dict into one typed object at the edge; :meth:`ParallelConfig.dims`
resolves the sizes for a world (:func:`mmpar.parallel.dims.resolve_dims`,
the one validator of the axes).
"""
import dataclasses
import difflib
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch.distributed as dist

from mmpar.parallel.dims import (ParallelDims, is_hybrid_strategy,
                                 resolve_dims)
from mmpar.parallel.topology import (ParallelTopology, init_parallelism,
                                     parallel_group_info,
                                     parallelism_is_initialized)

SHARDING_STRATEGIES = ('FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD',
                       'HYBRID_SHARD', '_HYBRID_SHARD_ZERO2')
DDP_WRAPPER = 'MMDistributedDataParallel'
FSDP_WRAPPER = 'MMFullyShardedDataParallel'
AXIS_KEYS = ('dp_replicate', 'dp_shard', 'tp', 'pp')
SEED_SIZE_KEYS = ('model_parallelism', 'pipeline_parallelism')


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is split; every field is checked on construction.

    Sizes left at None were not given; :meth:`dims` resolves them.

    Attributes:
        dp_replicate: data-parallel replicas (int >= 1, or -1: the rest).
        dp_shard: data-parallel shards (FSDP's axis; int >= 1 or -1).
        tp: tensor-parallel size (int >= 1 or -1); needs ``tp_plan``.
        pp: pipeline-parallel size (int >= 1 or -1); needs ``pipeline``.
        model_parallelism: the seed name of ``tp`` (see the module doc for
            its HSDP meaning).
        pipeline_parallelism: the seed name of ``pp``.
        tp_plan: the tensor-parallel plan, stored as given (validated by
            :mod:`mmpar.parallelize`).
        pipeline: how to split the model into stages: a dict, stored as
            given (validated by :mod:`mmpar.parallelize`).
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
    dp_replicate: Optional[int] = None
    dp_shard: Optional[int] = None
    tp: Optional[int] = None
    pp: Optional[int] = None
    model_parallelism: Optional[int] = None
    pipeline_parallelism: Optional[int] = None
    tp_plan: Any = None
    pipeline: Optional[dict] = None
    use_fsdp: bool = False
    cpu_offload: bool = False
    sharding_strategy: str = 'FULL_SHARD'
    sync_module_states: bool = True

    def __post_init__(self) -> None:
        for key in AXIS_KEYS + SEED_SIZE_KEYS:
            value = getattr(self, key)
            # bool is an int subclass; True is no size.
            if value is None or (isinstance(value, int)
                                 and not isinstance(value, bool) and
                                 (value >= 1 or
                                  (value == -1 and key in AXIS_KEYS))):
                continue
            allowed = 'an int >= 1' + (', or -1 for the rest of the world'
                                       if key in AXIS_KEYS else '')
            raise ValueError(f'parallel.{key}={value!r} is not allowed; '
                             f'allowed: {allowed}')
        if self.tp_plan is not None:
            # The plan's own checks live with the technique.
            from mmpar.parallelize.tensor import check_tp_plan
            check_tp_plan(self.tp_plan)
        if self.pipeline is not None and not isinstance(self.pipeline,
                                                        Mapping):
            raise ValueError(f'parallel.pipeline={self.pipeline!r} is not '
                             'allowed; allowed: None or a dict')
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

    def dims(self, world_size: int,
             model_wrapper_cfg: Optional[Mapping] = None) -> ParallelDims:
        """The named axes this section asks for at ``world_size`` ranks.

        Args:
            world_size: the number of ranks.
            model_wrapper_cfg: the config's wrapper section; its
                ``sharding_strategy`` (HYBRID: HSDP meaning of
                ``model_parallelism``) and ``hybrid_shard_size`` count.

        Raises:
            ParallelismError: as :func:`mmpar.parallel.dims.resolve_dims`.
        """
        wrapper = dict(model_wrapper_cfg or {})
        if model_wrapper_cfg is None:
            wrapper = default_wrapper_cfg(self)
        dims = resolve_dims(
            self, world_size,
            hybrid=is_hybrid_strategy(wrapper.get('sharding_strategy')),
            hybrid_shard_size=wrapper.get('hybrid_shard_size'))
        if dims.tp_enabled:
            # The wrapper must compose with TP (FSDP1 does not).
            from mmpar.parallelize.tensor import data_parallel_cfg_for_tp
            data_parallel_cfg_for_tp(wrapper, dims.tp)
        return dims

    def check_wrapper(self, model_wrapper_cfg: Optional[Mapping]) -> None:
        """``use_fsdp=True`` only picks the wrapper when none is given.

        Raises:
            ValueError: ``use_fsdp=True`` with an explicit non-FSDP wrapper
                (one of the two is a mistake).
        """
        if not self.use_fsdp or model_wrapper_cfg is None:
            return
        wrapper = model_wrapper_cfg.get('type', DDP_WRAPPER)
        name = getattr(wrapper, '__name__', str(wrapper))
        if 'FullyShard' not in name:
            raise ValueError(
                f'parallel.use_fsdp=True but model_wrapper_cfg.type={name!r} '
                'is not FSDP; use_fsdp only picks the wrapper when '
                'model_wrapper_cfg is absent: drop one of them')

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
            # The likeliest meant key first (a typo of a long name).
            close = difflib.get_close_matches(unknown[0], field_names())
            allowed = close + [k for k in field_names() if k not in close]
            raise ValueError(
                f'parallel.{unknown[0]}={cfg[unknown[0]]!r} is not a known '
                f'key; allowed: {", ".join(allowed)}')
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


def setup_parallelism(parallel_cfg=None,
                      model_wrapper_cfg: Optional[Mapping] = None
                      ) -> Optional[ParallelTopology]:
    """Build the topology a ``parallel`` section asks for, at start-up.

    Call after the default process group exists (``init_dist``). Without
    one (a single-process run) there is nothing to split: sizes above 1 are
    ignored with a warning and None is returned. If an identical topology is
    already initialised (a second Runner in one process) it is reused.

    Args:
        parallel_cfg: a :class:`ParallelConfig`, a ``parallel`` dict or None.
        model_wrapper_cfg: the config's wrapper section (see
            :meth:`ParallelConfig.dims`).

    Returns:
        The topology, or None in a single-process run.

    Raises:
        ValueError: a bad ``parallel`` section.
        ParallelismError: sizes that do not fit the world size, a layout
            that cannot train correctly, or a different topology already
            initialised.
    """
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    if not (dist.is_available() and dist.is_initialized()):
        asked = {k: getattr(parallel, k) for k in AXIS_KEYS + SEED_SIZE_KEYS}
        big = {k: v for k, v in asked.items() if v is not None and v > 1}
        if big:
            named = ', '.join(f'{k}={v}' for k, v in big.items())
            warnings.warn(f'parallel.{named} in a single-process run: '
                          'using 1 for every axis')
        return None
    dims = parallel.dims(dist.get_world_size(), model_wrapper_cfg)
    if parallelism_is_initialized():
        current = parallel_group_info()
        if current.dims == dims:
            return current
    return init_parallelism(dims=dims)
