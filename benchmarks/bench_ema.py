"""What MMEngine's EMAHook costs in memory per rank under FSDP2.

    PYTHONPATH=$PWD python benchmarks/bench_ema.py [--quick] [--out docs]

The Llama of ``configs/llama_shakespeare/llama_shakespeare_fsdp2.py`` at
about 100 M parameters (dim 1024, 8 blocks, 8 heads) trains a few steps on
4 gloo ranks under ``mmpar.Runner``, once without and once with
``custom_hooks=[dict(type='EMAHook', update_buffers=True)]``, each in fresh
processes. Per rank: the peak RSS (``VmHWM`` of ``/proc/self/status``) of
the whole process, and of the training phase (reset after the Runner is
built: each rank still builds the whole model before sharding it), the
bytes of the averaged copy and of the rank's shard of the parameters. The
goal: with EMA, at most one shard of parameters (+10 %) more per rank.

glibc's malloc raises its mmap threshold as large blocks are freed, after
which tensors come from heap arenas that keep freed pages: the peak then
depends on the order of allocations as much as on what is live (two runs
of one variant differed by tens of MB). The ranks therefore run with a
fixed threshold (``MALLOC_MMAP_THRESHOLD_=131072``: every tensor over
128 KiB is its own mapping, returned when freed), so the peak follows live
memory; ``--default-malloc`` leaves glibc's default.
"""
import argparse
import os
import sys
import tempfile
import time
from typing import List

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (measure_on_ranks,  # noqa: E402
                                run_conditions, write_section)
from benchmarks._steps import read_status_kb, reset_peak_rss  # noqa: E402

SECTION = '## EMA under FSDP2: memory per rank'
CONFIG = os.path.join(ROOT, 'configs', 'llama_shakespeare',
                      'llama_shakespeare_fsdp2.py')
EMA = dict(type='EMAHook', update_buffers=True)
MB = 2**20
MMAP_THRESHOLD = '131072'


def load_plan(quick: bool) -> dict:
    if quick:
        return dict(model=dict(dim=64, num_layers=2, num_heads=2),
                    world_size=2, batch_size=1, steps=2)
    return dict(model=dict(dim=1024, num_layers=8, num_heads=8),
                world_size=4, batch_size=2, steps=4)


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(plan: dict, with_ema: bool) -> List[dict]:
    """On every rank of a started process group: build, train, read the
    memory; returns every rank's row (on every rank)."""
    from mmengine.config import Config
    from mmengine.hooks import EMAHook

    from mmpar.runner import Runner
    from mmpar.wrappers.local_state import local_module
    cfg = Config.fromfile(CONFIG)
    cfg.model.update(plan['model'])
    cfg.train_dataloader.batch_size = plan['batch_size']
    cfg.train_cfg = dict(by_epoch=False, max_iters=plan['steps'])
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator'):
        cfg[key] = None
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=-1,
                                        save_last=False)
    cfg.custom_hooks = [EMA] if with_ema else []
    cfg.update(launcher='pytorch', log_level='WARNING',
               experiment_name=f'bench_ema_{with_ema}')
    with tempfile.TemporaryDirectory() as work_dir:
        cfg.work_dir = work_dir
        runner = Runner.from_cfg(cfg)
        build_peak = read_status_kb('VmHWM') * 1024
        reset_peak_rss()
        runner.train()
        train_peak = read_status_kb('VmHWM') * 1024
    shard = _tensor_bytes(local_module(runner.model).parameters())
    averaged = [h.ema_model.module.state_dict().values()
                for h in runner.hooks if isinstance(h, EMAHook)]
    row = dict(rank=dist.get_rank(), build_peak=build_peak,
               train_peak=train_peak, shard_bytes=shard,
               averaged_bytes=_tensor_bytes(averaged[0]) if averaged else 0)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return rows


