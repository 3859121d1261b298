"""How long a checkpoint save blocks training, synchronous vs ``async_save``.

One process, no process group: a stack of Linear layers (``--params``
millions of parameters) with AdamW state, saved in both formats through
mmpar's own save functions, synchronously and with a background write
(:mod:`mmpar.checkpoint.background`). "blocking" is what the train loop
waits for (the whole save, or only the staging); "write" is the time until
the background write is complete. Median of ``--repeats``.

    PYTHONPATH=$PWD python benchmarks/bench_async_checkpoint.py [--params 25]

``--llama`` measures what issue 37 judges instead: the ~100 M-parameter
Llama (``dim=1024``, 8 layers, 8 heads, byte vocabulary) trained under FSDP2
by ``tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_fsdp2.py``
on ``--ranks`` processes, one window of ``--context`` bytes per rank, a
sharded checkpoint every ``--interval`` iterations, launched twice (async
off, on) with the same settings. Each iteration's ``time`` is MMEngine's
``IterTimerHook`` one (logged every iteration), which runs the time from
one iteration's end to the next: the iteration after a save includes the
part of the save that blocked. "until written" is what the background
writer logs when its write (and the rename) finished.

    PYTHONPATH=$PWD python benchmarks/bench_async_checkpoint.py --llama \
        [--ranks 4] [--iters 9] [--interval 4]
"""
import argparse
import glob
import json
import os
import os.path as osp
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.checkpoint import atomic_save, collect_checkpoint  # noqa: E402
from mmpar.checkpoint.background import BackgroundSave, stage  # noqa: E402
from mmpar.checkpoint.sharded import save_sharded  # noqa: E402


def build(millions: int):
    from mmengine.optim import OptimWrapper
    width = 1024
    layers = max(1, millions * 1_000_000 // (width * width))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optim = OptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    return model, optim


def save_full(model, optim, path, background):
    checkpoint = collect_checkpoint(model, optim, dict(meta=dict(iter=1)))
    if background is None:
        atomic_save(checkpoint, path)
    else:
        staged = stage(checkpoint)
        background.start(path, lambda: atomic_save(staged, path))


def save_dcp(model, optim, path, background):
    save_sharded(model, optim, path, dict(meta=dict(iter=1)),
                 background=background)


def measure(save, model, optim, directory, use_async, repeats):
    blocking, total = [], []
    background = BackgroundSave() if use_async else None
    for index in range(repeats):
        path = osp.join(directory, f'{save.__name__}_{use_async}_{index}')
        start = time.perf_counter()
        save(model, optim, path, background)
        blocked = time.perf_counter() - start
        if background is not None:
            background.wait()
        blocking.append(blocked)
        total.append(time.perf_counter() - start)
    return statistics.median(blocking), statistics.median(total)


ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
LLAMA_CONFIG = 'configs/llama_shakespeare/llama_shakespeare_fsdp2.py'
#: The ~100 M Llama of tests/parallelize/test_meta.py (byte vocabulary).
LLAMA_100M = dict(dim=1024, num_layers=8, num_heads=8)
_WRITTEN = re.compile(r'written in the background in ([0-9.]+) s')


def llama_options(iters: int, interval: int, context: int,
                  use_async: bool, model: dict) -> list:
    """The ``--cfg-options`` of one ``--llama`` launch."""
    options = dict(
        train_dataloader=dict(batch_size=1, dataset=dict(
            context_length=context)),
        val_dataloader=dict(dataset=dict(context_length=context)),
        test_dataloader=dict(dataset=dict(context_length=context)),
        train_cfg=dict(max_iters=iters, val_begin=iters + 1),
        default_hooks=dict(
            logger=dict(interval=1),
            checkpoint=dict(interval=interval, save_last=False,
                            max_keep_ckpts=1, async_save=use_async)),
        log_processor=dict(window_size=1),
        model=dict(model, max_seq_len=context))
    flat = []

    def walk(prefix, value):
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f'{prefix}{key}.', item)
        else:
            flat.append(f'{prefix[:-1]}={value}')

    walk('', options)
    return flat


