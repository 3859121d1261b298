"""Tensor parallelism and FSDP2 on the language model, against hand-written torch.

    PYTHONPATH=$PWD python benchmarks/bench_llm_tp.py [--quick] [--steps N] [--out DIR]

The Llama of ``configs/llama_shakespeare/`` (dim 128, 4 blocks, 4 heads,
vocabulary 256, windows of 128 bytes, 32 windows per data rank, the config's
AdamW and clip, fp32) on 2 gloo ranks, each mmpar layout next to the plainest
torch loop doing the same work (``benchmarks/baselines.py``: forward,
``loss.backward()``, torch's clip, AdamW, no MMEngine):

* **tp=2** (``llama_shakespeare_tp.py``: ``parallel=dict(tp=2,
  tp_plan='llama')``, built by ``setup_parallelism`` + ``parallelize`` as the
  Runner does) against torch ``parallelize_module`` with torchtitan's Llama
  plan (sequence parallelism, ``PrepareModuleInput``). Also: collectives per
  block and pass (torch's ``CommDebugMode``), and the bytes one rank sends
  per step against the Megatron-LM model;
* **FSDP2 dp=2** (``llama_shakespeare_fsdp2.py``) against ``fully_shard`` on
  each block and the root.

Each pair runs step by step, which one goes first swapped every pair, the
slower rank counting; *step-paired* is the median over pairs of hand-written
step time / mmpar step time (1.00: as fast). Both start from the same
weights and see the same batches, so their losses must agree (reported).
Rewrites its section of ``docs/benchmarks.md`` (``--out DIR``: of
``DIR/benchmarks.md``; ``--out ''``: print only).
"""
import copy
import os
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (counting_all_collectives,  # noqa: E402
                                measure_on_ranks, measured_section, median,
                                section_main, slowest_rank, time_steps,
                                wire_bytes)

SECTION = '## Language model: tp=2 and FSDP2 against hand-written torch'
CONFIG_DIR = os.path.join(ROOT, 'configs', 'llama_shakespeare')
GOAL = 0.98  # mmpar's speed / the hand-written loop's, step-paired
LOADED = 1.0  # a 1-minute load average at or above this: say it is noisy
MEGATRON_PER_BLOCK = dict(all_gather=2, reduce_scatter=2)  # per pass, SP


def load_plan(quick: bool, steps: int) -> dict:
    """Model, layouts and optimizer from the shipped configs (plain data)."""
    from mmengine.config import Config

    def cfg(name):
        return Config.fromfile(os.path.join(CONFIG_DIR, name))

    base, tp, fsdp2 = (cfg(f'llama_shakespeare{s}.py')
                       for s in ('', '_tp', '_fsdp2'))
    model = base.model.to_dict()
    if quick:
        model.update(dim=32, num_layers=2, num_heads=2)
    return dict(
        model=model,
        optim_wrapper=base.optim_wrapper.to_dict(),
        parallel=tp.parallel.to_dict(),
        tp_wrapper=(tp.get('model_wrapper_cfg') or None),
        fsdp2_wrapper=fsdp2.model_wrapper_cfg.to_dict(),
        batch_size=2 if quick else base.train_dataloader.batch_size,
        context_length=32 if quick else base.context_length,
        warmup=1 if quick else 3,
        steps=steps or (2 if quick else 40))


class MMTrainee:
    """An mmpar wrapper driven as MMEngine's train loop drives it."""

    def __init__(self, wrapper, optim_cfg: dict):
        from mmengine.optim import build_optim_wrapper

        from mmpar.runner.optim import mmpar_optim_wrapper_cfg
        self.wrapper, self.model = wrapper, wrapper.module
        # After wrapping: FSDP2 replaces the parameters with sharded ones.
        # mmpar's optim wrapper, as the Runner builds it.
        self.optim_wrapper = build_optim_wrapper(
            wrapper, mmpar_optim_wrapper_cfg(copy.deepcopy(optim_cfg)))

    def step(self, batch: dict) -> torch.Tensor:
        return self.wrapper.train_step(batch, self.optim_wrapper)['loss']


