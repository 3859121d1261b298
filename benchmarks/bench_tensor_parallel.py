"""Tensor parallelism next to DDP and FSDP2: time, memory, communication.

    PYTHONPATH=$PWD python benchmarks/bench_tensor_parallel.py [--quick] [--out docs]

Trains the user model of ``examples/my_pkg/tp_vit.py`` (attention and MLP
both splittable, i.e. the Megatron-LM layout) made wider, on 2 ranks (DDP
dp=2, FSDP2 dp=2, tp=2) and on 4 ranks (DDP dp=4, tp=2 x DDP dp=2, tp=2 x
FSDP2 dp=2), the same global batch everywhere, and reports per layout:

* the median step time of the slower rank;
* per-rank model-state bytes (parameters + gradients + AdamW state, local
  shards) and the split layers' share of them (goal: 1/tp);
* bytes communicated per step, tensor-parallel activations (DTensor's
  functional collectives, counted by a dispatch mode) and gradient
  collectives (``torch.distributed`` calls) apart, against the Megatron
  model: 2 all-reduces of the activations per split block per pass
  (forward and backward), i.e. ``4 * depth * batch * tokens * dim * 4``
  bytes of fp32 per step.

Writes the ``## Tensor parallelism`` section of ``OUT/benchmarks.md``.
"""
import argparse
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (counting_collectives,  # noqa: E402
                                machine_description, measure_on_ranks,
                                median, slowest_rank, time_steps, utc_now,
                                write_section)

SECTION = '## Tensor parallelism'
MODEL = dict(embed_dim=256, depth=4, num_heads=8, mlp_ratio=4.0)
QUICK_MODEL = dict(embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)
GLOBAL_BATCH = 64
TOKENS = 16  # 8x8 images, 2x2 patches
# name -> (world size, tp, wrapper)
LAYOUTS = {
    'DDP dp=2': (2, 1, 'MMDistributedDataParallel'),
    'FSDP2 dp=2': (2, 1, 'MMFullyShard'),
    'tp=2': (2, 2, 'MMDistributedDataParallel'),
    'DDP dp=4': (4, 1, 'MMDistributedDataParallel'),
    'tp=2 x DDP dp=2': (4, 2, 'MMDistributedDataParallel'),
    'tp=2 x FSDP2 dp=2': (4, 2, 'MMFullyShard'),
}


COLLECTIVES = ('all_reduce', 'reduce_scatter', 'all_gather', 'all_to_all',
               'broadcast')


