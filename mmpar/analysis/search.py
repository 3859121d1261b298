"""The layout search's candidates: every layout of N ranks, checked and
predicted on the fake backend before anything trains.

:func:`plan_candidates` enumerates the layouts of N ranks
(:func:`~mmpar.analysis.layouts.enumerate_candidates`: every axis size,
pipeline schedule and micro-batches, activation checkpointing mode), then

1. asks the Runner's own start-up check (:func:`mmpar.config_check.
   check_config`) and the plan tool (:func:`~mmpar.analysis.plan.make_plan`
   on the fake backend, which also splits the meta model into stages) about
   each: a refused one is dropped with their message;
2. predicts each rank's peak memory with the plan (every pipeline stage's
   rank planned); :func:`apply_budget` drops candidates over
   ``memory_budget``;
3. of the layouts that differ only in activation checkpointing, keeps the
   one with the least recomputation that fits (recomputing never makes a
   step faster: the others are listed as skipped).

The search that measures the rest runs inside the launched job
(:mod:`.job_search`; ``tools/train.py --search`` and its local front
``tools/plan.py --search``), its rounds in :mod:`.search_rounds`, its table
and written config in :mod:`.search_report`.
"""
import math
from typing import List, Optional, Sequence, Tuple

from mmengine.config import Config

from mmpar.analysis.layouts import (CHECKPOINTING_MODES, DEFAULT_SCHEDULES,
                                    Candidate, block_classes,
                                    candidate_config, enumerate_candidates,
                                    wrapper_replicates, written_candidate)
from mmpar.analysis.memory import GiB, within_budget
from mmpar.analysis.plan import PlanError, build_model, make_plan
from mmpar.analysis.search_table import (FAILED, MEASURED, OVER_BUDGET,
                                         REFUSED, SKIPPED, STOPPED, Row,
                                         SearchResult)
from mmpar.failures import ConfigError
from mmpar.parallel.dims import AXES, ParallelismError

__all__ = ['FAILED', 'MEASURED', 'OVER_BUDGET', 'REFUSED', 'SKIPPED',
           'STOPPED', 'Row', 'SearchResult', 'apply_budget',
           'plan_candidates']


def stage_ranks(candidate: Candidate) -> List[int]:
    """One rank per pipeline stage (the others hold the same share)."""
    axes = candidate.axes
    stride = math.prod(axes[axis] for axis in AXES[AXES.index('pp') + 1:])
    return [stage * stride for stage in range(axes['pp'])]


def plan_candidates(cfg: Config, world_size: int, *,
                    schedules: Sequence[str] = DEFAULT_SCHEDULES,
                    microbatches: Optional[Sequence[int]] = None,
                    checkpointing: Sequence[Optional[str]] =
                    CHECKPOINTING_MODES) -> Tuple[List[Row], int]:
    """Steps 1-2 of the search, on the fake backend (nothing trains): the
    predictions count no baseline (:func:`add_baseline` adds the one the
    job measures), no budget is applied yet (:func:`apply_budget`).

    Returns:
        ``(rows, global batch)``: every candidate with its status (empty
        for those to run, ``refused`` with the validator's message) and
        predictions; the config's own layout first.
    """
    model = build_model(cfg)
    blocks = block_classes(model)
    tp_plan = (cfg.get('parallel') or {}).get('tp_plan')
    if tp_plan is None:
        tp_plan = getattr(model, 'default_tp_plan', None)
    try:
        written = written_candidate(cfg, world_size)
    except (ConfigError, ParallelismError, ValueError):
        written = None
    batch = cfg.train_dataloader.batch_size * (
        world_size if written is None else written.data_ranks)
    candidates = enumerate_candidates(
        cfg, world_size, replicating=wrapper_replicates(cfg),
        schedules=schedules, microbatches=microbatches,
        checkpointing=checkpointing)
    if written is not None:
        candidates = [written] + [c for c in candidates if c != written]
    return [_check(Row(candidate, as_written=candidate == written), cfg,
                   world_size, batch, tp_plan, blocks)
            for candidate in candidates], batch


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
           blocks) -> Row:
    """``row`` refused with the validator's message, or predicted."""
    from mmpar.config_check import check_config
    try:
        row.config, row.changes = candidate_config(
            cfg, row.candidate, batch, tp_plan, blocks)
        check_config(row.config, world_size)
        plans = [make_plan(row.config, world_size, rank, baseline=0)
                 for rank in stage_ranks(row.candidate)]
    except (ConfigError, PlanError, ParallelismError, ValueError,
            TypeError) as err:
        row.status, row.message = REFUSED, str(err)
        return row
    row.predicted = [(p.rank, p.estimate.peak) for p in plans]
    row.estimate = max(plans, key=lambda p: p.estimate.peak).estimate
    return row


def _prune_checkpointing(rows: List[Row]) -> None:
    """Of the fitting candidates of one layout, keep the one with the least
    recomputation (and the config's own)."""
    # Heaviest first: the lightest of a layout is the last one kept.
    lightest = {row.candidate.layout: row for row in sorted(
        (r for r in rows if not r.status), reverse=True,
        key=lambda r: CHECKPOINTING_MODES.index(r.candidate.checkpointing))}
    for row in rows:
        kept = lightest.get(row.candidate.layout)
        if row.status or row is kept or row.as_written:
            continue
        row.status = SKIPPED
        mode = kept.candidate.checkpointing or 'no checkpointing'
        row.message = (f'{mode} fits the budget and recomputes less: '
                       'checkpointing more never makes a step faster')
