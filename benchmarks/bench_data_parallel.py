"""Data-parallel wrappers side by side on gloo ranks, one invocation.

Runs torch DDP (MMEngine's loop around it), ``MMDistributedDataParallel``,
``MMNaiveDataParallel`` and ``MMBucketDataParallel`` on (a) many small
parameter tensors and (b) few large ones, and prints a Markdown table:
median step time, ratio to torch DDP, all-reduce calls and bytes per step
against the ring all-reduce lower bound.

    PYTHONPATH=$PWD python benchmarks/bench_data_parallel.py \
        [--out docs/benchmarks.md]

Timing and counting are separate passes: counting patches
``torch.distributed.all_reduce`` and gives DDP a Python comm hook (which goes
through that function), so the timed runs carry no instrumentation.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmpar.optim import OptimWrapper
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import (counting_collectives,  # noqa: E402
                                machine_description, median, slowest_rank,
                                spawn, time_steps, utc_now, write_section)
from mmpar.wrappers import (MMBucketDataParallel,  # noqa: E402
                            MMDistributedDataParallel, MMNaiveDataParallel)

SECTION = '## Data-parallel wrappers'
NOTES = '''Reading the table:

- `python benchmarks/bench_data_parallel.py --out docs/benchmarks.md`
  regenerates this section (about 2 minutes on this machine).
- torch DDP and `MMDistributedDataParallel` run the same C++ reducer; the gap
  between their rows is the measurement noise of this shared machine.
- torch DDP makes 2 calls: its first bucket is capped at 1 MiB, the rest at
  25 MiB. `MMBucketDataParallel` fits either model in one 25 MiB bucket; its
  bytes include one flag per parameter (4 bytes each) that tells the ranks
  which parameters got a gradient.
- `MMNaiveDataParallel` makes one blocking call per parameter tensor: with
  many small tensors the per-call latency dominates; with few large ones it
  can even win here, since nothing competes with backward for the 2 cores.
- Every wrapper reduces each gradient byte exactly once, so all reach the
  ring all-reduce lower bound of 2(N-1)/N x gradient bytes sent per rank.'''
# name: (depth, width, batch per rank)
MODELS = {
    '(a) 128 x Linear(64, 64)': (128, 64, 16),
    '(b) 4 x Linear(1024, 1024)': (4, 1024, 16),
}
WRAPPERS = ('torch DDP', 'MMDistributedDataParallel', 'MMNaiveDataParallel',
            'MMBucketDataParallel')


class MLPStack(BaseModel):
    """``depth`` Linear(width, width) + tanh layers; MSE loss."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.layers = nn.Sequential(*[
            m for _ in range(depth) for m in (nn.Linear(width, width),
                                              nn.Tanh())
        ])

    def forward(self, inputs, targets=None, mode='tensor'):
        out = self.layers(inputs)
        if mode == 'loss':
            return dict(loss=F.mse_loss(out, targets))
        return out


class TorchDDPStep:
    """torch DDP driven the way MMEngine's own wrapper drives it."""

    def __init__(self, module, comm_hook=False):
        self.ddp = DistributedDataParallel(module)
        if comm_hook:
            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        self.module = module

    def train_step(self, data, optim_wrapper):
        with optim_wrapper.optim_context(self.ddp):
            data = self.module.data_preprocessor(data, training=True)
            losses = self.ddp(**data, mode='loss')
        loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(loss)
        return log_vars


def build(name, depth, width, counting=False):
    torch.manual_seed(0)
    model = MLPStack(depth, width)
    if name == 'torch DDP':
        wrapper = TorchDDPStep(model, comm_hook=counting)
    elif name == 'MMDistributedDataParallel':
        wrapper = MMDistributedDataParallel(model)
        if counting:
            wrapper.register_comm_hook(None, default_hooks.allreduce_hook)
    elif name == 'MMNaiveDataParallel':
        wrapper = MMNaiveDataParallel(model)
    else:
        wrapper = MMBucketDataParallel(model)
    optim_wrapper = OptimWrapper(torch.optim.SGD(model.parameters(), lr=1e-3))
    return wrapper, optim_wrapper


def make_data(width, batch, seed):
    gen = torch.Generator().manual_seed(seed)
    return dict(inputs=torch.randn(batch, width, generator=gen),
                targets=torch.randn(batch, width, generator=gen))