class CountFunctionalCollectives(TorchDispatchMode):
    """``(op name, bytes)`` of every functional collective DTensor issues."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Not wait_tensor / _wrap_tensor_autograd: bookkeeping, no traffic.
        if func.namespace == '_c10d_functional' and \
                func.__name__.startswith(COLLECTIVES):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple))
                        for t in a if isinstance(t, torch.Tensor)]
            self.calls.append((func.__name__, sum(
                t.numel() * t.element_size() for t in tensors)))
        return func(*args, **(kwargs or {}))


def _build(model_kwargs: dict, tp: int, wrapper: str):
    from mmpar.optim import OptimWrapper

    from examples.my_pkg.tp_vit import TP_PLAN, SplittableViT
    from mmpar.device import device_type
    from mmpar.parallelize.tensor import apply_tp
    from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
    from mmpar.wrappers.builder import wrapper_class
    from torch.distributed.device_mesh import init_device_mesh
    torch.manual_seed(0)
    model = SplittableViT(**model_kwargs)
    world = dist.get_world_size()
    mesh = init_device_mesh(device_type(), (world // tp, tp),
                            mesh_dim_names=('dp', 'tp'))
    cfg = dict(type=wrapper)
    if tp > 1:
        apply_tp(model, mesh['tp'], dict(type='module_plan', plan=TP_PLAN))
        cfg = data_parallel_cfg_for_tp(cfg, tp)
    key = 'device_mesh' if wrapper == 'MMFullyShard' else 'process_group'
    cfg[key] = mesh['dp'] if key == 'device_mesh' else mesh['dp'].get_group()
    # Groups cannot be deep-copied, as build_model_wrapper does with a cfg.
    wrapped = wrapper_class(cfg.pop('type'))(module=model, **cfg)
    optimizer = torch.optim.AdamW(wrapped.module.parameters(), lr=1e-3)
    return wrapped, OptimWrapper(optimizer, clip_grad=dict(max_norm=1.0)), \
        mesh


def _split_bytes(model) -> Dict[str, int]:
    from torch.distributed.tensor import DTensor
    local = full = 0
    for name, param in model.named_parameters():
        if any(part in name for part in ('.attn.', '.mlp.')) and \
                name.endswith('weight'):
            full += param.numel() * param.element_size()
            local += (param.to_local() if isinstance(param, DTensor) else
                      param).numel() * param.element_size()
    return dict(split_local=local, split_full=full)


def measure_layout(name: str, model_kwargs: dict, steps: int) -> dict:
    """One layout on the current process group; collective."""
    from benchmarks._steps import model_state_bytes
    _, tp, wrapper = LAYOUTS[name]
    wrapped, optim_wrapper, mesh = _build(model_kwargs, tp, wrapper)
    dp, dp_rank = mesh['dp'].size(), mesh['dp'].get_local_rank()
    gen = torch.Generator().manual_seed(dp_rank)
    batch = dict(
        inputs=torch.randn(GLOBAL_BATCH // dp, 1, 8, 8, generator=gen),
        data_samples=torch.randint(0, 10, (GLOBAL_BATCH // dp, ),
                                   generator=gen))

    def step():
        wrapped.train_step(batch, optim_wrapper)

    time_steps(step, 2)  # warm-up
    times = slowest_rank(time_steps(step, steps))
    # One forward and backward through the wrapper, counted; its gradients
    # stay for the model-state bytes.
    counter = CountFunctionalCollectives()
    with counting_collectives() as grad_calls, counter:
        wrapped(**batch, mode='loss')['loss'].backward()
    state = model_state_bytes(optim_wrapper.optimizer)
    optim_wrapper.zero_grad()
    d = model_kwargs['embed_dim']
    megatron = (4 * model_kwargs['depth'] * (GLOBAL_BATCH // dp) * TOKENS *
                d * 4) if tp > 1 else 0
    return dict(
        layout=name, step_s=median(times), state=sum(state.values()),
        **_split_bytes(wrapped.module),
        tp_bytes=sum(b for _, b in counter.calls),
        tp_calls=len(counter.calls),
        grad_bytes=sum(b for _, b in grad_calls), megatron_bytes=megatron)


def measure_layouts(names, model_kwargs, steps) -> List[dict]:
    return [measure_layout(n, model_kwargs, steps) for n in names]


def measure(quick: bool) -> List[dict]:
    model_kwargs = QUICK_MODEL if quick else MODEL
    steps = 3 if quick else 20
    rows = []
    for world in (2, 4):
        names = [n for n, (w, _, _) in LAYOUTS.items() if w == world]
        rows += measure_on_ranks(measure_layouts, world, names,
                                 model_kwargs, steps)
    return rows


def _mib(nbytes: float) -> str:
    return f'{nbytes / 2**20:.2f}'


def format_report(rows: List[dict], quick: bool) -> str:
    model_kwargs = QUICK_MODEL if quick else MODEL
    lines = [
        f'`{sys.argv[0] if __name__ == "__main__" else __file__}`, '
        f'{machine_description("gloo", 4)}, {utc_now()}. The user model of '
        '`examples/my_pkg/tp_vit.py` with '
        f'{", ".join(f"{k}={v}" for k, v in model_kwargs.items())}, global '
        f'batch {GLOBAL_BATCH} of {TOKENS} tokens, AdamW, clipping.', '',
        '| layout | step (ms) | model state / rank (MiB) | split weights / '
        'rank (of full) | TP bytes / step (MiB) | TP collectives | Megatron '
        'model (MiB) | gradient bytes / step (MiB) |',
        '|---|---|---|---|---|---|---|---|',
    ]
    for r in rows:
        # torch DDP reduces in C++, out of the counter's sight.
        grad = ('(C++)' if r['layout'].startswith('DDP') else
                _mib(r['grad_bytes']))
        ratio = r['split_local'] / max(r['split_full'], 1)
        lines.append(
            f'| {r["layout"]} | {r["step_s"] * 1000:.1f} | '
            f'{_mib(r["state"])} | {ratio:.2f} | {_mib(r["tp_bytes"])} | '
            f'{r["tp_calls"]} | {_mib(r["megatron_bytes"])} | '
            f'{grad} |')
    lines += [
        '', 'TP bytes are the inputs of the functional collectives DTensor '
        'issues in one forward and backward; the Megatron model counts 2 '
        'all-reduces of the block activations per split block and pass. '
        'The attention\'s `prepare_input` entry makes q/k/v share one '
        'all-reduce of their input gradient in backward (without it each '
        'makes its own: 6 collectives per block and step instead of 4). '
        'FSDP2 rows also all-gather parameters, not '
        'counted here; torch DDP reduces in C++, out of the counter\'s '
        'sight. Step times come from 2 shared CPU cores running up to 4 '
        'ranks: compare rows of one world size only, and expect TP to cost '
        'time on CPU (its activation all-reduces sit on the critical path).',
        ''
    ]
    return '\n'.join(lines)


def write(quick: bool, out: str) -> str:
    """Measure, rewrite the section of ``out/benchmarks.md``, return it."""
    report = format_report(measure(quick), quick)
    write_section(os.path.join(out, 'benchmarks.md'), SECTION, report)
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--out', default=os.path.join(ROOT, 'docs'))
    args = parser.parse_args()
    start = time.time()
    print(write(args.quick, args.out))
    print(f'({time.time() - start:.0f} s)', file=sys.stderr)


if __name__ == '__main__':
    main()
