"""Find the fastest layout that fits: the candidates, their plan and the
spawning search.

``tools/train.py --search`` (and its local front ``tools/plan.py
--search``) runs the search inside the launched job (:mod:`.job_search`),
with this module's candidates (:func:`plan_candidates`, :func:`apply_budget`)
and :mod:`.search_rounds`. :func:`search_layouts`, which spawns N fresh
local CPU ranks per trial, remains for ``benchmarks/bench_layout_search.py``.

:func:`search_layouts` enumerates the layouts of N ranks
(:func:`~mmpar.analysis.layouts.enumerate_candidates`: every axis size,
pipeline schedule and micro-batches, activation checkpointing mode), then

1. asks the Runner's own start-up check (:func:`mmpar.config_check.
   check_config`) and the plan tool (:func:`~mmpar.analysis.plan.make_plan`
   on the fake backend, which also splits the meta model into stages) about
   each: a refused one is dropped with their message;
2. predicts each rank's peak memory with the plan (every pipeline stage's
   rank planned) and drops candidates over ``memory_budget``;
3. of the layouts that differ only in activation checkpointing, runs the
   one with the least recomputation that fits (recomputing never makes a
   step faster: the others are listed as skipped);
4. trains each survivor for ``warmup_steps + trial_steps`` iterations on N
   fresh local processes (:func:`~mmpar.analysis.trial.run_trial`), the
   config as written first, with the same data and global batch for all,
   stopping a trial early once its steps are all slower than
   ``early_stop`` times the best candidate's so far;
5. runs the (up to 3) fastest within 1.5x of the best (stopped early or
   not) up to 2 more times, interleaved, and ranks the measured candidates
   by their least disturbed trial (:mod:`.search_rounds`: why).

The table and the written config are :mod:`.search_report`'s.
"""
import itertools
import os
import sys
import tempfile
import time
from typing import Callable, List, Optional, Sequence, Tuple

from mmengine.config import Config

from mmpar.analysis.layouts import (CHECKPOINTING_MODES, DEFAULT_SCHEDULES,
                                    Candidate, block_classes,
                                    candidate_config, enumerate_candidates,
                                    global_batch, wrapper_replicates,
                                    written_candidate)
from mmpar.analysis.memory import GiB, within_budget
from mmpar.analysis.plan import PlanError, build_model, make_plan
from mmpar.analysis.search_rounds import (CONFIRM_ROUNDS, CONFIRM_WITHIN,
                                          TrialRunner, measure_rows, prior,
                                          ranked)
from mmpar.analysis.search_table import (FAILED, MEASURED, OVER_BUDGET,
                                         REFUSED, SKIPPED, STOPPED, Row,
                                         SearchResult)
from mmpar.analysis.trial import TrialResult, measure_baseline, run_trial
from mmpar.failures import ConfigError
from mmpar.parallel.dims import AXES, ParallelismError

__all__ = ['FAILED', 'MEASURED', 'OVER_BUDGET', 'REFUSED', 'SKIPPED',
           'STOPPED', 'Row', 'SearchResult', 'plan_candidates',
           'search_layouts', 'trial_config']

def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def trial_config(cfg: Config, iterations: int, work_dir: str) -> Config:
    """``cfg`` cut to ``iterations`` training iterations on N launched
    ranks: no validation, no checkpoints, logs in ``work_dir``, a fixed
    seed when the config has none."""
    trial = Config(cfg.to_dict())
    trial.launcher = 'pytorch'
    trial.work_dir = work_dir
    trial.train_cfg = dict(by_epoch=False, max_iters=iterations)
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator',
                'test_dataloader', 'test_cfg', 'test_evaluator'):
        trial[key] = None
    hooks = dict(trial.get('default_hooks') or {})
    hooks['checkpoint'] = None
    trial.default_hooks = hooks
    trial.log_level = 'WARNING'
    # The same data for every candidate: a config without a seed would get
    # a random one (and another data order) per trial.
    randomness = dict(trial.get('randomness') or {})
    if randomness.get('seed') is None:
        randomness['seed'] = 0
    trial.randomness = randomness
    return trial


def stage_ranks(candidate: Candidate) -> List[int]:
    """One rank per pipeline stage (the others hold the same share)."""
    axes = candidate.axes
    stride = 1
    for axis in reversed(AXES):
        if axis == 'pp':
            break
        stride *= axes[axis]
    return [stage * stride for stage in range(axes['pp'])]


def _default_tp_plan(cfg: Config, model) -> Optional[object]:
    plan = (cfg.get('parallel') or {}).get('tp_plan')
    return plan if plan is not None else getattr(model, 'default_tp_plan',
                                                 None)