def compare(without: List[dict], with_ema: List[dict]) -> List[dict]:
    """Per rank: the rise of each peak with EMA, and the goal
    (one shard of parameters + 10 %)."""
    rows = []
    for plain, ema in zip(without, with_ema):
        goal = 1.1 * plain['shard_bytes']
        rows.append(dict(
            rank=plain['rank'], shard=plain['shard_bytes'],
            averaged=ema['averaged_bytes'],
            train_without=plain['train_peak'], train_with=ema['train_peak'],
            whole_without=max(plain['build_peak'], plain['train_peak']),
            whole_with=max(ema['build_peak'], ema['train_peak']),
            goal=goal))
    for row in rows:
        row['train_rise'] = row['train_with'] - row['train_without']
        row['whole_rise'] = row['whole_with'] - row['whole_without']
        row['within_goal'] = row['train_rise'] <= row['goal'] and \
            row['whole_rise'] <= row['goal']
    return rows


def format_report(rows: List[dict], plan: dict, meta: dict) -> str:
    model = plan['model']
    lines = [
        f'Machine: {meta["machine"]}. Run {meta["date"]} UTC; load average '
        f'{meta["load_before"]:.1f} before and {meta["load_after"]:.1f} '
        f'after (1-minute; {os.cpu_count()} cores, shared with other jobs); '
        f'{meta["wall_s"]:.0f} s.', '',
        f'Protocol: `configs/llama_shakespeare/llama_shakespeare_fsdp2.py` '
        f'with `model=dict(dim={model["dim"]}, num_layers='
        f'{model["num_layers"]}, num_heads={model["num_heads"]})`, '
        f'{plan["world_size"]} ranks, {plan["batch_size"]} windows per rank, '
        f'{plan["steps"]} AdamW steps, no validation or checkpoint; once '
        'without and once with `custom_hooks=[dict(type=\'EMAHook\', '
        'update_buffers=True)]`, each in fresh processes '
        '(`python benchmarks/bench_ema.py`); malloc: '
        + ('glibc default' if plan.get('malloc', 'default') == 'default' else
           f'`MALLOC_MMAP_THRESHOLD_={plan["malloc"]}`') +
        '. *Peak, training*: `VmHWM` '
        'reset once the Runner is built (the EMA copy is made in '
        '`before_run`, inside it); *peak, whole run*: also the build, where '
        'each rank still materialises the whole model before sharding it. '
        'Goal: the rise with EMA at most 1.1 x the rank\'s shard of '
        'parameters.', '',
        '| rank | parameter shard (MB) | averaged copy (MB) | peak, training: '
        'without / with EMA (MB) | rise | peak, whole run: without / with '
        '(MB) | rise | within goal |',
        '|---:|---:|---:|---:|---:|---:|---:|:---:|',
    ]
    for r in rows:
        lines.append(
            f'| {r["rank"]} | {r["shard"] / MB:.1f} | '
            f'{r["averaged"] / MB:.1f} | {r["train_without"] / MB:.0f} / '
            f'{r["train_with"] / MB:.0f} | {r["train_rise"] / MB:+.0f} | '
            f'{r["whole_without"] / MB:.0f} / {r["whole_with"] / MB:.0f} | '
            f'{r["whole_rise"] / MB:+.0f} | '
            f'{"yes" if r["within_goal"] else "no"} |')
    return '\n'.join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--quick', action='store_true',
                        help='a tiny model on 2 ranks (checks the script)')
    parser.add_argument('--out', help='folder whose benchmarks.md gets the '
                        'section')
    parser.add_argument('--default-malloc', action='store_true',
                        help="keep glibc's dynamic mmap threshold")
    args = parser.parse_args()
    plan = load_plan(args.quick)
    plan['malloc'] = 'default' if args.default_malloc else MMAP_THRESHOLD
    if not args.default_malloc:
        # Read by glibc when each spawned rank starts.
        os.environ['MALLOC_MMAP_THRESHOLD_'] = MMAP_THRESHOLD
    start, load_before = time.time(), os.getloadavg()[0]
    runs = {
        with_ema: measure_on_ranks(measure, plan['world_size'], plan,
                                   with_ema)
        for with_ema in (False, True)
    }
    rows = compare(runs[False], runs[True])
    text = format_report(rows, plan, run_conditions(
        'gloo', plan['world_size'], start, load_before))
    print(text)
    if args.out:
        write_section(os.path.join(args.out, 'benchmarks.md'), SECTION, text)


if __name__ == '__main__':
    main()
