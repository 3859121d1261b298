"""Measuring the candidates that fit (steps 5-7 of :mod:`.search`).

The trials are run through a :data:`TrialRunner`, a function of (row, timed
steps, stop above) returning a :class:`~mmpar.analysis.trial.TrialResult`:
:func:`~mmpar.analysis.search.search_layouts` hands one that trains on N
fresh local ranks; tests hand one with made-up times.
"""
import time
from typing import Callable, List, Optional

from mmpar.analysis.search_table import (FAILED, MEASURED, OVER_BUDGET,
                                         REFUSED, SKIPPED, STOPPED, Row,
                                         SearchResult)
from mmpar.analysis.trial import TrialResult
from mmpar.parallel.dims import AXES

# (row, timed steps, stop once the steps are all slower than this many
# seconds or None) -> the trial's measurements.
TrialRunner = Callable[[Row, int, Optional[float]], TrialResult]


def prior(row: Row) -> tuple:
    """Sort key: likely-fast layouts first, so the early stop has a bar to
    use: the config as written, then fewer model-parallel ranks, fewer
    micro-batches."""
    axes = row.candidate.axes
    split = 1
    for axis in AXES:
        if not axis.startswith('dp'):
            split *= axes[axis]
    return (not row.as_written, split, row.candidate.num_microbatches or 0)


def measure_rows(todo: List[Row], result: SearchResult, run: TrialRunner, *,
                 early_stop: Optional[float], confirm: int,
                 say: Callable[[str], None], start: float) -> None:
    """Run ``todo`` (in that order) and confirm the fastest; sets each
    row's status and trial, and ``result.tokens_per_sample``."""
    for index, row in enumerate(todo):
        best = min((r.step_time for r in todo[:index]
                    if r.status == MEASURED), default=None)
        stop_above = early_stop * best if early_stop and best else None
        say(f'[{index + 1}/{len(todo)} {clock(start)}] '
            f'{row.candidate.label} ...')
        _record(row, result, run(row, result.trial_steps, stop_above),
                stop_above)
        say(f'[{index + 1}/{len(todo)} {clock(start)}] '
            f'{row.candidate.label}: {outcome(row, result)}')
    _confirm(todo, result, run, confirm, early_stop, say, start)


def _confirm(todo: List[Row], result: SearchResult, run: TrialRunner,
             confirm: int, early_stop: Optional[float],
             say: Callable[[str], None], start: float) -> None:
    """Run the ``confirm`` fastest candidates (those within ``early_stop``
    of the best) once more, slowest first, and rank them on all their
    timed steps: one pass on a shared machine misorders close layouts."""
    measured = sorted((r for r in todo if r.status == MEASURED),
                      key=lambda r: r.step_time)
    if not measured or confirm < 1:
        return
    bar = measured[0].step_time * (early_stop or float('inf'))
    close = [r for r in measured[:confirm] if r.step_time <= bar]
    if len(close) < 2:
        return
    for index, row in enumerate(reversed(close)):
        first = row.trial
        say(f'[confirm {index + 1}/{len(close)} {clock(start)}] '
            f'{row.candidate.label} ...')
        _record(row, result, run(row, result.trial_steps, None), None)
        if row.status != MEASURED:
            row.trial, row.status, row.message = first, MEASURED, ''
            continue  # keep the first pass
        row.trial.step_times = first.step_times + row.trial.step_times
        row.trial.peak_rss = [max(a, b) for a, b in
                              zip(first.peak_rss, row.trial.peak_rss)]
        say(f'[confirm {index + 1}/{len(close)} {clock(start)}] '
            f'{row.candidate.label}: {outcome(row, result)} (both passes)')


def _record(row: Row, result: SearchResult, trial: TrialResult,
            stop_above: Optional[float]) -> None:
    row.trial = trial
    if trial.error:
        row.status = FAILED
        row.message = trial.error.strip().splitlines()[-1]
        return
    row.status = STOPPED if trial.stopped_early else MEASURED
    if trial.stopped_early:
        row.message = (f'stopped after {len(trial.step_times)} steps: '
                       f'slower than {stop_above:.2f} s/step')
    if trial.tokens_per_step and result.tokens_per_sample is None:
        result.tokens_per_sample = \
            trial.tokens_per_step // result.global_batch


def outcome(row: Row, result: SearchResult) -> str:
    """One progress line's end: what the row's trial measured."""
    if row.status == FAILED:
        return f'failed: {row.message}'
    peak = row.measured_peak / 2**20
    predicted = row.predicted_peak / 2**20
    text = (f'{row.step_time:.3f} s/step, {result.throughput(row):,.0f} '
            f'{result.unit}, peak {peak:,.0f} MiB per rank (predicted '
            f'{predicted:,.0f} MiB)')
    return text + (f'; {row.message}' if row.status == STOPPED else '')


def ranked(rows: List[Row], result: SearchResult) -> List[Row]:
    """Measured fastest first, then stopped, failed and the rows not run."""
    order = [MEASURED, STOPPED, FAILED, SKIPPED, OVER_BUDGET, REFUSED]

    def key(row):
        speed = result.throughput(row) or 0.0
        return (order.index(row.status), -speed)

    return sorted(rows, key=key)


def clock(start: float) -> str:
    minutes, seconds = divmod(int(time.time() - start), 60)
    return f'{minutes}m{seconds:02d}s'
