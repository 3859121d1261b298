"""What the layout search knows about each candidate: one trial's
measurements (:class:`TrialResult`), the candidate's row (:class:`Row`) and
the ranked whole (:class:`SearchResult`)."""
import statistics
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from mmengine.config import Config

from mmpar.analysis.layouts import Candidate
from mmpar.analysis.memory import MemoryEstimate

# Row states, in the order the report lists them.
STATUSES = MEASURED, STOPPED, FAILED, SKIPPED, OVER_BUDGET, REFUSED = (
    'measured', 'stopped early', 'failed', 'skipped', 'over budget',
    'refused')


def mib(value: Optional[int]) -> str:
    """Bytes as the search reports them (``-``: unknown)."""
    return '-' if value is None else f'{value / 2**20:,.0f} MiB'


@dataclass
class TrialResult:
    """What one trial measured (:func:`mmpar.analysis.trial.run_trial`).

    Attributes:
        step_times: seconds of each timed step (slowest rank).
        tokens_per_step: tokens the whole job consumed per step (None for
            batches without a token tensor ``inputs``).
        peak_rss: each rank's peak memory, bytes
            (:func:`mmpar.device.peak_memory`: peak reserved device memory
            on an accelerator, peak resident memory on the CPU).
        stopped_early: the trial ended early (``stop_above``).
        error: the first failing rank's error, or None.
    """
    step_times: List[float] = field(default_factory=list)
    tokens_per_step: Optional[int] = None
    peak_rss: List[int] = field(default_factory=list)
    stopped_early: bool = False
    error: Optional[str] = None

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)


@dataclass
class Row:
    """One candidate and what the search learnt about it.

    Attributes:
        candidate: the layout.
        status: one of ``measured``, ``stopped early``, ``failed``,
            ``skipped``, ``over budget``, ``refused``.
        message: why it was refused, skipped or failed.
        predicted: ``(rank, predicted peak bytes)`` of each planned rank
            (one per pipeline stage).
        estimate: the plan's memory terms for the rank with the highest
            predicted peak.
        changes: the config keys the layout sets (see
            :func:`~mmpar.analysis.layouts.candidate_config`).
        trial: the measurements, for candidates that ran: the fastest of
            ``passes`` (the smallest median step), else the one trial that
            stopped early or failed.
        passes: every trial of this candidate run to the end (the first
            pass and the confirm rounds').
        as_written: this is the config's own layout.
        config: the full config that trains it (None when refused early).
    """
    candidate: Candidate
    status: str = ''
    message: str = ''
    predicted: List[Tuple[int, int]] = field(default_factory=list)
    estimate: Optional[MemoryEstimate] = None
    changes: dict = field(default_factory=dict)
    trial: Optional[TrialResult] = None
    passes: List[TrialResult] = field(default_factory=list)
    as_written: bool = False
    config: Optional[Config] = field(default=None, repr=False)

    @property
    def predicted_peak(self) -> Optional[int]:
        return max((p for _, p in self.predicted), default=None)

    @property
    def measured_peak(self) -> Optional[int]:
        """The largest rank's peak over every trial (memory does not depend
        on load)."""
        peaks = [p for t in self.passes or [self.trial] if t is not None
                 for p in t.peak_rss]
        return max(peaks, default=None)

    @property
    def step_time(self) -> Optional[float]:
        """Median seconds per timed step (of ``trial``)."""
        if self.trial is None or not self.trial.step_times:
            return None
        return self.trial.median


@dataclass
class SearchResult:
    """Everything the search found (``rows`` ranked: measured
    fastest first, then the rest)."""
    world_size: int
    global_batch: int
    rows: List[Row]
    memory_budget: Optional[float]
    trial_steps: int
    warmup_steps: int
    elapsed_s: float = 0.0
    num_trials: int = 0  # trials run: the first pass and the confirm rounds
    tokens_per_sample: Optional[int] = None
    notes: List[str] = field(default_factory=list)

    @property
    def measured(self) -> List[Row]:
        return [r for r in self.rows if r.status == MEASURED]

    @property
    def best(self) -> Optional[Row]:
        """The fastest candidate measured to the end, or None."""
        measured = self.measured
        return measured[0] if measured else None

    @property
    def as_written(self) -> Optional[Row]:
        return next((r for r in self.rows if r.as_written), None)

    def throughput(self, row: Row) -> Optional[float]:
        """Samples (or tokens, when batches hold tokens) per second."""
        if row.step_time is None:
            return None
        per_step = self.global_batch * (self.tokens_per_sample or 1)
        return per_step / row.step_time

    @property
    def unit(self) -> str:
        return 'tokens/s' if self.tokens_per_sample else 'samples/s'

    def versus(self, row: Row) -> List[Optional[float]]:
        """``row``'s throughput over the best's and over the config as
        written's (None where either is unknown or 0)."""
        speed = self.throughput(row)
        references = [other and self.throughput(other)
                      for other in (self.best, self.as_written)]
        return [speed / reference if speed is not None and reference
                else None for reference in references]

    def table(self) -> List[dict]:
        """The rows as plain data (one dict per candidate) for scripts."""
        rows = []
        for row in self.rows:
            vs_best, vs_written = self.versus(row)
            rows.append(dict(
                layout=row.candidate.label, status=row.status,
                message=row.message, as_written=row.as_written,
                predicted_peak=row.predicted_peak,
                measured_peak=row.measured_peak,
                measured_peaks=list(row.trial.peak_rss) if row.trial
                else [],
                step_time=row.step_time,
                trial_medians=[t.median for t in row.passes],
                trial_peaks=[max(t.peak_rss) for t in row.passes],
                throughput=self.throughput(row), unit=self.unit,
                vs_best=vs_best, vs_written=vs_written,
                changes=row.changes))
        return rows
