"""torch's pipeline schedules by name (``PIPELINE_SCHEDULES``).

Single-stage schedules (``GPipe``, ``1F1B``) put one stage on each pp rank;
multi-stage ones (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
``ZBVZeroBubble``, ``DualPipeV``) put ``stages_per_rank`` virtual stages on
each rank: round-robin ("loop": rank r holds r, r+pp, ...) or, for the V
schedules, rank r holds stages r and 2*pp-1-r.
"""
from typing import List

from torch.distributed.pipelining import schedules as torch_schedules

from mmpar.registry import PIPELINE_SCHEDULES, lookup_callable

# Registered name -> torch class.
_TORCH = {
    'GPipe': torch_schedules.ScheduleGPipe,
    '1F1B': torch_schedules.Schedule1F1B,
    'Interleaved1F1B': torch_schedules.ScheduleInterleaved1F1B,
    'LoopedBFS': torch_schedules.ScheduleLoopedBFS,
    'InterleavedZeroBubble': torch_schedules.ScheduleInterleavedZeroBubble,
    'ZBVZeroBubble': torch_schedules.ScheduleZBVZeroBubble,
    'DualPipeV': torch_schedules.ScheduleDualPipeV,
}
V_SCHEDULES = ('ZBVZeroBubble', 'DualPipeV')

for _name, _cls in _TORCH.items():
    if PIPELINE_SCHEDULES.get(_name) is None:
        PIPELINE_SCHEDULES.register_module(name=_name, module=_cls)


def schedule_class(name: str) -> type:
    """The torch schedule class registered as ``name``.

    Raises:
        ValueError: an unknown name, listing the registered ones.
    """
    if not isinstance(name, str):
        raise ValueError(f'parallel.pipeline.schedule={name!r} is not '
                         'allowed; allowed: a registered schedule name')
    return lookup_callable(PIPELINE_SCHEDULES, name,
                           'parallel.pipeline.schedule')


def is_multi_stage(name: str) -> bool:
    """Whether the schedule runs several (virtual) stages per rank."""
    return issubclass(schedule_class(name),
                      torch_schedules.PipelineScheduleMulti)


def stage_indices(name: str, pp_rank: int, pp: int,
                  stages_per_rank: int) -> List[int]:
    """The global stage indices pp rank ``pp_rank`` holds, in order."""
    if name in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]
