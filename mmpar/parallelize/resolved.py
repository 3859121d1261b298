"""One resolved plan: the parallel sections of a config, parsed and checked
once, handed down.

:func:`resolve_plan` turns the ``parallel`` section, the wrapper config,
activation checkpointing and compile into a :class:`ResolvedPlan`:
``check_config`` makes it, the Runner hands it to ``setup_parallelism``,
the model build and :func:`mmpar.parallelize.compose.parallelize`, and
nothing below parses or checks those keys again.
:func:`check_composition` is the one check of what only the layout and the
wrapper together can get wrong.
"""
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from mmpar.failures import ConfigError
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims, check_shard_size
from mmpar.parallelize.activation import (check_activation_checkpointing,
                                          merge_wrapper_key)
from mmpar.parallelize.compile import check_compile_cfg
from mmpar.parallelize.pipeline.config import PipelineConfig
from mmpar.parallelize.tensor import check_tp_plan
from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
from mmpar.wrappers.builder import (DEFAULT_WRAPPER, check_use_fsdp,
                                    check_wrapper_cfg, declared,
                                    default_wrapper_cfg, registered_wrappers)


@dataclass(frozen=True)
class ResolvedPlan:
    """The parallel parts of a config, resolved once (do not change it).

    Attributes:
        parallel: the ``parallel`` section.
        dims: its layout (None while the world size is unknown:
            :meth:`at_world`).
        given_wrapper_cfg: the config's ``model_wrapper_cfg`` without the
            older ``activation_checkpointing`` key (None: not given).
        wrapper_cfg: the wrapper compose builds: the given one or the
            default (``parallel.use_fsdp``), its tensor-parallel
            counterpart under ``tp > 1``, checked.
        stage_wrapper_cfg: under ``pp > 1``, the wrapper of one stage.
        pipeline: ``parallel.pipeline``, checked (None: not given).
        activation_checkpointing: the checked checkpointing section.
        compile_cfg: ``model_compile``, checked.
        meta_init: the ``meta_init`` key.
        batch_size: the per-rank train batch size, when known.
    """
    parallel: ParallelConfig
    dims: Optional[ParallelDims]
    given_wrapper_cfg: Optional[dict]
    wrapper_cfg: dict
    stage_wrapper_cfg: Optional[dict]
    pipeline: Optional[PipelineConfig]
    activation_checkpointing: Any
    compile_cfg: Any
    meta_init: bool = True
    batch_size: Optional[int] = None

    @property
    def builds_on_meta(self) -> bool:
        """Whether the layout shards or splits the model, so that no rank
        needs it whole (and ``meta_init`` allows building it on the meta
        device)."""
        return self.dims is not None and \
            builds_on_meta(self.dims, self.wrapper_cfg)

    def at_world(self, world_size: int) -> 'ResolvedPlan':
        """This plan at ``world_size`` ranks (itself when resolved for it):
        for a world the launcher did not announce before start-up."""
        if self.dims is not None and self.dims.world_size == world_size:
            return self
        return self.with_dims(
            self.parallel.dims(world_size, self.given_wrapper_cfg))

    def with_dims(self, dims: ParallelDims) -> 'ResolvedPlan':
        """This plan on the layout ``dims``: the checks that need it."""
        if dims.pp_enabled and dims.pp != _config_pp(self.parallel):
            # Parsed before the layout was known (pp=-1): the stage count.
            self.pipeline.check(dims.pp, self.batch_size)
        if dims.world_size > 1:
            wrapper_cfg = check_composition(dims, self.wrapper_cfg,
                                            self.pipeline, self.compile_cfg)
        else:
            wrapper_cfg = self.wrapper_cfg
        stage_cfg = stage_wrapper_cfg(wrapper_cfg, self.pipeline) \
            if dims.pp_enabled else None
        return replace(self, dims=dims, wrapper_cfg=wrapper_cfg,
                       stage_wrapper_cfg=stage_cfg)


def _config_pp(parallel: ParallelConfig) -> Optional[int]:
    return parallel.pp or parallel.pipeline_parallelism


def wrapper_cfg_for(dims: ParallelDims,
                    model_wrapper_cfg: Optional[dict]) -> dict:
    """The data-parallel wrapper config compose builds: the default DDP
    when none is given, its tensor-parallel counterpart under ``tp > 1``."""
    cfg = dict(model_wrapper_cfg or dict(type=DEFAULT_WRAPPER))
    if dims.tp_enabled:
        cfg = data_parallel_cfg_for_tp(cfg, dims.tp)
    return cfg


def builds_on_meta(dims: ParallelDims, wrapper_cfg: Optional[dict]) -> bool:
    """Whether the layout shards or splits the model, so that no rank needs
    it whole: tensor or pipeline parallelism, or a sharding wrapper."""
    cls = declared((wrapper_cfg or {}).get('type', DEFAULT_WRAPPER))
    return dims.world_size > 1 and (dims.tp_enabled or dims.pp_enabled or
                                    cls.shards_parameters)


