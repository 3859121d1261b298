"""How long a checkpoint save blocks training, synchronous vs ``async_save``.

One process, no process group: a stack of Linear layers (``--params``
millions of parameters) with AdamW state, saved in both formats through
mmpar's own save functions, synchronously and with a background write
(:mod:`mmpar.checkpoint.background`). "blocking" is what the train loop
waits for (the whole save, or only the staging); "write" is the time until
the background write is complete. Median of ``--repeats``.

    PYTHONPATH=$PWD python benchmarks/bench_async_checkpoint.py [--params 25]

``--llama``: the judged case instead, through the launcher: the shipped
``llama_shakespeare_fsdp2.py`` widened to ~100 M parameters (dim 1024, 8
layers), FSDP2 on ``--nproc`` ranks, sharded checkpoints every
``--interval`` iterations, once with ``async_save`` off and once on. Every
iteration is clocked after all hooks (``benchmarks/_iter_clock.py``: the
save's blocking part included), slowest rank; the table gives the median
normal iteration, the median iteration that saves, and their ratio.

    PYTHONPATH=$PWD python benchmarks/bench_async_checkpoint.py --llama
"""
import argparse
import os
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


ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
LLAMA_100M = dict(dim=1024, num_layers=8, num_heads=8)


def llama_config(directory: str, use_async: bool, iters: int,
                 interval: int, context: int) -> str:
    """The 100 M Llama under FSDP2, sharded saves, clocked iterations."""
    path = osp.join(directory, f'llama_async_{use_async}.py')
    model = ', '.join(f'{k}={v}' for k, v in LLAMA_100M.items())
    with open(path, 'w') as f:
        f.write('\n'.join([
            f"_base_ = ['{ROOT}/configs/llama_shakespeare/"
            "llama_shakespeare_fsdp2.py']",
            f'model = dict({model}, max_seq_len={context})',
            'train_dataloader = dict(batch_size=1, dataset=dict('
            f'context_length={context}))',
            f'train_cfg = dict(max_iters={iters}, val_interval={iters + 1})',
            'val_dataloader = val_cfg = val_evaluator = None',
            'test_dataloader = test_cfg = test_evaluator = None',
            "default_hooks = dict(logger=dict(interval=1), checkpoint=dict("
            f"type='CheckpointHook', by_epoch=False, interval={interval}, "
            f'max_keep_ckpts=1, async_save={use_async}))',
            "custom_imports = dict(imports=['benchmarks._iter_clock'], "
            'allow_failed_imports=False)',
            "custom_hooks = [dict(type='IterClock')]",
        ]) + '\n')
    return path


def split_saving(seconds: list, interval: int):
    """Iteration seconds by kind: ``saves`` (the iteration that saves),
    ``after`` (the one after it: an asynchronous write goes on beside it)
    and ``normal`` (the rest). The first iteration (warm-up) and the last
    (no iteration after its save) are left out."""
    kinds = dict(normal=[], saves=[], after=[])
    for index, value in enumerate(seconds[1:-1], start=2):
        kind = ('saves' if index % interval == 0 else
                'after' if index % interval == 1 else 'normal')
        kinds[kind].append(value)
    return kinds


def run_llama(args) -> None:
    import subprocess

    from benchmarks._iter_clock import iteration_seconds
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep +
               os.environ.get('PYTHONPATH', ''))
    print(f'100 M Llama (dim {LLAMA_100M["dim"]}, {LLAMA_100M["num_layers"]}'
          f' layers), FSDP2, {args.nproc} ranks, 1 window of {args.context} '
          f'tokens per rank, a sharded save every {args.interval} '
          f'iterations, {args.iters} iterations')
    print('| async_save | normal iteration (s) | iteration that saves (s) '
          '| iteration after it (s) | saving / normal (synchronous run) |')
    print('|---|---|---|---|---|')
    base = None
    with tempfile.TemporaryDirectory() as directory:
        for use_async in (False, True):
            config = llama_config(directory, use_async, args.iters,
                                  args.interval, args.context)
            work_dir = osp.join(directory, f'work_{use_async}')
            proc = subprocess.run(
                ['bash', 'tools/dist_train.sh', config, str(args.nproc),
                 '--work-dir', work_dir], cwd=ROOT, env=env,
                capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
            kinds = {k: statistics.median(v) for k, v in split_saving(
                iteration_seconds(work_dir), args.interval).items()}
            if base is None:  # the synchronous run's normal iteration
                base = kinds['normal']
            print(f'| {use_async} | {kinds["normal"]:.2f} | '
                  f'{kinds["saves"]:.2f} | {kinds["after"]:.2f} | '
                  f'{kinds["saves"] / base:.2f}x |', flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--params', type=int, default=25,
                        help='millions of parameters (default 25)')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--llama', action='store_true',
                        help='the 100 M Llama under FSDP2 through the '
                        'launcher (see above)')
    parser.add_argument('--nproc', type=int, default=4)
    parser.add_argument('--iters', type=int, default=14)
    parser.add_argument('--interval', type=int, default=4)
    parser.add_argument('--context', type=int, default=128)
    args = parser.parse_args()
    if args.llama:
        return run_llama(args)
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
