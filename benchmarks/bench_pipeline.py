"""Pipeline schedules at pp=2 against one process doing the same work.

    PYTHONPATH=$PWD python benchmarks/bench_pipeline.py [--steps N] [--out DIR]
    PYTHONPATH=$PWD python benchmarks/bench_pipeline.py --quick  # smoke run

Trains a stack of residual MLP blocks (:class:`PipeBenchMLP`, compute in a
few large matmuls, so gloo and Python overheads stay small) with AdamW on 2
gloo ranks (1 thread each), for every schedule of ``PIPELINE_SCHEDULES`` at
pp=2 and m = 2, 4, 8 micro-batches, built as training builds it
(``mmpar.parallelize.compose.parallelize``) and stepped with ``train_step``.
The reference, pp=1, is the same model trained by one process (rank 0, the
other rank waiting) on the same global batch with a plain ``train_step``:
the same work. Its steps alternate with the pipelined ones (the order swaps
every step), so load from other jobs hits both alike; warm-up steps are not
timed. Per row:

* *pp=2 step* / *pp=1 step*: medians, the pp=2 step as slow as its slower
  rank;
* *ratio*: the median of the step-paired ratios pp=2 / pp=1;
* *measured idle*: ``1 - T_pp1 / (p * T_pp)`` = ``1 - 1 / (p * ratio)``,
  the share of the p ranks' time not spent doing the one-process work:
  bubble, communication, the smaller micro-batches' lower efficiency and
  any other overhead (0 is a perfect p-fold speed-up);
* *stage idle*: measured directly (``benchmarks/_stage_clock.py``): the
  share of the pipeline's span (the longest schedule step of any rank) a
  rank does not spend computing in its stages (bubble + waiting on sends
  and receives), mean over ranks;
* *theory*: the schedule's textbook bubble
  (:func:`mmpar.parallelize.pipeline.schedules.theoretical_bubble`):
  ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/(v*m+p-1)`` with ``v``
  stages per rank, an upper bound for the zero-bubble schedules.

``--out DIR`` also rewrites the ``## Pipeline schedules`` section of
``DIR/benchmarks.md``; ``benchmarks/run.py`` does that for the report.
"""
import argparse
import os
import sys
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmpar.optim import OptimWrapper
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (measure_on_ranks,  # noqa: E402
                                median, run_conditions, slowest_rank,
                                time_steps, write_section)
from benchmarks._stage_clock import StageClock  # noqa: E402

SECTION = '## Pipeline schedules'
WORLD_SIZE = 2  # = pp: every rank is one pipeline stage group member
MODEL = dict(in_dim=64, dim=256, hidden_dim=1024, depth=8, out_dim=16)
QUICK_MODEL = dict(in_dim=8, dim=32, hidden_dim=64, depth=4, out_dim=4)
# Schedule name -> stages per rank (the V schedules need exactly 2).
SCHEDULES = {
    'GPipe': 1,
    '1F1B': 1,
    'Interleaved1F1B': 2,
    'LoopedBFS': 2,
    'InterleavedZeroBubble': 2,
    'ZBVZeroBubble': 2,
    'DualPipeV': 2,
}
MICROBATCHES = (2, 4, 8)
# Schedules torch refuses below one micro-batch per stage (torch 2.13:
# "DualPipeV requires at least as many microbatches as stages").
NEEDS_MICROBATCH_PER_STAGE = ('DualPipeV', )
# A load average (1 min, before the run) from which the report calls its
# numbers noisy: other jobs were running.
LOADED = 1.0


