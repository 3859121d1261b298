"""The layout search as a phase of the launched job: ``tools/train.py
CONFIG --launcher pytorch --search`` (``bash tools/dist_train.sh CONFIG N
--search``, slurm and several nodes alike).

Every rank of the job takes part, on the job's backend and devices:

1. rank 0 plans the candidates (:func:`~mmpar.analysis.search.
   plan_candidates`) before the process group starts (the plan splits the
   meta model on torch's fake backend, which needs the default group to
   itself); the others wait in the rendezvous;
2. the process group starts as the Runner would start it, and rank 0's
   rows reach every rank;
3. what a rank holds besides its model is measured in the job (a Runner
   with a one-parameter model and one batch: :func:`measure_baseline`) and
   added to the predictions; the memory budget filters;
4. each candidate is built, trained ``warmup + steps`` iterations and torn
   down inside these processes (:func:`run_trial`): a ``mmpar.Runner`` whose
   groups and mesh are made from the world group and destroyed after, the
   memory released and the peak statistics reset before. Steps are timed
   with the device synchronised; memory is each rank's peak device memory
   (reserved), or its peak RSS on the CPU (:mod:`mmpar.device`);
5. :mod:`.search_rounds` ranks them as the local search always did; rank 0
   writes the table and the winning config (:mod:`.search_report`), and
   every rank returns the winner's config to train (unless
   ``--search-only``).

Every rank sees the same trial results (gathered), so they all take the
same decisions. What this cannot survive: a candidate that fails on some
ranks only while the others wait in a collective (an out-of-memory error
on one GPU): those wait for ``env_cfg.dist_cfg.timeout`` and the job ends.
The planner's memory prediction and ``--memory-budget`` keep such
candidates out.
"""
import itertools
import os.path as osp
import time
import traceback
from typing import List, Optional

import torch.distributed as dist
from mmengine.config import Config

from mmpar import device
from mmpar.analysis.layouts import DEFAULT_SCHEDULES
from mmpar.analysis.search import (add_baseline, apply_budget,
                                   plan_candidates, stderr_progress,
                                   trial_config)
from mmpar.analysis.search_report import (format_search, nothing_fits,
                                          write_search)
from mmpar.analysis.search_rounds import TrialRunner, measure_rows, prior, \
    ranked
from mmpar.analysis.search_table import (OVER_BUDGET, REFUSED, SKIPPED, Row,
                                         SearchResult)
from mmpar.analysis.trial import TrialClock, TrialResult, _NoModel
from mmpar.dist import init_dist, launch_env, usable_backend
from mmpar.parallel.seed import reset_parallelism
from mmpar.registry import MODELS
from mmpar.runner import Runner

# Exit statuses of a search that trains nothing (tools/plan.py's).
NOTHING_FITS, NOTHING_RUNS = 3, 2


def start_job(cfg: Config) -> None:
    """The default process group, as ``mmpar.Runner.setup_env`` starts it
    (``env_cfg.dist_cfg``, the backend usable here)."""
    if dist.is_initialized():
        return
    dist_cfg = dict(((cfg.get('env_cfg') or {}).get('dist_cfg')) or {})
    dist_cfg['backend'] = usable_backend(dist_cfg.get('backend'))
    init_dist(cfg.launcher, **dist_cfg)


def _from_rank0(value):
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _teardown() -> None:
    """Destroy the trial's groups, free its memory, start a new peak."""
    reset_parallelism()
    device.release_memory()
    dist.barrier()
    device.reset_peak_memory()


def measure_baseline(cfg: Config, work_dir: str) -> int:
    """What a rank holds besides its model, measured in the job (the
    largest rank's): a Runner built from ``cfg`` with a one-parameter model
    and the default layout, its train loader and one batch. Device memory
    in use on an accelerator, resident memory on the CPU."""
    base = Config(cfg.to_dict())
    for key in ('parallel', 'model_wrapper_cfg', 'activation_checkpointing',
                'model_compile', 'load_from'):
        base.pop(key, None)
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
    del runner
    _teardown()
    return max(held)


