"""Measuring the candidates that fit (steps 5-7 of docs/layout_search.md).

On a shared machine one trial's speed follows the load of its moment as
much as the layout: the benchmark's sweep measured one layout at a median
0.475 s/step in one trial and 0.185 s/step in the next, the search itself
0.166 then 0.24 s/step (docs/benchmarks.md). Load from other processes only
ever slows a trial down. So:

1. **First pass**: each candidate once, likely-fast layouts first; one
   whose first timed steps are all slower than ``early_stop`` times the
   best median so far stops after 2 of them.
2. **Confirm**: the ``confirm`` fastest candidates within
   :data:`CONFIRM_WITHIN` of the best (by the median step of a trial run to
   the end; by the fastest step of one stopped early, since a burst of load
   may be what stopped it) run up to ``confirm_rounds`` more trials,
   interleaved (each round in the reverse order of the one before), without
   the early stop; after the first round only those within 5 % of the
   leader go on.
3. **Speed**: a candidate's speed is that of its least disturbed trial, the
   smallest median step over the trials it ran to the end: one disturbed
   trial, first pass or confirm, does not decide.

With ``sweep=R`` instead, every candidate runs R trials, interleaved (each
round starts further down the list), without early stop or confirm rounds,
and is ranked by the same rule: the exhaustive sweep that
``benchmarks/bench_layout_search.py`` measures the search against.

The trials are run through a :data:`TrialRunner`, a function of (row, timed
steps, stop above) returning a :class:`~mmpar.analysis.search_table.
TrialResult`: :mod:`.job_search` hands one that trains in the launched
job's processes; tests hand one with made-up times.
"""
import math
import time
from typing import Callable, List, Optional

from mmpar.analysis.search_table import (FAILED, MEASURED, STATUSES,
                                         STOPPED, Row, SearchResult,
                                         TrialResult, mib)
from mmpar.parallel.dims import AXES

# (row, timed steps, stop once the steps are all slower than this many
# seconds or None) -> the trial's measurements.
TrialRunner = Callable[[Row, int, Optional[float]], TrialResult]
# Confirm candidates within 1.5x of the best (wider than the early stop's
# 1.3x, so that one stopped by a burst of load just over the bar gets
# another look), in 2 more rounds by default.
CONFIRM_WITHIN = 1.5
CONFIRM_ROUNDS = 2
# After the first confirm round, only candidates whose fastest trial is
# within 5 % of the leader's run again (the pick is to be within 5 % of the
# fastest): another look at a clearly slower one costs a trial (a few
# seconds of start-up each) and changes nothing.
CONFIRM_MARGIN = 1.05


def prior(row: Row) -> tuple:
    """Sort key: likely-fast layouts first, so the early stop has a bar to
    use: the config as written, then fewer model-parallel ranks, fewer
    micro-batches."""
    axes = row.candidate.axes
    split = math.prod(axes[a] for a in AXES if not a.startswith('dp'))
    return (not row.as_written, split, row.candidate.num_microbatches or 0)


def measure_rows(todo: List[Row], result: SearchResult, run: TrialRunner, *,
                 early_stop: Optional[float], confirm: int,
                 confirm_rounds: int = CONFIRM_ROUNDS, sweep: int = 0,
                 say: Callable[[str], None], start: float) -> None:
    """Run ``todo`` (in that order), then confirm the close ones, or, with
    ``sweep``, run every row that many times (module doc); sets each row's
    status, passes and trial, and ``result.tokens_per_sample``."""
    if sweep:
        for round_index in range(sweep):
            shift = round_index * len(todo) // sweep
            for index, row in enumerate(todo[shift:] + todo[:shift]):
                _trial(f'[sweep {round_index + 1}.{index + 1} '
                       f'{clock(start)}]', row, result, run, None, say)
        return
    for index, row in enumerate(todo):
        best = min((r.step_time for r in todo[:index]
                    if r.status == MEASURED), default=None)
        stop_above = early_stop * best if early_stop and best else None
        _trial(f'[{index + 1}/{len(todo)} {clock(start)}]', row, result,
               run, stop_above, say)
    close = contenders(todo, confirm)
    for round_index in range(confirm_rounds):
        if round_index:
            close = still_close(close)
        if len(close) < 2:
            break
        order = close if round_index % 2 == 0 else close[::-1]
        for index, row in enumerate(order):
            _trial(f'[confirm {round_index + 1}.{index + 1} '
                   f'{clock(start)}]', row, result, run, None, say,
                   medians=True)