class _Block(nn.Module):
    """Pre-norm residual MLP: a transformer block's feed-forward half."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class PipeBenchMLP(BaseModel):
    """``depth`` residual MLP blocks between a small input projection and a
    small head, meeting mmpar's pipeline protocol: nearly all compute is in
    the blocks, so an even split balances the stages."""
    pipeline_layers = 'blocks'
    pipeline_pre = ('embed', )
    pipeline_post = ('norm', 'head')

    def __init__(self, in_dim: int, dim: int, hidden_dim: int, depth: int,
                 out_dim: int):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(
            _Block(dim, hidden_dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, out_dim)

    def init_weights(self) -> None:
        """Keep the seeded constructor's weights (and skip MMEngine's
        per-parameter initialisation log, a page per pipelined row)."""

    def pipeline_embed(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.embed(inputs)

    def pipeline_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))

    def pipeline_loss(self, outputs: torch.Tensor,
                      targets: torch.Tensor) -> dict:
        return dict(loss=F.mse_loss(outputs, targets))

    def pipeline_predict(self, outputs: torch.Tensor,
                         targets: torch.Tensor) -> list:
        return list(outputs)

    def forward(self, inputs, targets=None, mode='tensor'):
        x = self.pipeline_embed(inputs)
        for block in self.blocks:
            x = block(x)
        outputs = self.pipeline_head(x)
        if mode == 'loss':
            return self.pipeline_loss(outputs, targets)
        if mode == 'predict':
            return self.pipeline_predict(outputs, targets)
        return outputs


def load_plan(quick: bool, steps: Optional[int] = None,
              schedules: Optional[Sequence[str]] = None,
              microbatches: Sequence[int] = MICROBATCHES) -> dict:
    """What to measure, as plain data (it goes to the spawned ranks).

    ``--quick`` is a tiny model and a step per row: it checks the plumbing,
    its times mean nothing.
    """
    names = list(SCHEDULES) if schedules is None else list(schedules)
    for name in names:
        if name not in SCHEDULES:
            raise ValueError(f'schedules: {name!r} is not allowed; allowed: '
                             f'{", ".join(SCHEDULES)}')
    return dict(
        model=QUICK_MODEL if quick else MODEL,
        global_batch=16 if quick else 256,
        schedules={name: SCHEDULES[name] for name in names},
        microbatches=list(microbatches),
        warmup=1 if quick else 3,
        steps=steps or (1 if quick else 20))


def _model(plan: dict) -> PipeBenchMLP:
    torch.manual_seed(0)  # pp=1 and every pp=2 row start from one model
    return PipeBenchMLP(**plan['model'])


def _batch(plan: dict) -> dict:
    gen = torch.Generator().manual_seed(1)
    size, model = plan['global_batch'], plan['model']
    return dict(inputs=torch.randn(size, model['in_dim'], generator=gen),
                targets=torch.randn(size, model['out_dim'], generator=gen))


def _step_fn(model: nn.Module, batch: dict):
    """``train_step`` with AdamW on ``model``'s parameters, as a call."""
    optim_wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(),
                                                   lr=1e-4))

    def step():
        model.train_step(batch, optim_wrapper)

    return step


def _pipelined(plan: dict, schedule: str, microbatches: int) -> nn.Module:
    """The model split over every rank (pp = world size) as training does."""
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    parallel = dict(pp=dist.get_world_size(), pipeline=dict(
        schedule=schedule, num_microbatches=microbatches,
        stages_per_rank=plan['schedules'][schedule]))
    # One topology (pp = world size) serves every row.
    topology = setup_parallelism(parallel)
    return parallelize(_model(plan), topology, parallel, None)


def _paired(pipelined, single, steps: int, clock: StageClock):
    """``steps`` pairs of a pp=2 and a pp=1 step, which goes first swapped
    every pair; this rank's step times and the :class:`StageClock` seconds
    of each pp=2 step."""
    pp_times, single_times, clocked = [], [], []

    def pp_step():
        clock.reset()
        pp_times.extend(time_steps(pipelined, 1))
        clocked.append(dict(clock.seconds))

    def single_step():
        single_times.extend(time_steps(single, 1))

    for i in range(steps):
        for step in ((pp_step, single_step) if i % 2 == 0 else
                     (single_step, pp_step)):
            step()
    return pp_times, single_times, clocked


def _stage_idle(clocked: List[dict]) -> List[float]:
    """Per step: 1 - the ranks' mean stage compute / the pipeline's span
    (the longest schedule step of any rank); collective."""
    compute = torch.tensor([c['compute'] for c in clocked],
                           dtype=torch.float64)
    span = torch.tensor([c['schedule'] for c in clocked],
                        dtype=torch.float64)
    dist.all_reduce(compute)
    dist.all_reduce(span, op=dist.ReduceOp.MAX)
    return (1 - compute / dist.get_world_size() / span).tolist()


def measure(plan: dict) -> List[dict]:
    """Every (schedule, m) row on the current process group; collective."""
    from mmpar.parallelize.pipeline.schedules import theoretical_bubble
    p = dist.get_world_size()
    batch = _batch(plan)
    # pp=1: rank 0 alone trains the whole model; the others wait.
    single = _step_fn(_model(plan), batch) if dist.get_rank() == 0 else \
        (lambda: None)
    time_steps(single, plan['warmup'])
    rows = []
    for schedule, v in plan['schedules'].items():
        for m in plan['microbatches']:
            theory, formula = theoretical_bubble(schedule, p, m, v)
            row = dict(schedule=schedule, stages_per_rank=v, microbatches=m,
                       pp=p, theory=theory, formula=formula)
            rows.append(row)
            if schedule in NEEDS_MICROBATCH_PER_STAGE and m < p * v:
                row['skipped'] = (f'not run: torch needs m >= {p * v} '
                                  f'(the stages) for {schedule}')
                continue
            pipelined = _step_fn(_pipelined(plan, schedule, m), batch)
            time_steps(pipelined, plan['warmup'])  # shape inference, warm-up
            with StageClock() as clock:
                pp_times, single_times, clocked = _paired(
                    pipelined, single, plan['steps'], clock)
            del pipelined
            pp_times = slowest_rank(pp_times)
            single_times = slowest_rank(single_times)
            ratio = median([a / b for a, b in zip(pp_times, single_times)])
            row.update(pp_s=median(pp_times), single_s=median(single_times),
                       ratio=ratio, idle=1 - 1 / (p * ratio),
                       stage_idle=median(_stage_idle(clocked)))
    return rows


