"""How long a rank computes inside its pipeline stages during a schedule.

:class:`StageClock` patches torch's ``PipelineStage`` chunk methods (the
forward, backward and weight-gradient passes of one micro-batch, which the
schedules call between their sends and receives) and the schedules' ``step``
methods, and adds up the seconds spent in each. Against the longest
schedule step of all ranks (the pipeline's span: the rank holding the last
stage returns early, while the first one drains), ``1 - compute / span`` is
a rank's directly measured idle share: the bubble plus the time spent
waiting on sends and receives and in the schedule's own bookkeeping. It
leaves out what the step does around the schedule (data preprocessing, the
optimizer), unlike the step-time comparison with pp=1.
"""
import time
from typing import Dict, List, Tuple

from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

# (class, method, which total it adds to)
TIMED: List[Tuple[type, str, str]] = [
    (PipelineStage, 'forward_one_chunk', 'compute'),
    (PipelineStage, 'backward_one_chunk', 'compute'),
    (PipelineStage, 'backward_weight_one_chunk', 'compute'),
    # Every torch schedule's step is one of these two (torch 2.13).
    (torch_schedules.PipelineScheduleSingle, 'step', 'schedule'),
    (torch_schedules.PipelineScheduleMulti, 'step', 'schedule'),
]


class StageClock:
    """A context manager: while inside, ``seconds`` holds the time spent in
    stage compute (``'compute'``) and in schedule steps (``'schedule'``)
    since the last :meth:`reset`."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self._depth: Dict[str, int] = {}
        self._originals = []
        self.reset()

    def reset(self) -> None:
        self.seconds = dict(compute=0.0, schedule=0.0)
        self._depth = dict(compute=0, schedule=0)

    def _timed(self, function, total: str):

        def wrapped(*args, **kwargs):
            # Only the outermost call counts, should one pass call another.
            self._depth[total] += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth[total] -= 1
                if not self._depth[total]:
                    self.seconds[total] += time.perf_counter() - start

        return wrapped

    def __enter__(self) -> 'StageClock':
        for cls, name, total in TIMED:
            # Inherited (PipelineStage's come from a private base): patched
            # on cls, and deleted again on exit.
            own = vars(cls).get(name)
            self._originals.append((cls, name, own))
            setattr(cls, name, self._timed(getattr(cls, name), total))
        return self

    def __exit__(self, *exc) -> None:
        for cls, name, own in reversed(self._originals):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        self._originals = []
