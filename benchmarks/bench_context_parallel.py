"""Context parallelism on the language model: activation memory and speed.

    PYTHONPATH=$PWD python benchmarks/bench_context_parallel.py \
        [--quick] [--steps N] [--out DIR]

The Llama of ``configs/llama_shakespeare/`` (dim 128, 4 blocks, 4 heads,
vocabulary 256, the config's AdamW and clip, fp32) on one sequence per step
of T = 512 ... 4096 bytes, at cp = 1, 2 and 4 (``parallel=dict(cp=...)``
on as many gloo ranks, built by ``setup_parallelism`` + ``parallelize`` as
the Runner does: the default DDP over the cp group). Per rank, the largest
over the ranks:

* **activations**: the bytes backward keeps from the forward (every tensor
  saved for backward, each storage once, parameters left out), and the rise
  of the resident set over one forward (``VmRSS``, freed memory handed back
  first);
* **tokens/s**: the sequence's tokens over the median step (forward,
  backward, gradient sync, clip, AdamW; the slowest rank counting);
* **attention scores**: entries of the score matrices each cp rank
  computes per (sample, head), largest over smallest (the load balance).

Next to them, the plan tool's activation estimate (a meta-device forward of
one sequence, ``mmpar.analysis.activations``, divided over cp as
``tools/plan.py`` divides it). Rewrites its section of ``docs/benchmarks.md``
(``--out DIR``: of ``DIR/benchmarks.md``; ``--out ''``: print only).
"""
import copy
import ctypes
import gc
import os
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (measure_on_ranks,  # noqa: E402
                                measured_section, median, section_main,
                                slowest_rank, time_steps)
from benchmarks._steps import log, read_status_kb  # noqa: E402

SECTION = '## Context parallelism: activation memory and tokens/s'
CONFIG = os.path.join(ROOT, 'configs', 'llama_shakespeare',
                      'llama_shakespeare.py')
CPS = (1, 2, 4)
GOAL = 0.6  # activations per rank at cp=2 / at cp=1, at the longest T
LOADED = 1.0  # a 1-minute load average at or above this: say it is noisy


def load_plan(quick: bool, steps: int) -> dict:
    """Model and optimizer from the shipped config (plain data)."""
    from mmengine.config import Config
    base = Config.fromfile(CONFIG)
    model = base.model.to_dict()
    if quick:
        model.update(dim=32, num_layers=2, num_heads=2)
    lengths = (64, 128) if quick else (512, 1024, 2048, 4096)
    return dict(model=model, optim_wrapper=base.optim_wrapper.to_dict(),
                lengths=lengths, warmup=1, steps=steps or (1 if quick else 4))


def saved_activation_bytes(forward, params) -> int:
    """Bytes of the tensors ``forward()`` saves for backward, each storage
    once, ``params`` (parameter storages) left out; runs its backward."""
    sizes: Dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward()
    loss.backward()
    return sum(sizes.values())


def rss_rise_bytes(forward) -> int:
    """How far the resident set rises over ``forward()`` (what it keeps for
    backward, and the tensors it returns); runs its backward."""
    libc = ctypes.CDLL('libc.so.6')
    gc.collect()
    libc.malloc_trim(0)
    before = read_status_kb('VmRSS')
    loss = forward()
    gc.collect()
    libc.malloc_trim(0)
    rise = (read_status_kb('VmRSS') - before) * 1024
    loss.backward()
    return rise