def plan_candidates(cfg: Config, world_size: int, *,
                    memory_budget: Optional[float] = None,
                    schedules: Sequence[str] = DEFAULT_SCHEDULES,
                    microbatches: Optional[Sequence[int]] = None,
                    checkpointing: Sequence[Optional[str]] =
                    CHECKPOINTING_MODES,
                    prune_checkpointing: bool = True,
                    baseline: Optional[int] = None
                    ) -> Tuple[List[Row], int]:
    """Steps 1-3 of the search, on the fake backend (nothing trains).

    Returns:
        ``(rows, global batch)``: every candidate with its status (empty
        for those to run) and predictions; the config's own layout first.
    """
    model = build_model(cfg)
    blocks = block_classes(model)
    tp_plan = _default_tp_plan(cfg, model)
    try:
        written = written_candidate(cfg, world_size)
        batch = global_batch(cfg, world_size)
    except (ConfigError, ParallelismError, ValueError):
        written = None
        batch = cfg.train_dataloader.batch_size * world_size
    candidates = enumerate_candidates(
        cfg, world_size, replicating=wrapper_replicates(cfg),
        schedules=schedules, microbatches=microbatches,
        checkpointing=checkpointing)
    if written is not None:
        candidates = [written] + [c for c in candidates if c != written]
    rows = []
    for candidate in candidates:
        row = Row(candidate, as_written=candidate == written)
        _check(row, cfg, world_size, batch, tp_plan, blocks, baseline)
        rows.append(row)
    apply_budget(rows, memory_budget, prune_checkpointing)
    return rows, batch


def add_baseline(rows: List[Row], baseline: int) -> None:
    """Add ``baseline`` bytes (measured in the job once the rows were
    planned with none) to every row's predicted peaks."""
    for row in rows:
        row.predicted = [(rank, peak + baseline)
                         for rank, peak in row.predicted]
        if row.estimate is not None:
            row.estimate.baseline += baseline


def apply_budget(rows: List[Row], memory_budget: Optional[float],
                 prune_checkpointing: bool = True) -> None:
    """Step 2-3 of the search: rows predicted over ``memory_budget`` GiB
    become ``over budget``; then, with ``prune_checkpointing``, only the
    lightest fitting checkpointing mode of a layout stays to run."""
    for row in rows:
        if not row.status and \
                not within_budget(row.predicted_peak, memory_budget):
            row.status = OVER_BUDGET
            row.message = (f'predicted peak {row.predicted_peak / GiB:.2f} '
                           f'GiB > --memory-budget {memory_budget:g} GiB')
    if prune_checkpointing:
        _prune_checkpointing(rows)


def _check(row: Row, cfg: Config, world_size: int, batch: int, tp_plan,
           blocks, baseline: Optional[int]) -> None:
    from mmpar.config_check import check_config
    try:
        row.config, row.changes = candidate_config(
            cfg, row.candidate, batch, tp_plan, blocks)
        check_config(row.config, world_size)
        plans = [make_plan(row.config, world_size, rank, baseline=baseline)
                 for rank in stage_ranks(row.candidate)]
    except (ConfigError, PlanError, ParallelismError, ValueError,
            TypeError) as err:
        row.status, row.message = REFUSED, str(err)
        return
    row.predicted = [(p.rank, p.estimate.peak) for p in plans]
    row.estimate = max(plans, key=lambda p: p.estimate.peak).estimate


def _prune_checkpointing(rows: List[Row]) -> None:
    """Of the fitting candidates of one layout, keep the one with the least
    recomputation (and the config's own)."""
    order = {mode: i for i, mode in enumerate(CHECKPOINTING_MODES)}
    lightest = {}
    for row in rows:
        if row.status:
            continue
        layout = row.candidate.layout
        kept = lightest.get(layout)
        if kept is None or order[row.candidate.checkpointing] < \
                order[kept.candidate.checkpointing]:
            lightest[layout] = row
    for row in rows:
        kept = lightest.get(row.candidate.layout)
        if row.status or row is kept or row.as_written:
            continue
        row.status = SKIPPED
        mode = kept.candidate.checkpointing or 'no checkpointing'
        row.message = (f'{mode} fits the budget and recomputes less: '
                       'checkpointing more never makes a step faster')