def run_trial(cfg: Config, warmup: int, steps: int, data_ranks: int,
              stop_above: Optional[float] = None,
              min_steps: int = 2) -> TrialResult:
    """Train ``cfg`` (cut to ``warmup + steps`` iterations by the caller)
    in this job's processes and tear it down; every rank returns the same
    result (rank 0's step times, every rank's peak memory, the first
    rank's error)."""
    start = time.time()
    error, clock, built = None, None, 0
    try:
        runner = Runner.from_cfg(cfg)
        built = device.memory_in_use()
        clock = TrialClock(warmup, stop_above, min_steps, data_ranks)
        runner.register_hook(clock)
        runner.train()
    except Exception:  # noqa: B902 - reported in the table
        error = traceback.format_exc()
    runner = None
    peak = device.peak_memory()['peak']
    mine = dict(error=error, built=built, peak=peak,
                ready=clock.ready_rss if clock else 0,
                times=clock.times if clock else [],
                tokens=clock.tokens if clock else None,
                stopped=bool(clock and clock.stopped_early))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    _teardown()
    first = every[0]
    errors = [f'rank {rank}: {r["error"]}' for rank, r in enumerate(every)
              if r['error']]
    return TrialResult(
        step_times=first['times'], tokens_per_step=first['tokens'],
        peak_rss=[r['peak'] for r in every],
        built_rss=[r['built'] for r in every],
        ready_rss=[r['ready'] for r in every],
        stopped_early=first['stopped'],
        error=errors[0] if errors else None, wall_s=time.time() - start)


def job_trial_runner(result: SearchResult, log_dir: str) -> TrialRunner:
    """Trials of ``result``'s rows in this job, each logging under
    ``log_dir/trial<i>``."""
    count = itertools.count()

    def run(row: Row, steps: int, stop_above: Optional[float]
            ) -> TrialResult:
        index = next(count)
        work_dir = osp.join(log_dir, f'trial{index}')
        trial = trial_config(row.config, result.warmup_steps + steps,
                             work_dir)
        trial.launcher = row.config.launcher
        # MMEngine keeps its logger, message hub and visualizer per
        # experiment name: a trial must not find the last one's.
        trial.experiment_name = f'layout_search_trial{index}'
        return run_trial(trial, result.warmup_steps, steps,
                         row.candidate.data_ranks, stop_above=stop_above)

    return run


def search_in_job(cfg: Config, args, config_path: str) -> SearchResult:
    """The search of ``tools/train.py --search`` (module doc); ``args``
    holds the search flags (:mod:`.search_args`). Rank 0 prints progress
    on stderr, the table on stdout, and writes ``search.json`` and the
    winner's config under ``--out``.

    Raises:
        ValueError: ``--search`` without a launcher.
        SystemExit: 3 when nothing fits ``--memory-budget``, 2 when nothing
            is legal or every trial failed (after the table is written).
    """
    if cfg.launcher in (None, 'none'):
        raise ValueError(
            '--search needs a launched job (--launcher pytorch, slurm or '
            'mpi; e.g. bash tools/dist_train.sh CONFIG N --search), got '
            f'--launcher {cfg.launcher!r}')
    start = time.time()
    world_size = launch_env(cfg.launcher).world_size
    lead = launch_env(cfg.launcher).rank == 0
    say = stderr_progress if lead else (lambda message: None)
    modes = [None if m == 'none' else m for m in args.checkpointing]
    planned = None
    if lead:
        say(f'planning the layouts of {world_size} ranks ...')
        planned = plan_candidates(
            cfg, world_size, schedules=args.schedules or DEFAULT_SCHEDULES,
            microbatches=args.microbatches, checkpointing=modes,
            prune_checkpointing=False, baseline=0)
    start_job(cfg)
    rows, batch = _from_rank0(planned)
    stem = osp.splitext(osp.basename(config_path))[0]
    out_dir = args.out or osp.join('work_dirs', f'{stem}_search')
    log_dir = osp.join(out_dir, 'trials')
    device.release_memory()
    device.reset_peak_memory()
    baseline = measure_baseline(cfg, osp.join(log_dir, 'baseline'))
    say(f'a rank holds {baseline / 2**20:,.0f} MiB besides its model '
        f'(measured in this job, {_where()})')
    add_baseline(rows, baseline)
    apply_budget(rows, args.memory_budget)
    result = SearchResult(world_size, batch, rows, args.memory_budget,
                          args.trial_steps, args.warmup_steps)
    todo = sorted((r for r in rows if not r.status), key=prior)
    _say_counts(say, rows, todo, args, batch)
    measure_rows(todo, result, job_trial_runner(result, log_dir),
                 early_stop=args.early_stop or None, confirm=args.confirm,
                 confirm_rounds=args.confirm_rounds, say=say, start=start)
    result.rows = ranked(rows, result)
    result.elapsed_s = time.time() - start
    status = _report(result, config_path, out_dir, args, lead)
    if status:
        raise SystemExit(status)
    return result


