"""torch's pipeline schedules by name (``PIPELINE_SCHEDULES``).

Single-stage schedules (``GPipe``, ``1F1B``) put one stage on each pp rank;
multi-stage ones (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
``ZBVZeroBubble``, ``DualPipeV``) put ``stages_per_rank`` virtual stages on
each rank: round-robin ("loop": rank r holds r, r+pp, ...) or, for the V
schedules, rank r holds stages r and 2*pp-1-r.
"""
from typing import List, Tuple

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
# Split backward into input and weight gradients to fill the bubble.
ZERO_BUBBLE_SCHEDULES = ('InterleavedZeroBubble', 'ZBVZeroBubble',
                         'DualPipeV')

# torch 2.13 runs a V schedule's backward actions in eval too ("can't
# steal_bwd_input if this stage doesn't have backward"): the others validate.
EVAL_SCHEDULES = tuple(name for name in _TORCH if name not in V_SCHEDULES)

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


def check_evaluates(name: str, loop: str) -> None:
    """Refuse schedule ``name`` for a job that runs a val or test loop
    (``loop`` says which, for the message) where it cannot (the V
    schedules, :data:`EVAL_SCHEDULES`).

    Raises:
        ValueError: naming the key, the value and what is allowed.
    """
    if name in V_SCHEDULES:
        raise ValueError(
            f'parallel.pipeline.schedule={name!r} cannot run validation/test '
            f'in torch 2.13 ({loop}); allowed for a job with a val/test '
            f'loop: {", ".join(EVAL_SCHEDULES)}')


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


def theoretical_bubble(name: str, pp: int, num_microbatches: int,
                       stages_per_rank: int = 1) -> Tuple[float, str]:
    """The share of a step each rank idles by the schedule's textbook
    analysis (equal stages, free communication), and the formula used.

    * GPipe, 1F1B: ``(p-1)/(m+p-1)`` (Huang et al. 2019, GPipe;
      Narayanan et al. 2021 for 1F1B): ``p-1`` fill/drain slots in ``m+p-1``.
    * Interleaved1F1B, LoopedBFS with ``v`` stages per rank:
      ``(p-1)/(v*m+p-1)`` (Narayanan et al. 2021, https://arxiv.org/abs/
      2104.04473): each slot is ``1/v`` of a rank's work per micro-batch.
    * The zero-bubble schedules: the same interleaved value, as an upper
      bound; delaying the weight gradients fills part of it, all of it when
      forward, input- and weight-gradient passes cost the same (Qi et al.
      2023, https://arxiv.org/abs/2401.10241).

    Returns:
        ``(value, formula)``, the formula with ``<=`` for an upper bound.
    """
    schedule_class(name)  # unknown names raise, listing the known ones
    p, m, v = pp, num_microbatches, stages_per_rank
    if v == 1:
        return (p - 1) / (m + p - 1), '(p-1)/(m+p-1)'
    formula = '(p-1)/(v*m+p-1)'
    if name in ZERO_BUBBLE_SCHEDULES:
        formula = '<= ' + formula
    return (p - 1) / (v * m + p - 1), formula