class HandTrainee:
    """A hand-written loop (``benchmarks/baselines.py``) and its model."""

    def __init__(self, loop, model):
        self.loop, self.model = loop, model

    def step(self, batch: dict) -> torch.Tensor:
        return self.loop.step(batch)


def _model(plan: dict):
    from benchmarks._steps import build_model
    return build_model(plan['model'], torch.device('cpu'))


def build_tp(plan: dict) -> Dict[str, object]:
    """mmpar tp=2 through the Runner's path, and the torch loop."""
    from benchmarks.baselines import hand_written_tp
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    topology = setup_parallelism(plan['parallel'], plan['tp_wrapper'])
    wrapper = parallelize(_model(plan), topology, plan['parallel'],
                          plan['tp_wrapper'])
    hand = _model(plan)
    return {
        'mmpar tp=2': MMTrainee(wrapper, plan['optim_wrapper']),
        'torch TP, hand-written': HandTrainee(hand_written_tp(
            hand, plan['optim_wrapper'], torch.device('cpu')), hand),
    }


def build_fsdp2(plan: dict) -> Dict[str, object]:
    """mmpar's MMFullyShard as the config builds it, and the torch loop
    (no topology: the data axis is the world, as in bench_llm.py)."""
    from benchmarks.bench_llm import HandWrittenFSDP2
    from mmpar.wrappers.builder import build_model_wrapper
    wrapper = build_model_wrapper(copy.deepcopy(plan['fsdp2_wrapper']),
                                  _model(plan))
    hand = _model(plan)
    return {
        'mmpar FSDP2 dp=2': MMTrainee(wrapper, plan['optim_wrapper']),
        'torch FSDP2, hand-written': HandTrainee(HandWrittenFSDP2(
            hand, plan['optim_wrapper'], torch.device('cpu')), hand),
    }


def _runner(trainee, batches: List[dict], losses: List[float]) -> Callable:
    state = dict(i=0)

    def run():
        batch = batches[state['i'] % len(batches)]
        losses.append(float(trainee.step(batch)))
        state['i'] += 1

    return run


def per_block_collectives(run: Callable, model) -> List[dict]:
    """Collectives per block in one step: ``[{'forward': {kind: n},
    'backward': {kind: n}}]``, one entry per block, from ``CommDebugMode``."""
    from torch.distributed.tensor.debug import CommDebugMode
    mode = CommDebugMode()
    with mode:
        run()
    blocks = []
    for name in model.layers:
        key = next(k for k in mode.comm_module_counts
                   if k.endswith(f'layers.{name}'))
        blocks.append({
            side: {op.__name__.split('_into')[0].replace('_tensor', ''): n
                   for op, n in mode.comm_module_counts[key][side].items()
                   if n}
            for side in ('forward', 'backward')})
    return blocks


def step_collectives(run: Callable) -> dict:
    """Collectives and the bytes this rank sends in one whole step."""
    with counting_all_collectives() as calls:
        run()
    kinds: Dict[str, int] = {}
    for call in calls:
        kinds[call['kind']] = kinds.get(call['kind'], 0) + 1
    return dict(kinds=kinds, calls=len(calls),
                sent=sum(wire_bytes(c) for c in calls))


def megatron_bytes(plan: dict, tp: int) -> float:
    """What the sequence-parallel Megatron-LM split sends per rank and step
    (ring algorithm, fp32): per block and pass 2 all-gathers and 2
    reduce-scatters of the block activation; the embedding's output
    reduce-scattered (all-gathered in backward), the head's input
    all-gathered (reduce-scattered) and its logits all-gathered (mmpar's
    plan and the baseline compute the loss on whole logits)."""
    model = plan['model']
    tokens = plan['batch_size'] * plan['context_length']
    activation = tokens * model['dim'] * 4
    logits = tokens * model['vocab_size'] * 4
    share = (tp - 1) / tp
    blocks = model['num_layers'] * 2 * 4 * share * activation
    ends = 4 * share * activation + share * logits
    return blocks + ends