def _where() -> str:
    kind = device.device_type()
    name = device.device_name() if kind != device.CPU else None
    return f'{kind}{f" ({name})" if name else ""}, backend ' \
        f'{dist.get_backend()}, {dist.get_world_size()} ranks'


def _say_counts(say, rows: List[Row], todo: List[Row], args,
                batch: int) -> None:
    counts = {s: sum(r.status == s for r in rows)
              for s in (REFUSED, OVER_BUDGET, SKIPPED)}
    say(f'{len(rows)} candidates: {counts[REFUSED]} refused, '
        f'{counts[OVER_BUDGET]} over the budget, {counts[SKIPPED]} skipped '
        f'(checkpointing more than needed), {len(todo)} to run for '
        f'{args.warmup_steps} + {args.trial_steps} steps (global batch '
        f'{batch})')


def _report(result: SearchResult, config_path: str, out_dir: str, args,
            lead: bool) -> int:
    """Rank 0 prints the table and writes the files; every rank returns
    the same exit status (0: a winner)."""
    message = nothing_fits(result)
    status = 0
    if message is not None:
        status = NOTHING_FITS if any(r.status == OVER_BUDGET
                                     for r in result.rows) else NOTHING_RUNS
    elif result.best is None:
        status = NOTHING_RUNS
    if lead:
        minutes, seconds = divmod(int(result.elapsed_s), 60)
        print(f'layout search for {config_path} at {result.world_size} '
              f'ranks ({minutes}m{seconds:02d}s, in the launched job)')
        print(format_search(result))
        path = write_search(result, config_path, out_dir, args.cfg_options,
                            exit_status=status)
        if message is not None:
            print(f'\n{message}')
        elif path is None:
            print('\nevery candidate failed; no config written')
        else:
            print(f'\nbest: {result.best.candidate.label}; wrote {path}')
            print(f'train it: bash tools/dist_train.sh {path} '
                  f'{result.world_size}', flush=True)
    dist.barrier()  # the files exist before any rank goes on
    return status


def winner_config(result: SearchResult, cfg: Config) -> Config:
    """The config the job trains after the search: the winner's layout on
    ``cfg`` (the user's config with the command line applied)."""
    # The user's file name: MMEngine dumps the config it trains under it.
    best = Config(result.best.config.to_dict(), filename=cfg.filename)
    for key in ('launcher', 'work_dir', 'resume', 'load_from'):
        if key in cfg:
            best[key] = cfg[key]
    return best


def search_then_config(cfg: Config, args) -> Optional[Config]:
    """``tools/train.py --search``: search in this job, then the config to
    train (the winner's), or None with ``--search-only``.

    Raises:
        ValueError: a search flag's bad value, named.
    """
    from mmpar.analysis.search_args import search_argument_error
    error = search_argument_error(args)
    if error is not None:
        raise ValueError(error)
    result = search_in_job(cfg, args, args.config)
    if args.search_only:
        return None
    if dist.get_rank() == 0:
        print(f'training with the searched layout '
              f'{result.best.candidate.label}', flush=True)
    return winner_config(result, cfg)
