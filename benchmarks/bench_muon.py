"""Step time of Muon against AdamW under FSDP2, and the share spent moving
shards to their owner ranks and back.

    PYTHONPATH=$PWD python benchmarks/bench_muon.py [--quick] [--out docs]

The Llama of ``configs/llama_shakespeare/llama_shakespeare_muon.py``
(FSDP2 on every LlamaBlock) trains on gloo ranks under ``mmpar.Runner``'s
model and optim wrapper, once with AdamW (the base config's) and once with
Muon (+ AdamW for the embedding, head and norms), each in fresh processes.
A step is ``train_step`` (forward, backward, clip, optimizer step), timed on
every rank after a barrier, the slowest rank's time kept; the median of the
timed steps after warm-up is reported. For Muon the time inside the two
all-to-alls of :mod:`mmpar.optim.whole_matrix` (shards to owners, results
back) and inside the optimizer step is also reported.
"""
import argparse
import os
import sys
import tempfile
import time
from typing import Dict

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (measure_on_ranks, median,  # noqa: E402
                                run_conditions, slowest_rank, time_steps,
                                write_section)

SECTION = '## Muon vs AdamW under FSDP2: step time'
CONFIG = os.path.join(ROOT, 'configs', 'llama_shakespeare',
                      'llama_shakespeare_muon.py')
ADAMW = dict(type='AdamW', lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)


def load_plan(quick: bool) -> dict:
    if quick:
        return dict(model=dict(dim=32, num_layers=2, num_heads=2),
                    world_size=2, batch_size=2, context=16, warmup=1,
                    steps=2)
    return dict(model=dict(dim=256, num_layers=4, num_heads=4),
                world_size=2, batch_size=2, context=128, warmup=2, steps=6)


class _Timed:
    """Adds the seconds spent in ``fn`` to ``total[0]``."""

    def __init__(self, fn, total):
        self.fn, self.total = fn, total

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total[0] += time.perf_counter() - start


def measure(plan: dict, optimizer: str) -> Dict[str, float]:
    """On every rank of a started process group: seconds per step (median
    of the slowest rank), and for Muon the all-to-all and step seconds."""
    from mmengine.config import Config

    from mmpar.optim import whole_matrix
    from mmpar.runner import Runner
    cfg = Config.fromfile(CONFIG)
    cfg.model.update(plan['model'], max_seq_len=plan['context'])
    if optimizer == 'AdamW':
        cfg.optim_wrapper.optimizer = ADAMW
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator'):
        cfg[key] = None
    cfg.update(launcher='pytorch', log_level='WARNING', meta_init=False,
               experiment_name=f'bench_muon_{optimizer}')
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (plan['batch_size'], plan['context'] + 1),
                           generator=gen)
    batch = dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:])
    with tempfile.TemporaryDirectory() as work_dir:
        cfg.work_dir = work_dir
        runner = Runner.from_cfg(cfg)
        wrapper = runner.build_optim_wrapper(cfg.optim_wrapper)
        optim = wrapper.optimizer
        exchange, step = [0.0], [0.0]
        whole_matrix.dist.all_to_all_single = _Timed(
            dist.all_to_all_single, exchange)
        optim.step = _Timed(optim.step, step)

        def train_step():
            runner.model.train_step(batch, wrapper)

        time_steps(train_step, plan['warmup'])
        exchange[0] = step[0] = 0.0
        times = slowest_rank(time_steps(train_step, plan['steps']))
    shares = slowest_rank([exchange[0] / plan['steps'],
                           step[0] / plan['steps']])
    return dict(step_s=median(times), exchange_s=shares[0],
                optim_step_s=shares[1])


def format_report(runs: dict, plan: dict, meta: dict) -> str:
    model = plan['model']
    muon, adamw = runs['Muon'], runs['AdamW']
    lines = [
        f'Machine: {meta["machine"]}. Run {meta["date"]} UTC; load average '
        f'{meta["load_before"]:.1f} before and {meta["load_after"]:.1f} '
        f'after (1-minute; {os.cpu_count()} cores, shared with other jobs); '
        f'{meta["wall_s"]:.0f} s.', '',
        'Protocol: `configs/llama_shakespeare/llama_shakespeare_muon.py` '
        f'(FSDP2) with `model=dict(dim={model["dim"]}, num_layers='
        f'{model["num_layers"]}, num_heads={model["num_heads"]})`, '
        f'{plan["world_size"]} gloo ranks of one thread, '
        f'{plan["batch_size"]} windows of {plan["context"]} tokens per rank; '
        f'`train_step` timed after {plan["warmup"]} warm-up steps, median of '
        f'{plan["steps"]}, slowest rank; AdamW is the base config\'s '
        '(`python benchmarks/bench_muon.py`). *All-to-all*: both exchanges '
        'of `mmpar/optim/whole_matrix.py` per step.', '',
        '| optimizer | step (ms) | optimizer step (ms) | all-to-all (ms) | '
        'step vs AdamW |',
        '|---|---:|---:|---:|---:|',
    ]
    for name, run in (('AdamW', adamw), ('Muon', muon)):
        lines.append(
            f'| {name} | {run["step_s"] * 1e3:.1f} | '
            f'{run["optim_step_s"] * 1e3:.1f} | '
            f'{run["exchange_s"] * 1e3:.1f} | '
            f'{run["step_s"] / adamw["step_s"]:.2f}x |')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true',
                        help='a tiny model (checks the script)')
    parser.add_argument('--out', help='folder whose benchmarks.md gets the '
                        'section')
    args = parser.parse_args()
    plan = load_plan(args.quick)
    start, load_before = time.time(), os.getloadavg()[0]
    runs = {name: measure_on_ranks(measure, plan['world_size'], plan, name)
            for name in ('AdamW', 'Muon')}
    text = format_report(runs, plan, run_conditions(
        'gloo', plan['world_size'], start, load_before))
    print(text)
    if args.out:
        write_section(os.path.join(args.out, 'benchmarks.md'), SECTION, text)


if __name__ == '__main__':
    main()