def measure(plan: dict, kind: str) -> List[dict]:
    """Build a pair, warm it up, count its collectives (tp), then time it
    step-paired; on every rank. Returns one row per trainee."""
    import mmpar.wrappers  # noqa: F401  (registers the wrappers)
    from benchmarks.bench_llm import token_batches
    rank, world = dist.get_rank(), dist.get_world_size()
    built = build_tp(plan) if kind == 'tp' else build_fsdp2(plan)
    # tp: every rank of the one data replica reads the same windows.
    data_rank, data_size = (0, 1) if kind == 'tp' else (rank, world)
    batches = token_batches(data_rank, data_size, plan['batch_size'],
                            plan['context_length'], 4, torch.device('cpu'))
    losses = {name: [] for name in built}
    runs = {name: _runner(t, batches, losses[name])
            for name, t in built.items()}
    for name in built:
        time_steps(runs[name], plan['warmup'])
    counted = {name: step_collectives(runs[name]) for name in built}
    if kind == 'tp':
        for name, trainee in built.items():
            counted[name]['blocks'] = per_block_collectives(runs[name],
                                                            trainee.model)
    first = len(losses[next(iter(built))])
    names = list(built)
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    for i in range(plan['steps']):
        for name in (names if i % 2 == 0 else names[::-1]):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            runs[name]()
            cpu[name].append(time.process_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    rows = []
    for name in names:
        step_times, cpu_times = slowest_rank(wall[name]), slowest_rank(
            cpu[name])
        rows.append(dict(name=name, kind=kind, step_s=median(step_times),
                         step_times=step_times, cpu_s=median(cpu_times),
                         cpu_times=cpu_times,
                         losses=_mean_over_ranks(losses[name][first:]),
                         **counted[name]))
    return rows


def _mean_over_ranks(values: List[float]) -> List[float]:
    """Each value averaged over the ranks: the loss of the whole batch.
    mmpar logs it so already (its loss counts every rank's tokens); a
    hand-written loop's is its own rank's, averaged here, after the timed
    steps."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def add_ratios(rows: List[dict]) -> None:
    """Each mmpar row against the hand-written row of its kind."""
    for row in rows:
        if row['name'].startswith('mmpar'):
            hand = next(r for r in rows if r['kind'] == row['kind']
                        and not r['name'].startswith('mmpar'))
            row['baseline'] = hand['name']
            for key, times in (('paired', 'step_times'),
                               ('cpu_paired', 'cpu_times')):
                row[key] = median([
                    b / t for t, b in zip(row[times], hand[times])])
            row['loss_diff'] = max(
                abs(a - b) for a, b in zip(row['losses'], hand['losses']))


def _kinds(counts: Dict[str, int]) -> str:
    short = dict(all_gather='AG', reduce_scatter='RS', all_reduce='AR',
                 broadcast='BC', other='other')
    return ' + '.join(f'{n} {short.get(k, k)}'
                      for k, n in sorted(counts.items())) or 'none'


def _block_cell(row: dict) -> str:
    blocks = row.get('blocks')
    if not blocks:
        return ''
    cells = {f'{_kinds(b["forward"])} / {_kinds(b["backward"])}'
             for b in blocks}
    return '; '.join(sorted(cells))


def format_report(rows: List[dict], plan: dict, meta: dict) -> str:
    model = plan['model']
    megatron = megatron_bytes(plan, 2)
    lines = [
        '`PYTHONPATH=$PWD python benchmarks/bench_llm_tp.py` rewrites this '
        f'section (`benchmarks/run.py` too). {meta["machine"]}, '
        f'{meta["date"]} UTC; load average {meta["load_before"]:.2f} before '
        f'the run, {meta["load_after"]:.2f} after (1-minute, its own ranks '
        f'count; {os.cpu_count()} cores).',
    ]
    if meta['load_before'] >= LOADED:
        lines.append(
            '\n**Noisy: measured on a loaded machine** (load average '
            f'{meta["load_before"]:.2f} on {os.cpu_count()} cores before the '
            'run): other jobs took CPU time from the ranks; the CPU-time '
            'columns suffer less from that than the wall-clock ones.')
    lines += [
        '',
        f'Protocol: `Llama` dim {model["dim"]} x {model["num_layers"]} '
        f'blocks, {model["num_heads"]} heads, vocabulary '
        f'{model["vocab_size"]}, {plan["batch_size"]} windows of '
        f'{plan["context_length"]} bytes per data rank, the config\'s AdamW '
        f'+ clip_grad, fp32, 2 ranks. {plan["warmup"]} warm-up step(s) '
        f'each, then {plan["steps"]} pairs of steps (mmpar and its '
        'hand-written loop, which goes first swapped every pair; the slower '
        'rank counts). *step-paired*: median over pairs of hand-written step '
        f'time / mmpar step time, goal >= {GOAL}; *CPU*: the same with the '
        'CPU time each rank\'s process used in the step (`process_time`), '
        'which waiting in a collective does not count and other jobs '
        'disturb less. *max \\|loss diff\\|*: over the timed steps; the two '
        'runs start from the same weights and see the same batches.', '',
        '| layout | step (ms) | step-paired | CPU / step (ms) | CPU '
        'step-paired | collectives per block, forward / backward | '
        'collectives per step | sent / rank / step (MiB) | vs Megatron '
        'model | max \\|loss diff\\| |',
        '|---|---:|---:|---:|---:|---|---|---:|---:|---:|',
    ]
    for row in rows:
        base = 'paired' not in row
        paired = '(baseline)' if base else f'{row["paired"]:.3f}x'
        cpu_paired = '' if base else f'{row["cpu_paired"]:.3f}x'
        versus = (f'{row["sent"] / megatron:.3f}x' if row['kind'] == 'tp'
                  else '')
        diff = '' if base else f'{row["loss_diff"]:.1e}'
        lines.append(
            f'| {row["name"]} | {row["step_s"] * 1000:.1f} | {paired} | '
            f'{row["cpu_s"] * 1000:.1f} | {cpu_paired} | '
            f'{_block_cell(row)} | {row["calls"]} ({_kinds(row["kinds"])}) '
            f'| {row["sent"] / 2**20:.2f} | {versus} | {diff} |')
    lines += [
        '', f'*Megatron model* (tp=2 with sequence parallelism): '
        f'{_kinds(MEGATRON_PER_BLOCK)} of the block activation per block and '
        'pass; with the embedding\'s output (reduce-scatter, all-gather in '
        'backward), the head\'s input (all-gather, reduce-scatter) and its '
        'gathered logits, one rank sends '
        f'{megatron / 2**20:.2f} MiB per step (ring algorithm: (tp-1)/tp of '
        'the whole tensor per all-gather or reduce-scatter, twice that per '
        'all-reduce). Collectives per block come from torch\'s '
        '`CommDebugMode`; per step (forward, backward, clip, optimizer) from '
        'wrapping the functional and `torch.distributed` collectives '
        '(`benchmarks/_common.py`). Beyond the Megatron count both TP rows '
        'sum the sequence-parallel norms\' weight gradients (`Partial`, '
        f'{2 * model["num_layers"] + 1} tensors of {model["dim"]} floats): '
        'mmpar once each, as backward produces them (the 2 all-reduces per '
        'block in backward), plus the clip\'s norm and its data-parallel '
        'wrapper\'s all-reduce over a one-rank data group; torch\'s loop in '
        'its clip and again in the optimizer\'s ops. FSDP2 rows: the '
        'parameters\' all-gathers and the gradients\' reduce-scatters, the '
        'clip\'s norm.',
    ]
    return '\n'.join(lines)


def run(quick: bool, out, steps: int = 0, world_size: int = 2) -> str:
    """Measure both pairs; rewrite the section of ``out``/benchmarks.md when
    ``out`` is given; return the section."""
    plan = load_plan(quick, steps)

    def measure_both() -> List[dict]:
        rows = (measure_on_ranks(measure, world_size, plan, 'tp') +
                measure_on_ranks(measure, world_size, plan, 'fsdp2'))
        add_ratios(rows)
        return rows

    return measured_section(SECTION, out, world_size, measure_both,
                            lambda rows, meta: format_report(rows, plan,
                                                             meta))


def main():
    section_main(__doc__, run, os.path.join(ROOT, 'docs'),
                 'timed pairs per layout (default 40)')


if __name__ == '__main__':
    main()