def iteration_times(work_dir: str) -> dict:
    """Iteration -> MMEngine's logged ``time`` (s), from the run's
    ``vis_data/scalars.json``."""
    times = {}
    for path in glob.glob(osp.join(work_dir, '*', 'vis_data',
                                   'scalars.json')):
        with open(path) as file:
            for line in file:
                record = json.loads(line)
                if 'time' in record and 'step' in record:
                    times[record['step']] = record['time']
    return times


def summarize(times: dict, interval: int, written: list) -> dict:
    """The table row of one launch: the iteration after a save holds its
    blocking part; the first two iterations (warm-up) and those are left
    out of the normal step."""
    saving = [times[i] for i in sorted(times)
              if i > 1 and (i - 1) % interval == 0]
    normal = [times[i] for i in sorted(times)
              if i > 2 and (i - 1) % interval != 0]
    if not saving or not normal:
        raise RuntimeError(f'no saving or normal iteration in {times}')
    step = statistics.median(normal)
    save = statistics.median(saving)
    return dict(normal=step, saving=save, ratio=save / step,
                written=statistics.median(written) if written else None)


def run_llama(args, use_async: bool, directory: str) -> dict:
    work_dir = osp.join(directory, 'async' if use_async else 'sync')
    command = ['bash', 'tools/dist_train.sh', LLAMA_CONFIG,
               str(args.ranks), '--work-dir', work_dir, '--cfg-options',
               *llama_options(args.iters, args.interval, args.context,
                              use_async, args.model)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS='1')
    result = subprocess.run(command, cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise RuntimeError(f'{" ".join(command)} failed:\n'
                           f'{result.stdout[-4000:]}')
    written = [float(x) for x in _WRITTEN.findall(result.stdout)]
    return summarize(iteration_times(work_dir), args.interval, written)


def main_llama(args) -> None:
    load = os.getloadavg()
    print(f'Llama {args.model} under FSDP2, {args.ranks} ranks, '
          f'1 x {args.context} tokens per rank, {args.iters} iterations, '
          f'a sharded checkpoint every {args.interval}; load average '
          f'before: {load[0]:.2f}')
    print('| save | normal step (s) | step that saves (s) | ratio '
          '| until written (s) |')
    print('|---|---|---|---|---|')
    with tempfile.TemporaryDirectory() as directory:
        for use_async in (False, True):
            row = run_llama(args, use_async, directory)
            kind = 'async_save' if use_async else 'synchronous'
            written = ('-' if row['written'] is None else
                       f"{row['written']:.2f}")
            print(f"| {kind} | {row['normal']:.2f} | {row['saving']:.2f} "
                  f"| {row['ratio']:.2f} | {written} |", flush=True)
    print(f'load average after: {os.getloadavg()[0]:.2f}')


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--params', type=int, default=25,
                        help='millions of parameters (default 25)')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--llama', action='store_true',
                        help='the 100 M Llama under FSDP2 through '
                        'tools/dist_train.sh, async off and on')
    parser.add_argument('--ranks', type=int, default=4)
    parser.add_argument('--iters', type=int, default=9)
    parser.add_argument('--interval', type=int, default=4)
    parser.add_argument('--context', type=int, default=64)
    parser.add_argument('--dim', type=int, default=LLAMA_100M['dim'])
    parser.add_argument('--layers', type=int,
                        default=LLAMA_100M['num_layers'])
    parser.add_argument('--heads', type=int, default=LLAMA_100M['num_heads'])
    args = parser.parse_args()
    args.model = dict(dim=args.dim, num_layers=args.layers,
                      num_heads=args.heads)
    if args.llama:
        main_llama(args)
        return
    torch.set_num_threads(1)
    model, optim = build(args.params)
    count = sum(p.numel() for p in model.parameters())
    print(f'{count / 1e6:.1f} M parameters, '
          f'{count * 12 / 2**20:.0f} MiB with AdamW state')
    print('| format | save | blocking (s) | until written (s) |')
    print('|---|---|---|---|')
    with tempfile.TemporaryDirectory() as directory:
        for name, save in (('full', save_full), ('sharded', save_dcp)):
            for use_async in (False, True):
                blocked, total = measure(save, model, optim, directory,
                                         use_async, args.repeats)
                kind = 'async_save' if use_async else 'synchronous'
                print(f'| {name} | {kind} | {blocked:.2f} | {total:.2f} |')


if __name__ == '__main__':
    main()