def search_layouts(cfg: Config, world_size: int, *,
                   memory_budget: Optional[float] = None,
                   trial_steps: int = 5,
                   warmup_steps: int = 2,
                   early_stop: Optional[float] = 1.3,
                   schedules: Sequence[str] = DEFAULT_SCHEDULES,
                   microbatches: Optional[Sequence[int]] = None,
                   checkpointing: Sequence[Optional[str]] =
                   CHECKPOINTING_MODES,
                   prune_checkpointing: bool = True,
                   confirm: int = 3,
                   confirm_within: float = CONFIRM_WITHIN,
                   confirm_rounds: int = CONFIRM_ROUNDS,
                   progress: Optional[Callable[[str], None]] =
                   stderr_progress,
                   log_dir: Optional[str] = None,
                   baseline: Optional[int] = None) -> SearchResult:
    """Measure the layouts of ``world_size`` ranks that fit and rank them.

    Args:
        cfg: a training config (not changed).
        world_size: ranks to lay the model out over (spawned locally).
        memory_budget: GiB per rank; candidates whose predicted peak
            exceeds it are not run.
        trial_steps: timed iterations per candidate.
        warmup_steps: untimed iterations before them.
        early_stop: stop a candidate once its first timed steps are all
            slower than this times the best median so far (None: never).
        schedules: pipeline schedules to try.
        microbatches: micro-batch counts to try (None: pp and 2 pp).
        checkpointing: activation checkpointing modes to try (None: off,
            ``'selective'``, ``'full'``).
        prune_checkpointing: run only the lightest fitting checkpointing
            mode of each layout (False: run them all).
        confirm: run this many of the fastest candidates (within
            ``confirm_within`` of the best, those stopped early included)
            ``confirm_rounds`` more times, interleaved; a candidate's speed
            is its fastest trial's (0 or 1: one pass).
        confirm_within: the factor over the best median within which a
            candidate is confirmed.
        confirm_rounds: at most this many more trials per confirmed
            candidate; after the first round only those within 5 % of the
            fastest run again.
        progress: called with one line per event; None for silence.
        log_dir: keep each trial's rank logs under it (else a temporary
            directory, removed).
        baseline: bytes a rank holds besides its model, for the memory
            predictions (None: measured on ``world_size`` fresh ranks).

    Returns:
        The ranked table; ``result.best`` is the fastest layout measured,
        None when nothing fits or every trial failed.
    """
    _check_arguments(world_size=world_size, trial_steps=trial_steps,
                     warmup_steps=warmup_steps, memory_budget=memory_budget,
                     early_stop=early_stop, confirm=confirm,
                     confirm_within=confirm_within,
                     confirm_rounds=confirm_rounds)
    start = time.time()
    say = progress or (lambda message: None)
    say(f'planning the layouts of {world_size} ranks ...')
    how = 'given'
    if baseline is None:
        baseline = measure_baseline(cfg, world_size)
        how = f'measured on {world_size} fresh ranks'
    say(f'a rank holds {baseline / 2**20:,.0f} MiB besides its model '
        f'({how})')
    rows, batch = plan_candidates(
        cfg, world_size, memory_budget=memory_budget, schedules=schedules,
        microbatches=microbatches, checkpointing=checkpointing,
        prune_checkpointing=prune_checkpointing, baseline=baseline)
    result = SearchResult(world_size, batch, rows, memory_budget,
                          trial_steps, warmup_steps)
    todo = sorted((r for r in rows if not r.status), key=prior)
    counts = {s: sum(r.status == s for r in rows)
              for s in (REFUSED, OVER_BUDGET, SKIPPED)}
    say(f'{len(rows)} candidates: {counts[REFUSED]} refused, '
        f'{counts[OVER_BUDGET]} over the budget, {counts[SKIPPED]} skipped '
        f'(checkpointing more than needed), {len(todo)} to run for '
        f'{warmup_steps} + {trial_steps} steps (global batch {batch})')
    owned = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix='mmpar_search_')
    try:
        measure_rows(todo, result, trial_runner(result, world_size, log_dir),
                     early_stop=early_stop, confirm=confirm,
                     confirm_within=confirm_within,
                     confirm_rounds=confirm_rounds, say=say, start=start)
    finally:
        if owned:
            import shutil
            shutil.rmtree(log_dir, ignore_errors=True)
    result.rows = ranked(rows, result)
    result.elapsed_s = time.time() - start
    return result


def _check_arguments(**values) -> None:
    """The search's arguments, each named when refused (ValueError)."""
    rules = dict(
        world_size=(lambda v: isinstance(v, int) and v >= 1, 'an int >= 1'),
        trial_steps=(lambda v: isinstance(v, int) and v >= 1, 'an int >= 1'),
        warmup_steps=(lambda v: isinstance(v, int) and v >= 1,
                      'an int >= 1'),
        memory_budget=(lambda v: v is None or v > 0, 'None or GiB > 0'),
        early_stop=(lambda v: v is None or v > 1, 'None or a factor > 1'),
        confirm=(lambda v: isinstance(v, int) and v >= 0, 'an int >= 0'),
        confirm_within=(lambda v: v >= 1, 'a factor >= 1'),
        confirm_rounds=(lambda v: isinstance(v, int) and v >= 0,
                        'an int >= 0'))
    for key, value in values.items():
        ok, allowed = rules[key]
        if not ok(value):
            raise ValueError(f'search_layouts: {key}={value!r} is not '
                             f'allowed; allowed: {allowed}')


def trial_runner(result: SearchResult, world_size: int,
                 log_dir: str) -> TrialRunner:
    """Trials of ``result``'s rows on ``world_size`` fresh local ranks, each
    logging under its own folder of ``log_dir``."""
    count = itertools.count()

    def run(row: Row, steps: int, stop_above: Optional[float]
            ) -> TrialResult:
        work_dir = os.path.join(log_dir, f'trial{next(count)}')
        trial = trial_config(row.config, result.warmup_steps + steps,
                             work_dir)
        return run_trial(trial, world_size, result.warmup_steps, steps,
                         row.candidate.data_ranks, stop_above=stop_above,
                         log_dir=work_dir)

    return run