def count_collectives(name, depth, width, data, num_steps=3):
    wrapper, optim_wrapper = build(name, depth, width, counting=True)
    wrapper.train_step(data, optim_wrapper)  # DDP rebuilds buckets here
    with counting_collectives() as calls:
        for _ in range(num_steps):
            wrapper.train_step(data, optim_wrapper)
    return len(calls) / num_steps, sum(b for _, b in calls) / num_steps


def run_rank(rank, world_size, init_file, args, queue):
    os.environ['OMP_NUM_THREADS'] = '1'
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}',
                            rank=rank, world_size=world_size)
    rows, param_gaps = [], {}
    for model_name, (depth, width, batch) in MODELS.items():
        data = make_data(width, batch, seed=rank)
        built = {name: build(name, depth, width) for name in WRAPPERS}
        times = {name: [] for name in WRAPPERS}
        for name, (wrapper, optim_wrapper) in built.items():
            time_steps(lambda: wrapper.train_step(data, optim_wrapper),
                       args.warmup)
        # Interleave the wrappers so that load from other processes on the
        # machine hits them alike.
        for _ in range(args.rounds):
            for name, (wrapper, optim_wrapper) in built.items():
                times[name] += time_steps(
                    lambda: wrapper.train_step(data, optim_wrapper),
                    args.steps // args.rounds)
        grad_bytes = sum(p.numel() * p.element_size()
                         for p in built['torch DDP'][0].module.parameters())
        # Same start, data and step count: the wrappers must end with the
        # same parameters, or their timings compare different work.
        ddp_params = [p for p in built['torch DDP'][0].module.parameters()]
        param_gap = max(
            (p - q).abs().max().item() for name in WRAPPERS[1:]
            for p, q in zip(built[name][0].module.parameters(), ddp_params))
        param_gaps[model_name] = param_gap
        del built
        for name in WRAPPERS:
            step_times = slowest_rank(times[name])
            calls, nbytes = count_collectives(name, depth, width, data)
            rows.append((model_name, name, median(step_times), calls, nbytes,
                         grad_bytes))
    if rank == 0:
        queue.put((rows, param_gaps))
    dist.destroy_process_group()


def format_table(rows, param_gaps, world_size):
    ring = 2 * (world_size - 1) / world_size
    lines = [
        '| model | wrapper | median step (ms) | vs torch DDP | all-reduce '
        'calls / step | bytes reduced / step (MB) | ring bytes sent / rank '
        '(MB) | vs lower bound |',
        '|---|---|---:|---:|---:|---:|---:|---:|',
    ]
    baseline = {m: t for m, w, t, *_ in rows if w == 'torch DDP'}
    for model, name, step_s, calls, nbytes, grad_bytes in rows:
        lines.append(
            f'| {model} | {name} | {step_s * 1e3:.1f} | '
            f'{step_s / baseline[model]:.2f}x | {calls:g} | {nbytes / 1e6:.2f}'
            f' | {ring * nbytes / 1e6:.2f} | '
            f'{nbytes / grad_bytes:.3f}x |')
    lines.append('')
    lines.append(f'Lower bound: a ring all-reduce over N={world_size} ranks '
                 f'sends 2(N-1)/N = {ring:g} x the gradient bytes per rank; '
                 'gradient bytes per step: ' + ', '.join(
                     f'{m} {g / 1e6:.2f} MB' for m, g in {
                         r[0]: r[5]
                         for r in rows
                     }.items()) + '.')
    lines.append('')
    lines.append('Largest parameter difference to torch DDP after the run '
                 '(same start, data and steps): ' + ', '.join(
                     f'{m} {g:.1e}' for m, g in param_gaps.items()) + '.')
    lines += ['', NOTES]
    return '\n'.join(lines)


def protocol(args, load):
    return (f'{machine_description("gloo", args.world_size)}; '
            f'{args.warmup} warm-up + {args.steps} timed steps per wrapper, '
            f'interleaved in {args.rounds} rounds; median over steps of the '
            f'slower rank; run {utc_now()} UTC, load average before the run '
            f'{load:.1f} (other jobs shared the cores).')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--rounds', type=int, default=4)
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--out', help='Markdown file whose '
                        f'"{SECTION}" section is replaced with the results')
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows, param_gaps = spawn(run_rank, args.world_size, args)
    table = format_table(rows, param_gaps, args.world_size)
    body = f'Machine: {protocol(args, load)}\n\n{table}'
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)


if __name__ == '__main__':
    main()