def _refuse_wrapper(wrapper: Any, able: Callable[[type], bool],
                    what: str) -> None:
    """Refuse a wrapper whose class is not ``able``, naming
    ``model_wrapper_cfg.type``, ``what`` it cannot do and those that can."""
    if able(declared(wrapper)):
        return
    allowed = [n for n in registered_wrappers() if able(declared(n))]
    name = getattr(wrapper, '__name__', str(wrapper)).split('.')[-1]
    raise ValueError(f'model_wrapper_cfg.type={name!r} {what}; allowed: '
                     f'{", ".join(allowed)}')


def stage_wrapper_cfg(model_wrapper_cfg: dict,
                      pipeline: Optional[PipelineConfig]) -> dict:
    """The wrapper config for one stage: the class's stage arguments, and
    where the schedule keeps a stage's parameters gathered through the step
    its held-stage ones (FSDP2: no resharding after forward), unless the
    user set them."""
    cfg = dict(model_wrapper_cfg)
    cls = declared(cfg.get('type', DEFAULT_WRAPPER))
    stage_args = dict(cls.pipeline_stage_args or {})
    if not (pipeline or PipelineConfig()).reshards_per_microbatch:
        stage_args.update(cls.pipeline_held_stage_args)
    for key, value in stage_args.items():
        cfg.setdefault(key, value)
    return cfg


def check_composition(dims: ParallelDims, model_wrapper_cfg: Optional[dict],
                      pipeline: Optional[PipelineConfig] = None,
                      compile_cfg: Any = None) -> dict:
    """Check what the layout and the wrapper can only get wrong together.

    Returns:
        The wrapper config compose will build.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    try:
        cfg = wrapper_cfg_for(dims, model_wrapper_cfg)
        check_shard_size(cfg.get('hybrid_shard_size'), dims)
        wrapper = cfg.get('type', DEFAULT_WRAPPER)
        if dims.ep_enabled:
            # ep composes with every other axis (with tp the MoE layers stay
            # whole on every tp rank; docs/expert_parallel.md).
            _refuse_wrapper(
                wrapper, lambda cls: cls.expert_parallel,
                'cannot wrap an expert-parallel model (parallel.ep='
                f'{dims.ep}): it would reduce the experts\' gradients over '
                'ranks that hold other experts')
            strategy = cfg.get('sharding_strategy')
            if strategy is not None and 'HYBRID' in str(strategy):
                raise ValueError(
                    f'model_wrapper_cfg.sharding_strategy={strategy!r} with '
                    f'parallel.ep={dims.ep} is not supported yet; allowed: '
                    "'FULL_SHARD' or 'SHARD_GRAD_OP'")
        if dims.pp_enabled:
            if dims.dp_cp > 1:
                _refuse_wrapper(
                    wrapper, lambda cls: cls.pipeline_stage_args is not None,
                    'cannot wrap a pipeline stage (parallel.pp > 1 with '
                    f'dp={dims.dp_cp})')
            if compile_cfg:
                raise ValueError(
                    f'model_compile={compile_cfg!r} with parallel.pp='
                    f'{dims.pp} is not supported yet; allowed: '
                    'model_compile=None with pipeline parallelism')
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def resolve_plan(parallel: Any = None,
                 model_wrapper_cfg: Optional[dict] = None,
                 *,
                 world_size: Optional[int] = None,
                 dims: Optional[ParallelDims] = None,
                 activation_checkpointing: Any = None,
                 compile_cfg: Any = None,
                 batch_size: Optional[int] = None,
                 meta_init: bool = True,
                 find_unused_parameters: bool = False) -> ResolvedPlan:
    """Parse and check the parallel parts of a config, once.

    Args:
        parallel: the ``parallel`` section (dict, ParallelConfig or None).
        model_wrapper_cfg: the config's ``model_wrapper_cfg`` (None: the
            one ``parallel.use_fsdp`` picks).
        world_size: the number of ranks, when known.
        dims: the layout, when already resolved (tests, the plan tool).
        activation_checkpointing: the top-level config key.
        compile_cfg: ``model_compile``.
        batch_size: the per-rank train batch size, when known.
        meta_init: the ``meta_init`` key.
        find_unused_parameters: the Runner's key, for the default DDP.

    Raises:
        ValueError / ConfigError / ParallelismError: naming the key, the
            value and what is allowed.
    """
    ac_cfg, given = merge_wrapper_key(activation_checkpointing,
                                      model_wrapper_cfg)
    check_wrapper_cfg(given)  # type, sync strategy, the class's check
    ac_cfg = check_activation_checkpointing(ac_cfg)
    check_compile_cfg(compile_cfg)
    config = ParallelConfig.from_cfg(parallel)
    check_use_fsdp(config, given)
    if config.tp_plan is not None:
        check_tp_plan(config.tp_plan)
    wrapper_cfg = dict(given) if given is not None else \
        default_wrapper_cfg(config)
    if find_unused_parameters and given is None and \
            wrapper_cfg['type'] == DEFAULT_WRAPPER:
        wrapper_cfg['find_unused_parameters'] = True
    pipeline = None if config.pipeline is None else PipelineConfig.from_cfg(
        config.pipeline, _config_pp(config), batch_size)
    plan = ResolvedPlan(config, None, given, wrapper_cfg, None, pipeline,
                        ac_cfg, compile_cfg, meta_init, batch_size)
    if dims is not None:
        return plan.with_dims(dims)
    return plan if world_size is None else plan.at_world(world_size)
