"""How long a checkpoint save blocks training, synchronous vs ``async_save``.

One process, no process group: a stack of Linear layers (``--params``
millions of parameters) with AdamW state, saved in both formats through
mmpar's own save functions, synchronously and with a background write
(:mod:`mmpar.checkpoint.background`). "blocking" is what the train loop
waits for (the whole save, or only the staging); "write" is the time until
the background write is complete. Median of ``--repeats``.

    PYTHONPATH=$PWD python benchmarks/bench_async_checkpoint.py [--params 25]
"""
import argparse
import os.path as osp
import statistics
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--params', type=int, default=25,
                        help='millions of parameters (default 25)')
    parser.add_argument('--repeats', type=int, default=3)
    args = parser.parse_args()
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
