"""Run a config for a few steps on N fresh local ranks and time it.

:func:`run_trial` is how the layout search (:mod:`.search`) measures a
candidate: N processes are spawned (gloo on CPU, one thread each, as
``tools/dist_train.sh`` runs them), each builds ``mmpar.Runner`` from the
config and trains ``warmup + steps`` iterations through the Runner's own
train loop, so what is timed is what training runs (data loading, the step,
hooks). Fresh processes make each rank's peak resident memory (``VmHWM``)
the candidate's own; process start-up and the Runner's build are not timed.

Each timed step is the wall time from the end of one iteration to the end
of the next on every rank (a barrier ends each iteration, so a step is as
slow as its slowest rank). A trial given ``stop_above`` ends after
``min_steps`` timed steps when even its fastest step so far is slower than
that: the search's early stop for candidates already clearly slower.
"""
import contextlib
import datetime
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.model import BaseModel

from mmpar import device
from mmpar.parallelize.meta import apply_user_mmap_threshold
from mmpar.registry import MODELS
from mmpar.runner import Runner

# A rank that waits longer than this in a collective fails the trial.
COLLECTIVE_TIMEOUT_S = 300
# The environment of every trial rank. glibc raises its mmap threshold to
# the largest block freed so far (up to 32 MiB) and then serves big tensors
# from heap arenas whose freed pages stay resident: a rank's peak RSS then
# follows the order of allocations more than its live tensors (under FSDP on
# CPU it ran far above them). A fixed threshold makes every tensor over
# 1 MiB its own mapping, returned when freed, so the peak RSS tracks live
# memory (docs/layout_search.md). Read by glibc at start-up: it must be in
# the environment the rank is spawned with.
RANK_ENV = dict(MALLOC_MMAP_THRESHOLD_='1048576')


# The ranks fork from one server process that imported these once (a
# fresh process per rank, without paying torch's, MMEngine's and mmpar's
# imports per candidate: that was most of a trial's time on 2 cores).
START_METHOD = 'forkserver'
PRELOAD = ['torch', 'torch.distributed', 'mmengine.runner', 'mmpar.runner',
           'mmpar.analysis.trial']


