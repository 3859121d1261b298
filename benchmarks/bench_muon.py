"""Step time of Muon against AdamW under FSDP2, and where Muon's time goes.

    PYTHONPATH=$PWD python benchmarks/bench_muon.py [--quick|--stress] [--out docs]

The Llama of ``configs/llama_shakespeare/llama_shakespeare_muon.py``
(FSDP2 on every LlamaBlock), as shipped (its model and its per-rank batch),
at three layouts: FSDP2 on 2 and on 4 gloo ranks, and tp=2 x FSDP2 on 4.
``--stress`` keeps the earlier protocol: a wider model (dim 256) on a tiny
batch (2 windows per rank), where the optimizer step is most of the step.
At each layout the model is built twice in the same
processes under ``mmpar.Runner``'s model and optim wrapper: once with AdamW
(the base config's), once with Muon (+ AdamW for the embedding, head and
norms). The two train in turn, step for step (AdamW first on even steps,
Muon first on odd ones), so that both see the same load on a shared
machine. A step is ``train_step`` (forward, backward, clip, optimizer
step), timed on every rank after a barrier, the slowest rank's time kept;
the median of the timed steps after warm-up is reported. For Muon, the
seconds per step inside the optimizer step, inside the Newton-Schulz
iterations of the rank that does the most of them, and inside the two
all-to-alls of :mod:`mmpar.optim.whole_matrix` (shards to owners, results
back, waiting for the owners included) are also reported.
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
                                run_conditions, slowest_rank, write_section)

SECTION = '## Muon vs AdamW under FSDP2: step time'
CONFIG = os.path.join(ROOT, 'configs', 'llama_shakespeare',
                      'llama_shakespeare_muon.py')
ADAMW = dict(type='AdamW', lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
OPTIMIZERS = ('AdamW', 'Muon')
PARTS = ('optim_step_s', 'newton_schulz_s', 'exchange_s')


# (name, the config's ``parallel``, ranks), measured in this order.
LAYOUTS = (('FSDP2', {}, 2), ('FSDP2', {}, 4),
           ('tp=2 x FSDP2', dict(tp=2, tp_plan='llama'), 4))


def load_plan(mode: str) -> dict:
    """``mode``: 'shipped' (the config as it is), 'stress' or 'quick'."""
    if mode == 'quick':
        return dict(model=dict(dim=32, num_layers=2, num_heads=2),
                    layouts=LAYOUTS[1:2], batch_size=2, context=16,
                    warmup=1, steps=2)
    if mode == 'stress':
        return dict(model=dict(dim=256, num_layers=4, num_heads=4),
                    layouts=LAYOUTS[1:2], batch_size=2, context=128,
                    warmup=2, steps=6)
    return dict(model={}, layouts=LAYOUTS, batch_size=32, context=128,
                warmup=2, steps=6)


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


def _build(plan: dict, parallel: dict, optimizer: str, work_dir: str):
    """(runner, optim wrapper) of the config at ``parallel`` with
    ``optimizer``."""
    from mmengine.config import Config

    from mmpar.runner import Runner
    cfg = Config.fromfile(CONFIG)
    cfg.model.update(plan['model'], max_seq_len=plan['context'])
    if parallel:
        cfg.parallel = parallel
    if optimizer == 'AdamW':
        cfg.optim_wrapper.optimizer = ADAMW
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator'):
        cfg[key] = None
    cfg.update(launcher='pytorch', log_level='WARNING', meta_init=False,
               experiment_name=f'bench_muon_{optimizer}',
               work_dir=os.path.join(work_dir, optimizer))
    runner = Runner.from_cfg(cfg)
    return runner, runner.build_optim_wrapper(cfg.optim_wrapper)


def measure(plan: dict, parallel: dict) -> Dict[str, Dict[str, float]]:
    """On every rank of a started process group, at ``parallel``: per
    optimizer, seconds per step (median of the slowest rank), and Muon's
    parts (module docstring)."""
    from mmpar.optim import whole_matrix
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (plan['batch_size'], plan['context'] + 1),
                           generator=gen)
    batch = dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:])
    parts = {name: [0.0] for name in PARTS}
    times = {name: [] for name in OPTIMIZERS}
    with tempfile.TemporaryDirectory() as work_dir:
        built = {name: _build(plan, parallel, name, work_dir)
                 for name in OPTIMIZERS}
        muon = built['Muon'][1].optimizer
        muon.step = _Timed(muon.step, parts['optim_step_s'])
        muon.transform = _Timed(muon.transform, parts['newton_schulz_s'])
        whole_matrix.dist.all_to_all_single = _Timed(
            dist.all_to_all_single, parts['exchange_s'])
        for step in range(plan['warmup'] + plan['steps']):
            if step == plan['warmup']:
                for total in parts.values():
                    total[0] = 0.0
            order = OPTIMIZERS if step % 2 == 0 else OPTIMIZERS[::-1]
            for name in order:
                runner, wrapper = built[name]
                dist.barrier()
                start = time.perf_counter()
                runner.model.train_step(batch, wrapper)
                times[name].append(time.perf_counter() - start)
    runs = {}
    for name in OPTIMIZERS:
        slowest = slowest_rank(times[name][plan['warmup']:])
        runs[name] = dict(step_s=median(slowest))
    shares = slowest_rank([parts[name][0] / plan['steps'] for name in PARTS])
    runs['Muon'].update(zip(PARTS, shares))
    return runs


def _model_text(plan: dict) -> str:
    if not plan['model']:
        return 'as shipped (dim 128, 4 blocks)'
    model = plan['model']
    return (f'with `model=dict(dim={model["dim"]}, num_layers='
            f'{model["num_layers"]}, num_heads={model["num_heads"]})`')


def format_report(runs: list, plan: dict, meta: dict) -> str:
    """``runs``: (layout name, ranks, measure's result) per layout."""
    lines = [
        f'Machine: {meta["machine"]}. Run {meta["date"]} UTC; load average '
        f'{meta["load_before"]:.1f} before and {meta["load_after"]:.1f} '
        f'after (1-minute; {os.cpu_count()} cores, shared with other jobs); '
        f'{meta["wall_s"]:.0f} s.', '',
        'Protocol: `configs/llama_shakespeare/llama_shakespeare_muon.py` '
        f'{_model_text(plan)}, gloo ranks of one thread, '
        f'{plan["batch_size"]} windows of {plan["context"]} tokens per rank; '
        'at each layout both optimizers built in the same processes and '
        f'stepped in turn; `train_step` timed after {plan["warmup"]} warm-up '
        f'steps, median of {plan["steps"]}, slowest rank; AdamW is the base '
        'config\'s (`python benchmarks/bench_muon.py`). Muon\'s parts per '
        'step: *Newton-Schulz* on the rank that runs the most of it, '
        '*all-to-all* both exchanges of `mmpar/optim/whole_matrix.py` '
        '(gathering shards to owners and scattering results back, waiting '
        'for the owners included), and its share of Muon\'s step.', '',
        '| layout | ranks | AdamW step (ms) | Muon step (ms) | optimizer '
        'step (ms) | Newton-Schulz (ms) | all-to-all (ms) | all-to-all share '
        '| step vs AdamW |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---:|',
    ]
    for name, ranks, result in runs:
        muon, adamw = result['Muon'], result['AdamW']
        lines.append(
            f'| {name} | {ranks} | {adamw["step_s"] * 1e3:.1f} | '
            f'{muon["step_s"] * 1e3:.1f} | '
            f'{muon["optim_step_s"] * 1e3:.1f} | '
            f'{muon["newton_schulz_s"] * 1e3:.1f} | '
            f'{muon["exchange_s"] * 1e3:.1f} | '
            f'{muon["exchange_s"] / muon["step_s"]:.0%} | '
            f'{muon["step_s"] / adamw["step_s"]:.2f}x |')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument('--quick', action='store_true',
                      help='a tiny model at one layout (checks the script)')
    mode.add_argument('--stress', action='store_true',
                      help='dim 256 on 2 windows per rank, FSDP2 at 4 ranks')
    parser.add_argument('--out', help='folder whose benchmarks.md gets the '
                        'section')
    args = parser.parse_args()
    plan = load_plan('quick' if args.quick else
                     'stress' if args.stress else 'shipped')
    start, load_before = time.time(), os.getloadavg()[0]
    runs = [(name, ranks, measure_on_ranks(measure, ranks, plan, parallel))
            for name, parallel, ranks in plan['layouts']]
    text = format_report(runs, plan, run_conditions(
        'gloo', max(ranks for _, ranks, _ in runs), start, load_before))
    print(text)
    if args.out:
        write_section(os.path.join(args.out, 'benchmarks.md'), SECTION, text)


if __name__ == '__main__':
    main()