def measure(plan: dict) -> List[dict]:
    """On every rank of a world of cp ranks: one row per sequence length."""
    from mmengine.optim import build_optim_wrapper

    from mmpar.parallel import reset_parallelism, setup_parallelism
    from mmpar.parallel.sequence import shard_batch
    from mmpar.parallelize.compose import parallelize
    from mmpar.parallelize.context import attention_work
    from mmpar.registry import MODELS
    from mmpar.runner.optim import mmpar_optim_wrapper_cfg
    cp = dist.get_world_size()
    rows = []
    for length in plan['lengths']:
        log(f'cp={cp} T={length}')
        topology = setup_parallelism(dict(cp=cp), None)
        torch.manual_seed(0)
        model = MODELS.build(dict(copy.deepcopy(plan['model']),
                                  max_seq_len=length))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        wrapper = parallelize(model, topology, dict(cp=cp), None)
        optim_wrapper = build_optim_wrapper(
            wrapper,
            mmpar_optim_wrapper_cfg(copy.deepcopy(plan['optim_wrapper'])))
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, plan['model']['vocab_size'],
                               (1, length + 1), generator=gen)
        batch = dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:])
        local = shard_batch(model, batch)

        def forward():
            return wrapper(**local, mode='loss')['loss']

        saved = saved_activation_bytes(forward, params)
        rss = rss_rise_bytes(forward)
        optim_wrapper.zero_grad()
        for _ in range(plan['warmup']):
            wrapper.train_step(batch, optim_wrapper)
        times = slowest_rank(time_steps(
            lambda: wrapper.train_step(batch, optim_wrapper),
            plan['steps']))
        peaks = torch.tensor([saved, rss], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        scores = [attention_work(length, r, cp)[0] for r in range(cp)]
        rows.append(dict(cp=cp, length=length, saved=float(peaks[0]),
                         rss=float(peaks[1]),
                         tokens_per_s=length / median(times),
                         balance=max(scores) / min(scores)))
        reset_parallelism()
    return rows


def add_plan_estimates(rows: List[dict], plan: dict) -> List[dict]:
    """Each row with the plan tool's activation estimate for its rank (a
    meta-device forward of one sequence, divided over cp)."""
    from mmpar.analysis.activations import activation_bytes
    estimates = {
        length: activation_bytes(dict(plan['model'], max_seq_len=length), 1,
                                 length)
        for length in plan['lengths']}
    for row in rows:
        row['estimate'] = estimates[row['length']] / row['cp']
    return rows


def measure_all(plan: dict) -> List[dict]:
    rows = []
    for cp in CPS:
        rows += measure_on_ranks(measure, cp, plan)
    return add_plan_estimates(rows, plan)


def _mib(num: float) -> str:
    return f'{num / 2**20:.1f}'


def report(rows: List[dict], plan: dict, conditions: dict) -> str:
    by = {(r['cp'], r['length']): r for r in rows}
    longest = max(plan['lengths'])
    lines = [
        f'Measured {conditions["date"]} UTC on {conditions["machine"]} '
        '(cp ranks, one process each); load average '
        f'{conditions["load_before"]:.2f} before, '
        f'{conditions["load_after"]:.2f} after; '
        f'{conditions["wall_s"]:.0f} s. One sequence of T tokens per step, '
        f'the Llama of configs/llama_shakespeare (dim '
        f'{plan["model"]["dim"]}, {plan["model"]["num_layers"]} blocks), '
        f'fp32, {plan["steps"]} timed steps after {plan["warmup"]} warm-up. '
        'Activations: per rank (the largest rank), MiB saved for backward '
        '(parameters left out) / resident-set rise over one forward; '
        '*plan*: tools/plan.py\'s activation estimate for the rank (a '
        'meta-device forward of the sequence, divided over cp).',
        '',
        '| T | cp | activations saved (MiB) | RSS rise (MiB) | plan '
        '(MiB) | vs cp=1 (saved) | tokens/s | attention scores (counted), '
        'max/min rank |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for length in plan['lengths']:
        one = by[1, length]
        for cp in CPS:
            r = by[cp, length]
            lines.append(
                f'| {length} | {cp} | {_mib(r["saved"])} | {_mib(r["rss"])} '
                f'| {_mib(r["estimate"])} '
                f'| {r["saved"] / one["saved"]:.2f} | '
                f'{r["tokens_per_s"]:.0f} | {r["balance"]:.2f} |')
    ratio = by[2, longest]['saved'] / by[1, longest]['saved']
    verdict = 'meets' if ratio <= GOAL else 'misses'
    lines += [
        '',
        f'At T={longest}, cp=2 keeps {ratio:.2f} x the activations of cp=1 '
        f'per rank ({verdict} the goal of <= {GOAL}). Backward keeps only '
        'a rank\'s own queries, keys and values (the gathered keys/values '
        'and chunk masks are made again in backward), so activations fall '
        'as 1/cp; every cp rank computes as many attention scores.',
        f'The plan\'s estimate is {by[1, longest]["estimate"] / by[1, longest]["saved"]:.1f} x '
        f'the measurement at T={longest}, cp=1: its meta forward counts '
        'each attention\'s T x T scores as the math kernel saves them, '
        'which the fused kernel used here does not keep; it follows cp '
        '(1/cp) as the measurement does.',
    ]
    if conditions['load_before'] >= LOADED or \
            conditions['load_after'] >= LOADED or max(CPS) > os.cpu_count():
        lines.append(
            f'Speed is noisy here: the machine was loaded (load average '
            f'above {LOADED}) or had fewer cores ({os.cpu_count()}) than '
            f'ranks ({max(CPS)}); tokens/s at cp > 1 on CPU also pays for '
            'gloo all-gathers and the recomputed attention. The memory '
            'columns do not depend on load.')
    return '\n'.join(lines)


def run(quick: bool = False, out=os.path.join(ROOT, 'docs'),
        steps: int = 0) -> str:
    plan = load_plan(quick, steps)
    return measured_section(
        SECTION, out, max(CPS), lambda: measure_all(plan),
        lambda rows, conditions: report(rows, plan, conditions))


def main():
    section_main(__doc__, run, os.path.join(ROOT, 'docs'),
                 'timed steps per row (default 4)')


if __name__ == '__main__':
    main()
