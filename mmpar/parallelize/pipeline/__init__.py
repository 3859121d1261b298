"""Pipeline parallelism over ``mesh['pp']`` with torch's schedules.

:func:`pipeline_parallelize` is step 2 of :mod:`mmpar.parallelize.compose`:
it checks the model against the protocol (:mod:`.split`), cuts this rank's
stages out of it, wraps each with the data-parallel wrapper over the data
axis, and returns an :class:`~.step.MMPipelineParallel` whose steps run the
schedule (:mod:`.step`). See docs/pipeline_parallel.md.
"""
from typing import Callable

from torch import nn
from torch.distributed.pipelining import PipelineStage

from mmpar.device import local_device
from mmpar.failures import ConfigError
from mmpar.parallelize.pipeline.config import PipelineConfig
from mmpar.parallelize.pipeline.schedules import (schedule_class,
                                                  stage_indices)
from mmpar.parallelize.pipeline.split import (check_protocol, layer_names,
                                              split_stage, stage_starts)
from mmpar.parallelize.pipeline.stage import MicrobatchReshardStage
from mmpar.parallelize.tp_check import cancel_dry_run
from mmpar.parallelize.pipeline.step import MMPipelineParallel
from mmpar.wrappers.base import StepMixin

__all__ = [
    'PipelineConfig', 'MMPipelineParallel', 'pipeline_parallelize',
    'check_protocol', 'layer_names', 'split_stage', 'stage_starts'
]


def pipeline_parallelize(model: nn.Module, topology, config: PipelineConfig,
                         wrap: Callable[[nn.Module], nn.Module]
                         ) -> MMPipelineParallel:
    """Split ``model`` into this rank's stages and finish each with ``wrap``.

    Args:
        model: the plain (possibly tensor-parallel) model.
        topology: this rank's :class:`~mmpar.parallel.topology.
            ParallelTopology` (``pp`` group).
        config: the checked ``parallel.pipeline`` section.
        wrap: the rest of compose's order for one stage (activation
            checkpointing, the data-parallel wrapper); returns the stage,
            wrapped or plain.

    Raises:
        ConfigError: a model that does not meet the protocol.
    """
    dims = topology.dims
    try:
        check_protocol(model, dims.pp)
        num_stages = config.num_stages(dims.pp)
        starts = stage_starts(model, config.split_points, num_stages)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    cancel_dry_run(model)  # stages are called, never the whole model
    pp_rank = topology.pp.rank
    indices = stage_indices(config.schedule, pp_rank, dims.pp,
                            config.stages_per_rank)
    holders = [r for r in range(dims.pp) if num_stages - 1 in stage_indices(
        config.schedule, r, dims.pp, config.stages_per_rank)]
    stages, clip_groups = [], ()
    for index in indices:
        stage = wrap(split_stage(model, starts, index))
        if isinstance(stage, StepMixin):
            # torch's schedule runs the plain stage, not the wrapper's
            # forward: see MMPipelineParallel.
            stage.prepare_as_pipeline_stage()
            clip_groups = stage.clip_groups
        stages.append(stage)
    device = local_device()
    return MMPipelineParallel(
        stages, indices, num_stages, config.schedule,
        schedule_class(config.schedule), config.num_microbatches,
        topology.pp.group, topology.pp.global_ranks, holders[0], device,
        stage_modules=[s.module if isinstance(s, StepMixin) else s
                       for s in stages],
        clip_groups=clip_groups,
        stage_cls=MicrobatchReshardStage
        if config.reshards_per_microbatch else PipelineStage)
