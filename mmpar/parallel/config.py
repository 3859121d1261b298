"""The ``parallel`` config section as a typed, validated object.

A config says, with the named axes (docs/topology.md)::

    parallel = dict(dp_replicate=1, dp_shard=-1, tp=1, pp=1, cp=1, ep=1,
                    tp_plan=None, pipeline=None,
                    use_fsdp=False, cpu_offload=False,
                    sharding_strategy='FULL_SHARD', sync_module_states=True)

or with the seed names ``model_parallelism`` (= ``tp``; with FSDP
``HYBRID_SHARD`` and no ``tp_plan`` it means ``dp_shard``) and
``pipeline_parallelism`` (= ``pp``). :meth:`ParallelConfig.from_cfg` turns
the dict into one typed object at the edge, once per run;
:meth:`ParallelConfig.dims` resolves the sizes for a world
(:func:`mmpar.parallel.dims.resolve_dims`, the one validator of the axes).
What needs the model or the wrappers (the tensor-parallel plan, which
wrapper composes with which axis) is checked by :mod:`mmpar.parallelize`.
"""
import dataclasses
import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from mmpar.checks import check_int
from mmpar.parallel.axes import AXES
from mmpar.parallel.dims import REST, ParallelDims, resolve_dims
from mmpar.parallel.sharding import SHARDING_STRATEGIES, is_hybrid

SEED_SIZE_KEYS = ('model_parallelism', 'pipeline_parallelism')
# The FSDP wrapper arguments the section sets (with use_fsdp only).
FSDP_KEYS = ('cpu_offload', 'sharding_strategy', 'sync_module_states')


@dataclass(frozen=True)
class ParallelConfig:
    """How the job is split; every field is checked on construction.

    Sizes left at None were not given; :meth:`dims` resolves them.

    Attributes:
        dp_replicate: data-parallel replicas (int >= 1, or -1: the rest).
        dp_shard: data-parallel shards (FSDP's axis; int >= 1 or -1).
        tp: tensor-parallel size (int >= 1 or -1); needs ``tp_plan``.
        pp: pipeline-parallel size (int >= 1 or -1); needs ``pipeline``.
        cp: context-parallel size (int >= 1 or -1): each sequence is split
            over ``cp`` ranks; the model needs the context-parallel protocol
            (:mod:`mmpar.parallelize.context`).
        ep: expert-parallel size (int >= 1 or -1): the experts of each MoE
            layer are split over ``ep`` data ranks (docs/expert_parallel.md);
            the model needs MoE layers whose expert count ``ep`` divides.
        model_parallelism: the seed name of ``tp`` (see the module doc for
            its HSDP meaning).
        pipeline_parallelism: the seed name of ``pp``.
        tp_plan: the tensor-parallel plan, stored as given (checked by
            :func:`mmpar.parallelize.tensor.check_tp_plan`).
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
    cp: Optional[int] = None
    ep: Optional[int] = None
    model_parallelism: Optional[int] = None
    pipeline_parallelism: Optional[int] = None
    tp_plan: Any = None
    pipeline: Optional[dict] = None
    use_fsdp: bool = False
    cpu_offload: bool = False
    sharding_strategy: str = 'FULL_SHARD'
    sync_module_states: bool = True

    def __post_init__(self) -> None:
        for key in AXES + SEED_SIZE_KEYS:
            if getattr(self, key) is not None:
                check_int(f'parallel.{key}', getattr(self, key),
                          also=REST if key in AXES else ())
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
            for field in fields(self):
                key, default = field.name, field.default
                if key in FSDP_KEYS and getattr(self, key) != default:
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
                None: the wrapper this section picks (``use_fsdp``).

        Raises:
            ParallelismError: as :func:`mmpar.parallel.dims.resolve_dims`.
        """
        if model_wrapper_cfg is None:
            strategy = self.sharding_strategy if self.use_fsdp else None
            shard_size = None
        else:
            strategy = model_wrapper_cfg.get('sharding_strategy')
            shard_size = model_wrapper_cfg.get('hybrid_shard_size')
        return resolve_dims(self, world_size, hybrid=is_hybrid(strategy),
                            hybrid_shard_size=shard_size)

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
        keys = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(cfg, Mapping):
            raise ValueError(f'parallel={cfg!r} is not allowed; allowed: a '
                             'dict with keys ' + ', '.join(keys))
        unknown = [key for key in cfg if key not in keys]
        if unknown:
            # The likeliest meant key first (a typo of a long name).
            close = difflib.get_close_matches(unknown[0], keys)
            allowed = close + [k for k in keys if k not in close]
            raise ValueError(
                f'parallel.{unknown[0]}={cfg[unknown[0]]!r} is not a known '
                f'key; allowed: {", ".join(allowed)}')
        return cls(**dict(cfg))

    @property
    def fsdp_kwargs(self) -> dict:
        """The FSDP wrapper arguments this section sets."""
        return {key: getattr(self, key) for key in FSDP_KEYS}
