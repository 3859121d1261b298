"""One candidate's trial inside the launched job (:mod:`.job_search`).

:func:`run_trial` builds ``mmpar.Runner`` from the candidate's config in
this job's own processes, trains ``warmup + steps`` iterations through the
Runner's own train loop, so what is timed is what training runs (data
loading, the step, hooks), and tears it down: the trial's groups and mesh
destroyed, its memory released, the peak statistics reset for the next.

Each timed step is the wall time from the end of one iteration to the end
of the next on every rank (the device synchronised, then a barrier ends
each iteration, so a step is as slow as its slowest rank). A trial given
``stop_above`` ends after :data:`MIN_STEPS` timed steps when even its fastest
step so far is slower than that: the search's early stop for candidates
already clearly slower.
"""
import time
import traceback
from typing import List, Optional

import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel

from mmpar import device
from mmpar.analysis.search_table import TrialResult
from mmpar.parallel.seed import reset_parallelism
from mmpar.registry import MODELS
from mmpar.runner import Runner
from mmpar.runner.instances import forget_experiment

# Timed steps before the early stop may end a trial.
MIN_STEPS = 2


def trial_config(cfg: Config, iterations: int, work_dir: str) -> Config:
    """``cfg`` cut to ``iterations`` training iterations: no validation, no
    checkpoints, logs in ``work_dir``, a fixed seed when the config has
    none."""
    trial = Config(cfg.to_dict())
    trial.work_dir = work_dir
    trial.train_cfg = dict(by_epoch=False, max_iters=iterations)
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator',
                'test_dataloader', 'test_cfg', 'test_evaluator'):
        trial[key] = None
    trial.default_hooks = dict(trial.get('default_hooks') or {},
                               checkpoint=None)
    trial.log_level = 'WARNING'
    # The same data for every candidate: a config without a seed would get
    # a random one (and another data order) per trial.
    randomness = dict(trial.get('randomness') or {})
    trial.randomness = dict(randomness, seed=randomness.get('seed') or 0)
    return trial


class TrialClock(Hook):
    """Times the iterations after ``warmup`` and stops the loop early when
    asked; registered last so that every other hook's work is timed."""

    priority = 'LOWEST'

    def __init__(self, warmup: int, stop_above: Optional[float],
                 data_ranks: int):
        self.warmup = warmup
        self.stop_above = stop_above
        self.data_ranks = data_ranks
        self.times: List[float] = []
        self.tokens: Optional[int] = None
        self.stopped_early = False
        self._last: Optional[float] = None

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        device.synchronize()  # the step's queued kernels have run
        dist.barrier()  # every rank has finished this iteration
        now = time.perf_counter()
        if self._last is not None and batch_idx >= self.warmup:
            self.times.append(now - self._last)
        self._last = now
        inputs = data_batch.get('inputs') if isinstance(data_batch,
                                                        dict) else None
        if isinstance(inputs, torch.Tensor) and \
                inputs.dtype in (torch.long, torch.int):
            self.tokens = inputs.numel() * self.data_ranks
        stop = torch.tensor([int(
            dist.get_rank() == 0 and self.stop_above is not None and
            len(self.times) >= MIN_STEPS and
            min(self.times) > self.stop_above)])
        dist.broadcast(stop, 0)  # the ranks agree on stopping
        if stop.item():
            self.stopped_early = True
            runner.train_loop.stop_training = True


def teardown() -> None:
    """Destroy the trial's groups, free its memory, start a new peak."""
    reset_parallelism()
    device.release_memory()
    dist.barrier()
    device.reset_peak_memory()


class _NoModel(BaseModel):
    """A model of one parameter (a data-parallel wrapper needs one): what a
    rank holds besides its model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scalar = torch.nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):
        raise NotImplementedError


def measure_baseline(cfg: Config, work_dir: str) -> int:
    """What a rank holds besides its model, measured in the job (the
    largest rank's): a Runner built from ``cfg`` with a one-parameter model
    and the default layout, its train loader and one batch. Device memory
    in use on an accelerator, resident memory on the CPU."""
    base = Config(cfg.to_dict())
    for key in ('parallel', 'model_wrapper_cfg', 'activation_checkpointing',
                'model_compile', 'load_from'):
        base.pop(key, None)
    # Registered in this process only (it is no model for users).
    MODELS.register_module(name='RankBaselineModel', module=_NoModel,
                           force=True)
    base.model = dict(type='mmpar.RankBaselineModel')
    base.work_dir = work_dir
    base.experiment_name = 'layout_search_baseline'
    base.log_level = 'WARNING'
    base.resume = False
    runner = Runner.from_cfg(base)
    next(iter(runner.build_dataloader(base.train_dataloader)))
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, device.memory_in_use())
    forget_experiment(runner.experiment_name)
    del runner
    teardown()
    return max(held)


def run_trial(cfg: Config, warmup: int, steps: int, data_ranks: int,
              stop_above: Optional[float] = None) -> TrialResult:
    """Train ``cfg`` (cut to ``warmup + steps`` iterations by the caller:
    :func:`trial_config`) in this job's processes, timing the last
    ``steps``, and tear it down.

    Args:
        cfg: a full training config.
        warmup: untimed iterations first.
        steps: timed iterations (fewer when stopped early).
        data_ranks: the layout's data-parallel size (tokens per step are
            one data rank's batch times it).
        stop_above: seconds; stop once :data:`MIN_STEPS` timed steps are
            all slower than this.

    Returns:
        The same result on every rank: rank 0's step times, every rank's
        peak memory, the first failing rank's traceback as ``error``.
    """
    error, name = None, None
    clock = TrialClock(warmup, stop_above, data_ranks)
    try:
        runner = Runner.from_cfg(cfg)
        name = runner.experiment_name
        runner.register_hook(clock)
        runner.train()
    except Exception:  # noqa: B902 - reported in the table
        error = traceback.format_exc()
    runner = None
    forget_experiment(name)
    mine = dict(error=error, peak=device.peak_memory()['peak'],
                times=clock.times, tokens=clock.tokens,
                stopped=clock.stopped_early)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    teardown()
    first = every[0]
    errors = [f'rank {rank}: {r["error"]}' for rank, r in enumerate(every)
              if r['error']]
    return TrialResult(
        step_times=first['times'], tokens_per_step=first['tokens'],
        peak_rss=[r['peak'] for r in every], stopped_early=first['stopped'],
        error=errors[0] if errors else None)