def _context():
    ctx = mp.get_context(START_METHOD)
    # Read when the server starts (the first trial); harmless later.
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextlib.contextmanager
def rank_environment(env: Dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` while ranks are spawned (spawned processes
    copy it), restored afterwards."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class TrialResult:
    """What one trial measured.

    Attributes:
        step_times: seconds of each timed step (slowest rank).
        tokens_per_step: tokens the whole job consumed per step (None for
            batches without a token tensor ``inputs``).
        peak_rss: each rank's peak memory, bytes: resident (``VmHWM``) on
            the CPU; in a job on an accelerator (:mod:`.job_search`), its
            peak reserved device memory (:func:`mmpar.device.peak_memory`).
        start_rss: each rank's resident memory after its imports, bytes.
        built_rss: each rank's resident memory once the Runner is built
            (model wrapped and materialised), bytes.
        ready_rss: each rank's resident memory before the first iteration
            (data loader and optimizer built), bytes.
        stopped_early: the trial ended early (``stop_above``).
        error: the first failing rank's error, or None.
        wall_s: seconds from spawning the ranks to their exit.
    """
    step_times: List[float] = field(default_factory=list)
    tokens_per_step: Optional[int] = None
    peak_rss: List[int] = field(default_factory=list)
    start_rss: List[int] = field(default_factory=list)
    built_rss: List[int] = field(default_factory=list)
    ready_rss: List[int] = field(default_factory=list)
    stopped_early: bool = False
    error: Optional[str] = None
    wall_s: float = 0.0


class TrialClock(Hook):
    """Times the iterations after ``warmup`` and stops the loop early when
    asked; registered last so that every other hook's work is timed."""

    priority = 'LOWEST'

    def __init__(self, warmup: int, stop_above: Optional[float],
                 min_steps: int, data_ranks: int):
        self.warmup = warmup
        self.stop_above = stop_above
        self.min_steps = min_steps
        self.data_ranks = data_ranks
        self.times: List[float] = []
        self.tokens: Optional[int] = None
        self.stopped_early = False
        self._last: Optional[float] = None
        self.ready_rss = 0

    def before_train(self, runner) -> None:
        self.ready_rss = device.memory_in_use()

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
        stop = torch.tensor([0])
        if dist.get_rank() == 0 and self.stop_above is not None and \
                len(self.times) >= self.min_steps and \
                min(self.times) > self.stop_above:
            stop[0] = 1
        dist.broadcast(stop, 0)  # the ranks agree on stopping
        if stop.item():
            self.stopped_early = True
            runner.train_loop.stop_training = True


def _redirect_output(log_file: str) -> None:
    # The ranks' MMEngine logs go to a file: the search prints progress.
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)


def _join(rank: int, world_size: int, init_file: str) -> None:
    """This trial rank's environment, one thread, and its gloo group."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR='127.0.0.1', OMP_NUM_THREADS='1')
    torch.set_num_threads(1)
    dist.init_process_group(
        'gloo', init_method=f'file://{init_file}', rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _trial_rank(rank: int, world_size: int, init_file: str, cfg_dict: dict,
                warmup: int, stop_above: Optional[float], min_steps: int,
                data_ranks: int, log_dir: str, results) -> None:
    apply_user_mmap_threshold()
    start_rss = device.status_bytes('VmRSS')
    _redirect_output(os.path.join(log_dir, f'rank{rank}.log'))
    _join(rank, world_size, init_file)
    try:
        runner = Runner.from_cfg(Config(cfg_dict))
        built_rss = device.status_bytes('VmRSS')
        clock = TrialClock(warmup, stop_above, min_steps, data_ranks)
        runner.register_hook(clock)
        runner.train()
        memory = [start_rss, built_rss, clock.ready_rss,
                  device.status_bytes('VmHWM')]
        gathered = [None] * world_size
        dist.all_gather_object(gathered, memory)
        if rank == 0:
            results.put(TrialResult(
                step_times=clock.times, tokens_per_step=clock.tokens,
                start_rss=[m[0] for m in gathered],
                built_rss=[m[1] for m in gathered],
                ready_rss=[m[2] for m in gathered],
                peak_rss=[m[3] for m in gathered],
                stopped_early=clock.stopped_early))
    except BaseException:  # noqa: B902 - reported to the search
        results.put(TrialResult(error=traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_trial(cfg: Config, world_size: int, warmup: int, steps: int,
              data_ranks: int, stop_above: Optional[float] = None,
              min_steps: int = 2, log_dir: Optional[str] = None,
              env: Optional[Dict[str, str]] = None) -> TrialResult:
    """Train ``cfg`` on ``world_size`` fresh local ranks for ``warmup +
    steps`` iterations and time the last ``steps``.

    Args:
        cfg: a full training config (the trial sets nothing itself: the
            caller cuts ``train_cfg`` to ``warmup + steps`` iterations).
        world_size: ranks to spawn.
        warmup: untimed iterations first.
        steps: timed iterations (fewer when stopped early).
        data_ranks: the layout's data-parallel size (tokens per step are
            one data rank's batch times it).
        stop_above: seconds; stop once ``min_steps`` timed steps are all
            slower than this.
        min_steps: timed steps before the early stop may act.
        log_dir: where the ranks' logs go (``rank<r>.log``); a temporary
            directory when None.
        env: environment variables of the ranks (None: :data:`RANK_ENV`).

    Returns:
        The measurements, or a result whose ``error`` says why the trial
        failed (the first failing rank's traceback).
    """
    log_dir = log_dir or tempfile.mkdtemp(prefix='mmpar_trial_')
    os.makedirs(log_dir, exist_ok=True)
    fd, init_file = tempfile.mkstemp(prefix='mmpar_trial_rdzv_')
    os.close(fd)
    os.unlink(init_file)  # file:// rendezvous in a fresh name: no port
    ctx = _context()
    results = ctx.SimpleQueue()
    cfg_dict = cfg.to_dict() if isinstance(cfg, Config) else dict(cfg)
    start = time.time()
    result = None
    try:
        with rank_environment(RANK_ENV if env is None else env):
            mp.start_processes(
                _trial_rank,
                args=(world_size, init_file, cfg_dict, warmup, stop_above,
                      min_steps, data_ranks, log_dir, results),
                nprocs=world_size, start_method=START_METHOD)
    except Exception as err:  # noqa: B902 - a rank failed: its message
        result = TrialResult(error=_first_error(results, err))
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
    if result is None:
        result = results.get()
    result.wall_s = time.time() - start
    return result


def _first_error(results, err: Exception) -> str:
    while not results.empty():
        reported = results.get()
        if reported.error:
            return reported.error
    return str(err)


class _NoModel(BaseModel):
    """A model of one parameter (a data-parallel wrapper needs one): what a
    rank holds besides its model."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scalar = torch.nn.Parameter(torch.zeros(1))

    def forward(self, *args, **kwargs):
        raise NotImplementedError


def _baseline_rank(rank: int, world_size: int, init_file: str,
                   cfg_dict: dict, work_dir: str, results) -> None:
    apply_user_mmap_threshold()
    _redirect_output(os.path.join(work_dir, f'baseline{rank}.log'))
    _join(rank, world_size, init_file)
    try:
        cfg = Config(cfg_dict)
        for key in ('parallel', 'model_wrapper_cfg',
                    'activation_checkpointing', 'model_compile', 'load_from'):
            cfg.pop(key, None)
        # Registered in this process only (it is no model for users).
        MODELS.register_module(name='RankBaselineModel', module=_NoModel,
                               force=True)
        cfg.model = dict(type='mmpar.RankBaselineModel')
        cfg.work_dir = work_dir
        cfg.launcher = 'pytorch'
        runner = Runner.from_cfg(cfg)
        loader = runner.build_dataloader(cfg.train_dataloader)
        next(iter(loader))  # the loader's iterator and one batch
        rss = [None] * world_size
        dist.all_gather_object(rss, device.status_bytes('VmRSS'))
        if rank == 0:
            results.put(max(rss))
    except BaseException:  # noqa: B902 - reported to the caller
        results.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def measure_baseline(cfg: Config, world_size: int = 1) -> int:
    """What a training rank holds besides its model, measured on
    ``world_size`` fresh local ranks (the largest): the Runner's imports
    (every parallel technique's included), a process group of that size,
    MMEngine's logger, environment report and visualizer, the train data
    set and loader with one batch (``num_workers`` run in processes of
    their own). The same Runner is built from ``cfg`` with a one-parameter
    model and the default layout.

    Raises:
        RuntimeError: a rank failed, with its traceback.
    """
    import shutil
    work_dir = tempfile.mkdtemp(prefix='mmpar_baseline_')
    fd, init_file = tempfile.mkstemp(prefix='mmpar_baseline_rdzv_')
    os.close(fd)
    os.unlink(init_file)
    results = _context().SimpleQueue()
    cfg_dict = cfg.to_dict() if isinstance(cfg, Config) else dict(cfg)
    try:
        with rank_environment(RANK_ENV):
            mp.start_processes(
                _baseline_rank,
                args=(world_size, init_file, cfg_dict, work_dir, results),
                nprocs=world_size, start_method=START_METHOD)
    except Exception as err:  # noqa: B902 - a rank failed: its message
        value = _first_error_text(results, err)
    else:
        value = results.get()
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        if os.path.exists(init_file):
            os.unlink(init_file)
    if not isinstance(value, int):
        raise RuntimeError(f'measuring the baseline of a rank failed: {value}')
    return value


def _first_error_text(results, err: Exception) -> str:
    while not results.empty():
        value = results.get()
        if isinstance(value, str):
            return value
    return str(err)
