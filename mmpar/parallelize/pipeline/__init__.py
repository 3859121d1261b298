"""Pipeline parallelism over ``mesh['pp']`` with torch's schedules.

:func:`pipeline_parallelize` is step 2 of :mod:`mmpar.parallelize.compose`:
it checks the model against the protocol (:mod:`.split`), cuts this rank's
stages out of it, wraps each with the data-parallel wrapper over the data
axis, and returns an :class:`~.step.MMPipelineParallel` whose steps run the
schedule (:mod:`.step`). See docs/pipeline_parallel.md.
"""
from typing import Callable, Optional

from torch import nn

from mmpar.failures import ConfigError
from mmpar.parallelize.pipeline.config import PipelineConfig
from mmpar.parallelize.pipeline.schedules import (schedule_class,
                                                  stage_indices)
from mmpar.parallelize.pipeline.split import (check_protocol, layer_names,
                                              split_stage, stage_starts)
from mmpar.parallelize.pipeline.step import MMPipelineParallel

__all__ = [
    'PipelineConfig', 'MMPipelineParallel', 'pipeline_parallelize',
    'check_protocol', 'layer_names', 'split_stage', 'stage_starts',
    'check_pipeline_wrapper'
]

# Data-parallel wrappers a stage may have: FSDP2 (torch's PipelineStage
# drives its gradient sync), DDP and, with tp > 1, the tensor-parallel DDP
# (gradients all-reduced once per optimizer step, see
# step._stage_submodule).
STAGE_WRAPPERS = ('MMDistributedDataParallel', 'MMFullyShard',
                  'MMTensorParallelDDP')


def check_pipeline_wrapper(model_wrapper_cfg: Optional[dict], dp: int,
                           stages_per_rank: int) -> None:
    """Refuse a data-parallel wrapper that cannot wrap a pipeline stage.

    Raises:
        ConfigError: naming ``model_wrapper_cfg.type`` and the allowed ones.
    """
    if dp <= 1:
        return
    wrapper = (model_wrapper_cfg or {}).get('type',
                                            'MMDistributedDataParallel')
    name = getattr(wrapper, '__name__', str(wrapper)).split('.')[-1]
    if name not in STAGE_WRAPPERS:
        raise ConfigError(
            f'model_wrapper_cfg.type={name!r} cannot wrap a pipeline stage '
            f'(parallel.pp > 1 with dp={dp}); allowed: '
            f'{", ".join(STAGE_WRAPPERS)}')


def _wrap_stage(stage: nn.Module, wrap: Callable[[nn.Module, dict],
                                                 nn.Module],
                cfg: dict) -> nn.Module:
    stage = wrap(stage, cfg)
    # torch's schedule runs the plain stage, not the wrapper's forward
    # (step._stage_submodule): a wrapper whose backward hooks expect its own
    # forward (the bucketed tensor-parallel DDP) must stand aside; its
    # gradients are averaged once per optimizer step instead.
    remove_hooks = getattr(stage, 'remove_grad_hooks', None)
    if remove_hooks is not None:
        remove_hooks()
    return stage


def pipeline_parallelize(model: nn.Module, topology, parallel,
                         model_wrapper_cfg: Optional[dict],
                         wrap: Callable[[nn.Module, dict], nn.Module],
                         batch_size: Optional[int] = None
                         ) -> MMPipelineParallel:
    """Split ``model`` into this rank's stages and wrap them.

    Args:
        model: the plain (possibly tensor-parallel) model.
        topology: this rank's :class:`~mmpar.parallel.topology.
            ParallelTopology` (``pp`` group, ``mesh['pp']``).
        parallel: the :class:`~mmpar.parallel.config.ParallelConfig`.
        model_wrapper_cfg: the data-parallel wrapper for each stage.
        wrap: ``wrap(stage, cfg)`` builds that wrapper.
        batch_size: the per-rank batch size, when known (checked).

    Raises:
        ConfigError: a bad ``parallel.pipeline``, a model that does not meet
            the protocol, or a wrapper that cannot wrap a stage.
    """
    from mmpar.parallel.mesh import device_type
    import torch
    dims = topology.dims
    try:
        config = PipelineConfig.from_cfg(parallel.pipeline, dims.pp,
                                         batch_size)
        check_protocol(model)
        num_stages = config.num_stages(dims.pp)
        starts = stage_starts(model, config.split_points, num_stages)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    check_pipeline_wrapper(model_wrapper_cfg, dims.dp, config.stages_per_rank)
    pp_rank = topology.pp.rank
    indices = stage_indices(config.schedule, pp_rank, dims.pp,
                            config.stages_per_rank)
    holders = [r for r in range(dims.pp) if num_stages - 1 in stage_indices(
        config.schedule, r, dims.pp, config.stages_per_rank)]
    wrapper_cfg = dict(model_wrapper_cfg or {})
    if 'FullyShard' in str(wrapper_cfg.get('type', '')):
        # FSDP2 must keep parameters gathered between the micro-batches'
        # forward and backward, which the schedule interleaves.
        wrapper_cfg.setdefault('reshard_after_forward', False)
    stages, extra = [], ()
    for index in indices:
        stage = split_stage(model, starts, index)
        # With tp > 1 also at dp=1, as compose wraps any tp model
        # (MMTensorParallelDDP; its all-reduce is then over one rank).
        if dims.dp > 1 or dims.tp_enabled:
            stage = _wrap_stage(stage, wrap, wrapper_cfg)
            extra = getattr(stage, 'clip_extra_groups', ())
        stages.append(stage)
    device = torch.device(device_type(), torch.cuda.current_device()) \
        if device_type() == 'cuda' else torch.device('cpu')
    return MMPipelineParallel(
        stages, indices, num_stages, config.schedule,
        schedule_class(config.schedule), config.num_microbatches,
        topology.pp.group, topology.pp.global_ranks, holders[0], device,
        clip_extra_groups=extra)
