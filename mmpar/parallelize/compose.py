"""The one place that decides how a model is parallelised, in a fixed order.

:func:`parallelize` applies, as torchtitan's and picotron's compose
functions do, each step taking the sub-mesh or group it needs from the
topology it is handed:

1. tensor parallelism over ``mesh['tp']`` (``parallel.tp_plan``,
   :mod:`.tensor`),
2. context parallelism over ``mesh['cp']`` (``parallel.cp``,
   :mod:`.context`): it only tags the attention modules, so it follows TP
   (it tags them as they will run) and precedes the pipeline split (the
   stage copies keep the tag) and checkpointing / compile (whose wrappers
   would hide the module names the protocol matches),
3. the pipeline split over ``mesh['pp']`` (``parallel.pipeline``,
   :mod:`.pipeline`); steps 4-7 then run on each of this rank's stages,
4. activation checkpointing (:mod:`.activation`),
5. ``torch.compile`` (:mod:`.compile`),
6. the data-parallel wrapper, given the gradient axis (``dp x cp``: cp
   peers hold the same weights but read different tokens) as its class
   declares it takes it (a group, or the 1-D / replicate x shard mesh),
7. for a model built on the meta device (:mod:`.meta`), materialising this
   rank's share (its local shards, its stages), filled as one process would
   initialise them: before the wrapper, after it (FSDP2: only local shards
   are allocated) or inside it (FSDP1), as the wrapper class declares.

The model's ``init_weights()`` is not run here: the Runner runs it where
MMEngine's ``Runner.train()`` runs it (:mod:`mmpar.runner.init_weights`).

With ``tp > 1`` the data-parallel wrapper is the one its class names for
tensor parallelism (:mod:`.tp_wrapper`). :func:`check_composition` is the
one check of what only the combination of the layout and the wrapper can
get wrong; the config check and the plan tool call it too.
"""
from typing import Any, Optional

import torch
from mmengine.dist import broadcast
from torch import nn

from mmpar.failures import ConfigError
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims
from mmpar.parallel.sharding import SHARDING_STRATEGIES, strategy_name
from mmpar.parallel.topology import ParallelTopology
from mmpar.parallelize.activation import (apply_activation_checkpointing,
                                          merge_wrapper_key)
from mmpar.parallelize.compile import apply_compile
from mmpar.parallelize.context import apply_context_parallel
from mmpar.parallelize.meta import MetaInit
from mmpar.parallelize.tensor import apply_tp
from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
from mmpar.wrappers.base import describe
from mmpar.wrappers.builder import (DEFAULT_WRAPPER, build_model_wrapper,
                                    declared)


def broadcast_before_sharding(model: nn.Module) -> None:
    """Rank 0's plain model on every rank, before it is cut, as DDP's
    construction makes it (ranks seeded differently then agree).

    ``init_weights`` is not run here: the Runner runs it where MMEngine's
    ``Runner.train()`` does (:mod:`mmpar.runner.init_weights`), after the
    random draws that come first there.
    """
    for tensor in model.state_dict().values():
        broadcast(tensor)


def wrapper_cfg_for(dims: ParallelDims,
                    model_wrapper_cfg: Optional[dict]) -> dict:
    """The data-parallel wrapper config compose builds: the default DDP
    when none is given, its tensor-parallel counterpart under ``tp > 1``."""
    cfg = dict(model_wrapper_cfg or dict(type=DEFAULT_WRAPPER))
    if dims.tp_enabled:
        cfg = data_parallel_cfg_for_tp(cfg, dims.tp)
    return cfg


