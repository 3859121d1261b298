"""A hook that clocks whole training iterations, saves included.

Loaded into a run with ``custom_imports`` (benchmarks only). At the lowest
priority its ``after_train_iter`` runs after every other hook's (the
checkpoint hook's save among them), so the time between two of its calls
is everything an iteration blocks training for. Each rank writes its
``perf_counter`` readings to ``WORK_DIR/iter_clock_rank{R}.json`` at the end
of the run.
"""
import json
import os
import time

from mmengine.dist import get_rank
from mmengine.hooks import Hook

from mmpar.registry import HOOKS


@HOOKS.register_module()
class IterClock(Hook):
    """``{"start": t0, "ends": [t after iteration 1, 2, ...]}`` per rank."""

    priority = 'LOWEST'

    def before_train(self, runner) -> None:
        self.start, self.ends = time.perf_counter(), []

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        self.ends.append(time.perf_counter())

    def after_train(self, runner) -> None:
        path = os.path.join(runner.work_dir,
                            f'iter_clock_rank{get_rank()}.json')
        with open(path, 'w') as f:
            json.dump(dict(start=self.start, ends=self.ends), f)


def iteration_seconds(work_dir: str) -> list:
    """Per iteration, the slowest rank's seconds (from the clock files)."""
    per_rank = []
    for name in sorted(os.listdir(work_dir)):
        if name.startswith('iter_clock_rank'):
            with open(os.path.join(work_dir, name)) as f:
                clock = json.load(f)
            marks = [clock['start']] + clock['ends']
            per_rank.append([b - a for a, b in zip(marks, marks[1:])])
    return [max(column) for column in zip(*per_rank)]