def _trial(step: str, row: Row, result: SearchResult, run: TrialRunner,
           stop_above: Optional[float], say: Callable[[str], None],
           medians: bool = False) -> None:
    """One trial of ``row``, taken into it, with its progress lines."""
    say(f'{step} {row.candidate.label} ...')
    _record(row, result, run(row, result.trial_steps, stop_above),
            stop_above)
    extra = ' (medians {})'.format(', '.join(
        f'{t.median:.3f}' for t in row.passes)) if medians else ''
    say(f'{step} {row.candidate.label}: {outcome(row, result)}{extra}')


def contenders(todo: List[Row], confirm: int) -> List[Row]:
    """The rows the confirm round runs again: of those that ran (to the
    end or stopped early), the ``confirm`` fastest by their first-pass
    estimate, if within :data:`CONFIRM_WITHIN` times the best median; none
    when fewer than 2 (nothing to compare)."""
    measured = [r.step_time for r in todo if r.status == MEASURED]
    if not measured or confirm < 2:
        return []
    bar = min(measured) * CONFIRM_WITHIN
    close = sorted((r for r in todo if r.status in (MEASURED, STOPPED)
                    and _estimate(r) <= bar), key=_estimate)[:confirm]
    return close if len(close) > 1 else []


def still_close(rows: List[Row]) -> List[Row]:
    """The rows (in their order) measured within :data:`CONFIRM_MARGIN` of
    the fastest: the others sit out the next confirm round."""
    measured = [r for r in rows if r.status == MEASURED]
    bar = min((r.step_time for r in measured), default=0) * CONFIRM_MARGIN
    return [r for r in measured if r.step_time <= bar]


def _estimate(row: Row) -> float:
    # A stopped trial's fastest step: the burst that stopped it may have
    # slowed its other step only.
    if row.status == STOPPED:
        return min(row.trial.step_times)
    return row.step_time


def _record(row: Row, result: SearchResult, trial: TrialResult,
            stop_above: Optional[float]) -> None:
    """Take ``trial`` into ``row``: the row's trial becomes its fastest
    pass run to the end; a failed or stopped trial only counts when the
    row has no pass yet."""
    result.num_trials += 1
    if trial.tokens_per_step and result.tokens_per_sample is None:
        result.tokens_per_sample = \
            trial.tokens_per_step // result.global_batch
    if trial.error or trial.stopped_early:
        if row.passes:
            return  # the passes it has stand
        row.trial = trial
        row.status = FAILED if trial.error else STOPPED
        row.message = trial.error.strip().splitlines()[-1] if trial.error \
            else (f'stopped after {len(trial.step_times)} steps: slower '
                  f'than {stop_above:.2f} s/step')
        return
    row.passes.append(trial)
    row.trial = min(row.passes, key=lambda t: t.median)
    row.status, row.message = MEASURED, ''


def outcome(row: Row, result: SearchResult) -> str:
    """One progress line's end: what the row's trial measured."""
    if row.status == FAILED:
        return f'failed: {row.message}'
    text = (f'{row.step_time:.3f} s/step, {result.throughput(row):,.0f} '
            f'{result.unit}, peak {mib(row.measured_peak)} per rank '
            f'(predicted {mib(row.predicted_peak)})')
    return text + (f'; {row.message}' if row.status == STOPPED else '')


def ranked(rows: List[Row], result: SearchResult) -> List[Row]:
    """Measured fastest first, then stopped, failed and the rows not run."""
    return sorted(rows, key=lambda row: (STATUSES.index(row.status),
                                         -(result.throughput(row) or 0.0)))


def clock(start: float) -> str:
    minutes, seconds = divmod(int(time.time() - start), 60)
    return f'{minutes}m{seconds:02d}s'