def check_composition(parallel: ParallelConfig, dims: ParallelDims,
                      model_wrapper_cfg: Optional[dict],
                      compile_cfg: Any = None,
                      batch_size: Optional[int] = None) -> dict:
    """Check what the layout and the wrapper can only get wrong together.

    Returns:
        The wrapper config compose will build.

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    from mmpar.parallelize.pipeline import (PipelineConfig,
                                            check_pipeline_wrapper)
    try:
        cfg = wrapper_cfg_for(dims, model_wrapper_cfg)
        shard_size = cfg.get('hybrid_shard_size')
        if shard_size is not None and shard_size != dims.dp_shard:
            raise ValueError(
                f'model_wrapper_cfg.hybrid_shard_size={shard_size!r} '
                f'disagrees with the layout (dp_shard={dims.dp_shard}); '
                'allowed: leave it unset and give parallel.dp_shard instead')
        if dims.pp_enabled:
            PipelineConfig.from_cfg(parallel.pipeline, dims.pp, batch_size)
            check_pipeline_wrapper(cfg, dims.dp_cp)
            if compile_cfg:
                raise ValueError(
                    f'model_compile={compile_cfg!r} with parallel.pp='
                    f'{dims.pp} is not supported yet; allowed: '
                    'model_compile=None with pipeline parallelism')
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return cfg


def data_axis_args(cfg: dict, topology: ParallelTopology) -> dict:
    """The gradient axis (``dp x cp``; the data axis without cp) as the
    wrapper ``cfg`` names takes it, for the builder's ``default_args``: its
    group, or its mesh."""
    cls = declared(cfg.get('type', DEFAULT_WRAPPER))
    if cls.data_axis_arg == 'process_group':
        return dict(process_group=topology.dp_cp.group)
    strategy = strategy_name(cfg.get('sharding_strategy'))
    if not SHARDING_STRATEGIES[strategy].shards:
        # NO_SHARD replicates over the whole gradient axis.
        return dict(device_mesh=topology.mesh['dp_cp'])
    return dict(device_mesh=topology.data_mesh())


def builds_on_meta(dims: ParallelDims, wrapper_cfg: Optional[dict]) -> bool:
    """Whether the layout shards or splits the model, so that no rank needs
    it whole: tensor or pipeline parallelism, or a sharding wrapper."""
    cls = declared((wrapper_cfg or {}).get('type', DEFAULT_WRAPPER))
    return dims.world_size > 1 and (dims.tp_enabled or dims.pp_enabled or
                                    cls.shards_parameters)


def _finish(model: nn.Module, topology: ParallelTopology, wrapper_cfg: dict,
            ac_cfg: Any, compile_cfg: Any,
            meta: Optional[tuple] = None) -> nn.Module:
    """Steps 4-7 on a model or one pipeline stage; ``meta`` is
    ``(MetaInit, device)`` for a model built on the meta device."""
    model = apply_activation_checkpointing(model, ac_cfg)
    model = apply_compile(model, compile_cfg)
    dims = topology.dims
    wrapped = not dims.pp_enabled or dims.dp_cp > 1 or dims.tp_enabled
    # (A stage with no data axis needs no wrapper; with tp it gets one,
    # which replicates over one rank, so TP models are wrapped alike.)
    cls = declared(wrapper_cfg.get('type', DEFAULT_WRAPPER)) if wrapped \
        else None
    when = cls.meta_materialize if cls is not None else 'before'
    default_args = data_axis_args(wrapper_cfg, topology) if wrapped else {}
    if meta is not None:
        meta_init, device = meta
        if when == 'before':
            meta_init.materialize(model, device)
        elif when != 'after':
            default_args[when] = meta_init.module_initializer(model, device)
    if not wrapped:
        return model
    model = build_model_wrapper(wrapper_cfg, model, default_args=default_args)
    if meta is not None and when == 'after':
        meta[0].materialize(describe(model).state_module, meta[1])
    return model


def parallelize(model: nn.Module,
                topology: Optional[ParallelTopology],
                parallel_cfg,
                model_wrapper_cfg: Optional[dict],
                compile_cfg=None,
                activation_checkpointing=None,
                meta_init: Optional[MetaInit] = None,
                device: Optional[torch.device] = None) -> nn.Module:
    """Lay ``model`` out over the ranks in compose's fixed order.

    Args:
        model: the plain model, on its device.
        topology: this rank's topology (None: one process; only
            checkpointing and compile apply, the model is not wrapped).
        parallel_cfg: the ``parallel`` section (dict, ParallelConfig or
            None).
        model_wrapper_cfg: the data-parallel wrapper to build (None: DDP).
            Its ``activation_checkpointing`` key, if any, is step 4's.
        compile_cfg: ``model_compile`` (per-block ``torch.compile``).
        activation_checkpointing: the top-level config key (step 4).
        meta_init: what :func:`~mmpar.parallelize.meta.build_on_meta`
            recorded, for a model built on the meta device (step 7).
        device: where a meta-built model's parameters go.

    Returns:
        The wrapped model.

    Raises:
        ConfigError: a combination the layout cannot train.
    """
    ac_cfg, model_wrapper_cfg = merge_wrapper_key(activation_checkpointing,
                                                  model_wrapper_cfg)
    if topology is None:
        model = apply_activation_checkpointing(model, ac_cfg)
        return apply_compile(model, compile_cfg)
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    dims = topology.dims
    wrapper_cfg = check_composition(parallel, dims, model_wrapper_cfg,
                                    compile_cfg)
    meta = None
    if meta_init is not None:
        meta = (meta_init, device or torch.device('cpu'))
    elif builds_on_meta(dims, wrapper_cfg):
        # (pp: before the split, while every rank holds the whole model.)
        broadcast_before_sharding(model)
    if dims.tp_enabled:
        model = apply_tp(model, topology.mesh['tp'], parallel.tp_plan)
    if dims.cp_enabled:
        apply_context_parallel(model, topology.mesh['cp'])
    if dims.pp_enabled:
        from mmpar.parallelize.pipeline import (pipeline_parallelize,
                                                stage_wrapper_cfg)
        stage_cfg = stage_wrapper_cfg(wrapper_cfg, parallel.pipeline)
        model = pipeline_parallelize(
            model, topology, parallel,
            lambda stage: _finish(stage, topology, stage_cfg, ac_cfg, None,
                                  meta))
    else:
        model = _finish(model, topology, wrapper_cfg, ac_cfg, compile_cfg,
                        meta)
    return model