def format_report(rows: List[dict], plan: dict, meta: dict) -> str:
    """The section's Markdown: conditions, the table, how to read it."""
    model = ', '.join(f'{k}={v}' for k, v in plan['model'].items())
    lines = [
        '`PYTHONPATH=$PWD python benchmarks/bench_pipeline.py` prints this '
        'table; `--out docs` rewrites this section (`benchmarks/run.py` '
        f'too). {meta["machine"]} (pp=1: one process, one thread), '
        f'{meta["date"]}; load average {meta["load_before"]:.2f} before '
        f'the run, {meta["load_after"]:.2f} after (its own ranks count). '
        f'`PipeBenchMLP({model})`, global batch {plan["global_batch"]}, '
        f'AdamW; {plan["warmup"]} warm-up step(s), then the median of '
        f'{plan["steps"]} step(s), each paired with a pp=1 step.',
    ]
    if meta['load_before'] >= LOADED:
        lines.append(
            f'\n**Noisy: measured on a loaded machine** (load average '
            f'{meta["load_before"]:.2f} on {os.cpu_count()} cores before the '
            'run): other jobs took CPU time from the ranks; read trends, '
            'not digits.')
    lines += [
        '',
        '| schedule | stages / rank (v) | m | pp=2 step (ms) | pp=1 step (ms) '
        '| ratio pp=2 / pp=1 | measured idle | stage idle | theory | '
        'formula |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---:|---|',
    ]
    for r in rows:
        measured = (f'{r["pp_s"] * 1e3:.1f} | {r["single_s"] * 1e3:.1f} | '
                    f'{r["ratio"]:.3f} | {r["idle"]:.3f} | '
                    f'{r["stage_idle"]:.3f}') if 'skipped' not in r else \
            f'{r["skipped"]} | | | |'
        lines.append(
            f'| {r["schedule"]} | {r["stages_per_rank"]} | '
            f'{r["microbatches"]} | {measured} | {r["theory"]:.3f} | '
            f'{r["formula"]} |')
    lines += ['', NOTES]
    return '\n'.join(lines)


NOTES = '''Reading the table (p = 2 ranks, m micro-batches, v stages per rank):

- *ratio*: median over steps of pp=2 step time / the neighbouring pp=1
  step time (one process, the whole model, the same global batch, no
  micro-batches). A perfect pipeline would give 1/p = 0.5.
- *measured idle* = 1 - T_pp1 / (p x T_pp2) = 1 - 1 / (p x ratio): the share
  of the p ranks' time not spent on the one-process work. It holds the
  bubble, the sends and receives, the m smaller matmuls' efficiency against
  one big one (usually lower; higher where a micro-batch's activations stay
  in cache) and the schedule's Python.
- *stage idle*: 1 - (a rank's time in its stages' forward, backward and
  weight-gradient passes) / (the longest schedule `step` of any rank), mean
  over ranks, median over steps: the bubble and the waits on sends and
  receives, measured directly; the optimizer step is outside it. Load from
  other jobs that pre-empts a rank mid-pass counts as compute, so on a busy
  machine it reads low.
- *theory*: the textbook bubble for equal stages and free communication,
  `mmpar.parallelize.pipeline.schedules.theoretical_bubble`: (p-1)/(m+p-1)
  for GPipe and 1F1B; (p-1)/(v*m+p-1) for Interleaved1F1B and LoopedBFS;
  for InterleavedZeroBubble, ZBVZeroBubble and DualPipeV the same value as
  an upper bound (`<=`): splitting backward into input and weight gradients
  fills part of it, all of it when the passes cost the same.'''


def run(quick: bool, out: Optional[str] = None,
        steps: Optional[int] = None) -> str:
    """Measure on 2 spawned ranks; rewrite the section of
    ``out/benchmarks.md`` when ``out`` is given; return the section."""
    start, load_before = time.time(), os.getloadavg()[0]
    plan = load_plan(quick, steps)
    rows = measure_on_ranks(measure, WORLD_SIZE, plan)
    report = format_report(rows, plan, run_conditions(
        'gloo', WORLD_SIZE, start, load_before))
    if out:
        write_section(os.path.join(out, 'benchmarks.md'), SECTION, report)
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true',
                        help='a tiny model, one step per row: a smoke run')
    parser.add_argument('--steps', type=int,
                        help='timed step pairs per row (default 20)')
    parser.add_argument('--out', help='also rewrite the section of '
                        'OUT/benchmarks.md (e.g. docs)')
    args = parser.parse_args()
    start = time.time()
    print(run(args.quick, args.out, args.steps))
    print(f'({time.time() - start:.0f} s)', file=sys.stderr)


if __name__ == '__main__':
    main()
