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
   with a one-parameter model and one batch: :func:`~mmpar.analysis.trial.
   measure_baseline`) and added to the predictions; the memory budget
   filters;
4. each candidate is built, trained and torn down inside these processes
   (:mod:`.trial`; memory: each rank's peak device memory, or its peak RSS
   on the CPU), in the rounds of :mod:`.search_rounds` (``--sweep R``:
   every candidate R times, the sweep the search is benchmarked against);
5. rank 0 writes the table and the winning config (:mod:`.search_report`),
   and every rank returns the winner's config to train (unless
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
import sys
import time
from typing import List, Optional

import torch.distributed as dist
from mmengine.config import Config

from mmpar import device
from mmpar.analysis.layouts import DEFAULT_SCHEDULES
from mmpar.analysis.search import add_baseline, apply_budget, plan_candidates
from mmpar.analysis.search_args import default_out, search_argument_error
from mmpar.analysis.search_report import (format_search, nothing_fits,
                                          write_search)
from mmpar.analysis.search_rounds import TrialRunner, measure_rows, prior, \
    ranked
from mmpar.analysis.search_table import (OVER_BUDGET, REFUSED, SKIPPED, Row,
                                         SearchResult, mib)
from mmpar.analysis.trial import (TrialResult, measure_baseline, run_trial,
                                  trial_config)
from mmpar.dist import init_dist, launch_env, usable_backend

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
    say = (lambda message: print(message, file=sys.stderr, flush=True)
           ) if lead else (lambda message: None)
    modes = [None if m == 'none' else m for m in args.checkpointing]
    box = [None]
    if lead:
        say(f'planning the layouts of {world_size} ranks ...')
        box[0] = plan_candidates(
            cfg, world_size, schedules=args.schedules or DEFAULT_SCHEDULES,
            microbatches=args.microbatches, checkpointing=modes)
    start_job(cfg)
    dist.broadcast_object_list(box, src=0)  # rank 0's plan to every rank
    rows, batch = box[0]
    out_dir = args.out or default_out(config_path)
    log_dir = osp.join(out_dir, 'trials')
    device.release_memory()
    baseline = measure_baseline(cfg, osp.join(log_dir, 'baseline'))
    say(f'a rank holds {mib(baseline)} besides its model '
        f'(measured in this job, {_where()})')
    add_baseline(rows, baseline)
    result = measure_candidates(rows, batch, world_size, args,
                                job_trial_runner, log_dir, say, start)
    status = _report(result, config_path, out_dir, args, lead)
    if status:
        raise SystemExit(status)
    return result


def measure_candidates(rows: List[Row], batch: int, world_size: int, args,
                       runner, log_dir: str, say, start: float
                       ) -> SearchResult:
    """The budget's filter on the planned ``rows``, the trials of the rest
    (through ``runner(result, log_dir)``, a :data:`~mmpar.analysis.
    search_rounds.TrialRunner` maker) and the ranked result. A sweep keeps
    every checkpointing mode that fits (the search runs the lightest)."""
    apply_budget(rows, args.memory_budget,
                 prune_checkpointing=not args.sweep)
    result = SearchResult(world_size, batch, rows, args.memory_budget,
                          args.trial_steps, args.warmup_steps)
    todo = sorted((r for r in rows if not r.status), key=prior)
    counts = {s: sum(r.status == s for r in rows)
              for s in (REFUSED, OVER_BUDGET, SKIPPED)}
    times = f' x {args.sweep} (sweep)' if args.sweep else ''
    say(f'{len(rows)} candidates: {counts[REFUSED]} refused, '
        f'{counts[OVER_BUDGET]} over the budget, {counts[SKIPPED]} skipped '
        f'(checkpointing more than needed), {len(todo)} to run{times} for '
        f'{args.warmup_steps} + {args.trial_steps} steps (global batch '
        f'{batch})')
    measure_rows(todo, result, runner(result, log_dir),
                 early_stop=args.early_stop or None, confirm=args.confirm,
                 confirm_rounds=args.confirm_rounds, sweep=args.sweep,
                 say=say, start=start)
    result.rows = ranked(rows, result)
    result.elapsed_s = time.time() - start
    return result


def _where() -> str:
    kind = device.device_type()
    name = device.device_name() if kind != device.CPU else None
    return f'{kind}{f" ({name})" if name else ""}, backend ' \
        f'{dist.get_backend()}, {dist.get_world_size()} ranks'


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
