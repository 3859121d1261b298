"""The one place that decides how a model is parallelised, in a fixed order.

:func:`parallelize` applies, as torchtitan's and picotron's compose
functions do, each step taking the sub-mesh or group it needs from the
topology it is handed:

1. tensor parallelism over ``mesh['tp']`` (``parallel.tp_plan``,
   :mod:`.tensor`),
2. expert parallelism over ``mesh['ep']`` (``parallel.ep``,
   :mod:`.expert`): the experts become DTensors sharded over ep, before
   the data-parallel wrapper shards them further over ``mesh['efsdp']``,
3. context parallelism over ``mesh['cp']`` (``parallel.cp``,
   :mod:`.context`): it only tags the attention modules, so it follows TP
   (it tags them as they will run) and precedes the pipeline split (the
   stage copies keep the tag) and checkpointing / compile (whose wrappers
   would hide the module names the protocol matches),
4. the pipeline split over ``mesh['pp']`` (``parallel.pipeline``,
   :mod:`.pipeline`); steps 5-8 then run on each of this rank's stages,
5. activation checkpointing (:mod:`.activation`),
6. ``torch.compile`` (:mod:`.compile`),
7. the data-parallel wrapper, given the gradient axis (``dp x cp``: cp
   peers hold the same weights but read different tokens) as its class
   declares it takes it (a group, or the 1-D / replicate x shard mesh),
8. for a model built on the meta device (:mod:`.meta`), materialising this
   rank's share (its local shards, its stages), filled as one process would
   initialise them: before the wrapper, after it (FSDP2: only local shards
   are allocated) or inside it (FSDP1), as the wrapper class declares.

The model's ``init_weights()`` is not run here: the Runner runs it where
MMEngine's ``Runner.train()`` runs it (:mod:`mmpar.runner.init_weights`).

With ``tp > 1`` the data-parallel wrapper is the one its class names for
tensor parallelism (:mod:`.tp_wrapper`). What to build comes resolved
(:class:`~mmpar.parallelize.resolved.ResolvedPlan`, checked once by
``check_config``).
"""
from typing import Any, Optional

import torch
from mmengine.dist import broadcast
from torch import nn

from mmpar.failures import ConfigError
from mmpar.parallel.axes import REPLICATE_EXPERT_SHARD
from mmpar.parallel.sharding import SHARDING_STRATEGIES, strategy_name
from mmpar.parallel.tied import refuse_shared_parameters
from mmpar.parallel.topology import ParallelTopology
from mmpar.parallelize.activation import apply_activation_checkpointing
from mmpar.parallelize.compile import apply_compile
from mmpar.parallelize.context import apply_context_parallel
from mmpar.parallelize.expert import apply_expert_parallel
from mmpar.parallelize.meta import MetaInit
from mmpar.parallelize.resolved import (ResolvedPlan, builds_on_meta,
                                        resolve_plan)
from mmpar.parallelize.tensor import apply_tp
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
    if topology.dims.ep_enabled:
        # The experts, split over ep, are sharded over the rest of the
        # shard axes and replicated over dp_replicate (HSDP, as the rest).
        expert_axes = REPLICATE_EXPERT_SHARD \
            if topology.dims.dp_replicate_enabled else 'efsdp'
        return dict(device_mesh=topology.data_mesh(),
                    expert_mesh=topology.mesh[expert_axes])
    return dict(device_mesh=topology.data_mesh())


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
                parallel_cfg=None,
                model_wrapper_cfg: Optional[dict] = None,
                compile_cfg=None,
                activation_checkpointing=None,
                meta_init: Optional[MetaInit] = None,
                device: Optional[torch.device] = None,
                *,
                plan: Optional[ResolvedPlan] = None) -> nn.Module:
    """Lay ``model`` out over the ranks in compose's fixed order.

    Args:
        model: the plain model, on its device.
        topology: this rank's topology (None: one process; only
            checkpointing and compile apply, the model is not wrapped).
        parallel_cfg: the ``parallel`` section (dict, ParallelConfig or
            None), when no ``plan`` is given.
        model_wrapper_cfg: the data-parallel wrapper to build (None: DDP).
            Its ``activation_checkpointing`` key, if any, is step 4's.
        compile_cfg: ``model_compile`` (per-block ``torch.compile``).
        activation_checkpointing: the top-level config key (step 4).
        meta_init: what :func:`~mmpar.parallelize.meta.build_on_meta`
            recorded, for a model built on the meta device (step 7).
        device: where a meta-built model's parameters go.
        plan: the sections above, resolved once (the Runner's, from
            ``check_config``); without it they are resolved here.

    Returns:
        The wrapped model.

    Raises:
        ConfigError: a combination the layout cannot train (tied weights
            under tp or pp among them).
    """
    if plan is None:
        try:
            plan = resolve_plan(
                parallel_cfg, model_wrapper_cfg,
                dims=topology.dims if topology is not None else None,
                activation_checkpointing=activation_checkpointing,
                compile_cfg=compile_cfg)
        except ValueError as err:  # (check_config says ConfigError too)
            raise ConfigError(str(err)) from None
    ac_cfg, compile_cfg = plan.activation_checkpointing, plan.compile_cfg
    if topology is None:
        model = apply_activation_checkpointing(model, ac_cfg)
        return apply_compile(model, compile_cfg)
    plan = plan.at_world(topology.dims.world_size)
    dims, wrapper_cfg = topology.dims, plan.wrapper_cfg
    meta = None
    if meta_init is not None:
        meta = (meta_init, device or torch.device('cpu'))
    elif builds_on_meta(dims, wrapper_cfg):
        # (pp: before the split, while every rank holds the whole model.)
        broadcast_before_sharding(model)
    if dims.tp_enabled:
        # The plan would give tied weights two layouts (the pipeline split
        # refuses them under pp alone).
        refuse_shared_parameters(model, dims.tp, dims.pp)
        model = apply_tp(model, topology.mesh['tp'], plan.parallel.tp_plan)
    apply_expert_parallel(model, topology.mesh['ep'], topology.dp_cp.group)
    if dims.cp_enabled:
        apply_context_parallel(model, topology.mesh['cp'])
    if dims.pp_enabled:
        from mmpar.parallelize.pipeline import pipeline_parallelize
        stage_cfg = plan.stage_wrapper_cfg
        model = pipeline_parallelize(
            model, topology, plan.pipeline,
            lambda stage: _finish(stage, topology, stage_cfg, ac_cfg, None,
                                  meta))
    else:
        model = _finish(model, topology, wrapper_cfg, ac_cfg, compile_cfg,
                        meta)
    return model
