"""The language-model section of the benchmark report.

    PYTHONPATH=$PWD python benchmarks/bench_llm.py [--quick] [--out docs]
    PYTHONPATH=$PWD python benchmarks/bench_llm.py --device cuda   # one GPU

CPU (default): the Llama of ``configs/llama_shakespeare/llama_shakespeare.py``
on Tiny Shakespeare windows, 2 gloo ranks, through every mmpar data-parallel
layout and two hand-written torch loops on the same model (DDP, and FSDP2
with ``fully_shard`` on each block): tokens/s, the ratio against the
matching hand-written loop, per-rank model state (parameters + gradients +
AdamW state) and peak RSS rise. The strategies take turns step by step so
load from other jobs hits them alike (as ``benchmarks/run.py``).

CUDA (``--device cuda``, one process, one GPU): bf16 autocast, with and
without per-block ``torch.compile``, and one-GPU FSDP2: tokens/s and MFU
(model FLOPs from ``Llama.flops_per_token`` over the GPU's bf16 peak).
"""
import argparse
import copy
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._common import (measure_on_ranks,  # noqa: E402
                                measured_section, median, slowest_rank,
                                time_steps)

SECTION = '## Language model (Llama on Tiny Shakespeare)'
CONFIG_DIR = os.path.join(ROOT, 'configs', 'llama_shakespeare')
HAND_DDP = 'torch DDP, hand-written loop'
HAND_FSDP2 = 'torch FSDP2, hand-written loop'
# Each mmpar row is compared with the hand-written loop of its kind.
BASELINE_OF = {
    'MMDistributedDataParallel': HAND_DDP,
    'MMFullyShardedDataParallel': HAND_FSDP2,
    'MMFullyShard': HAND_FSDP2,
}


def load_plan(quick: bool, device: str = 'cpu') -> dict:
    """Model, layouts and optimizer from the shipped configs (plain data)."""
    from mmengine.config import Config

    def cfg(name):
        return Config.fromfile(os.path.join(CONFIG_DIR, name))

    base = cfg('llama_shakespeare.py')
    strategies = {
        HAND_DDP: dict(baseline='ddp'),  # benchmarks/baselines.py
        HAND_FSDP2: None,
        'MMDistributedDataParallel': cfg(
            'llama_shakespeare_ddp.py').model_wrapper_cfg.to_dict(),
        'MMFullyShardedDataParallel': cfg(
            'llama_shakespeare_fsdp.py').model_wrapper_cfg.to_dict(),
        'MMFullyShard': cfg(
            'llama_shakespeare_fsdp2.py').model_wrapper_cfg.to_dict(),
    }
    model = base.model.to_dict()
    if quick:
        model.update(dim=32, num_layers=2, num_heads=2)
    return dict(
        model=model,
        strategies=strategies,
        optim_wrapper=base.optim_wrapper.to_dict(),
        batch_size=2 if quick else 8,
        context_length=32 if quick else base.context_length,
        warmup=1 if quick else 3,
        steps=2 if quick else 40,
        device=device)


def token_batches(rank: int, world_size: int, batch_size: int,
                  context_length: int, num: int, device) -> List[dict]:
    """``num`` batches of training windows for this rank."""
    from mmpar.datasets import ShakespeareDataset
    data = ShakespeareDataset('train', context_length=context_length)
    batches = []
    for i in range(num):
        items = [data[(i * world_size + rank) * batch_size + j]
                 for j in range(batch_size)]
        batches.append({
            key: torch.stack([item[key] for item in items]).to(device)
            for key in ('inputs', 'data_samples')
        })
    return batches


class HandWrittenFSDP2:
    """The FSDP2 baseline: ``fully_shard`` on each block and the root, a
    plain forward / backward / clip / AdamW loop."""

    def __init__(self, model, optim_cfg: dict, device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (dist.get_world_size(), ))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        self.model = fully_shard(model, mesh=mesh)
        opt = dict(optim_cfg['optimizer'])
        assert opt.pop('type') == 'AdamW', opt
        self.optimizer = torch.optim.AdamW(model.parameters(), **opt)
        self.max_norm = (optim_cfg.get('clip_grad') or {}).get('max_norm')
        self.keep_grads = False

    def step(self, batch: dict) -> torch.Tensor:
        """One step; returns the loss (detached)."""
        loss = self.model(batch['inputs'], batch['data_samples'],
                          mode='loss')['loss']
        loss.backward()
        if self.max_norm is not None:
            # DTensor gradients: torch's clip computes the global norm.
            torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                           self.max_norm)
        self.optimizer.step()
        if not self.keep_grads:
            self.optimizer.zero_grad()
        return loss.detach()


def _build(name: str, plan: dict, device):
    from benchmarks import _steps as dp_bench
    if name == HAND_FSDP2:
        return HandWrittenFSDP2(dp_bench.build_model(plan['model'], device),
                                plan['optim_wrapper'], device)
    return dp_bench.build_step(plan['model'], plan['strategies'][name],
                               plan['optim_wrapper'], device)


def measure(plan: dict) -> List[dict]:
    """Memory pass (each layout built and warmed up in turn), then a timing
    pass (layouts take turns step by step); on every rank."""
    import mmpar.wrappers  # noqa: F401  (registers the wrappers)
    from benchmarks import _steps as dp_bench
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cpu')
    batches = token_batches(rank, world_size, plan['batch_size'],
                            plan['context_length'], 4, device)
    built, peak, state = {}, {}, {}
    for name in plan['strategies']:
        rss = dp_bench.reset_peak_rss()
        trainee = built[name] = _build(name, plan, device)
        trainee.run = dp_bench.cycling(trainee.step, batches)
        time_steps(trainee.run, plan['warmup'] - 1)
        trainee.keep_grads = True  # read state with gradients alive
        time_steps(trainee.run, 1)
        trainee.keep_grads = False
        peak[name] = dp_bench.peak_rss_since(rss)
        state[name] = sum(
            dp_bench.model_state_bytes(trainee.optimizer).values())
        trainee.optimizer.zero_grad()
        dp_bench.log(f'LLM {name}: built and warmed up')
    times: Dict[str, List[float]] = {name: [] for name in built}
    for _ in range(plan['steps']):
        for name, trainee in built.items():
            times[name] += time_steps(trainee.run, 1)
    tokens = world_size * plan['batch_size'] * plan['context_length']
    rows = []
    for name in plan['strategies']:
        step_times = slowest_rank(times[name])
        step_s = median(step_times)
        memory = torch.tensor([peak[name] or 0], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        rows.append(dict(strategy=name, step_s=step_s, step_times=step_times,
                         tokens_per_s=tokens / step_s, state_bytes=state[name],
                         peak_rss=int(memory.item())))
    return rows


def add_ratios(rows: List[dict]) -> None:
    by_name = {r['strategy']: r for r in rows}
    ddp_state = by_name[HAND_DDP]['state_bytes']
    for row in rows:
        baseline = BASELINE_OF.get(row['strategy'], row['strategy'])
        row['baseline'] = baseline
        row['vs_hand_written'] = (row['tokens_per_s'] /
                                  by_name[baseline]['tokens_per_s'])
        # Step i of a layout ran within one turn of its baseline's step i:
        # their ratio cancels most of the load both saw.
        row['paired'] = median([
            b / t for t, b in zip(row['step_times'],
                                  by_name[baseline]['step_times'])
        ])
        row['vs_ddp_state'] = row['state_bytes'] / ddp_state


def format_report(rows: List[dict], plan: dict, meta: dict) -> str:
    model = plan['model']
    lines = [
        f'Machine: {meta["machine"]}. Run {meta["date"]} UTC; load average '
        f'{meta["load_before"]:.1f} before and {meta["load_after"]:.1f} after '
        f'(1-minute; {os.cpu_count()} cores, shared with other jobs).', '',
        f'Protocol: `Llama` dim {model["dim"]} x {model["num_layers"]} '
        f'blocks, {plan["batch_size"]} windows of {plan["context_length"]} '
        f'bytes per rank, the config\'s AdamW + clip_grad; {plan["warmup"]} '
        f'warm-up and {plan["steps"]} timed steps per layout, taking turns '
        'step by step, the slower rank counting; tokens/s is global '
        '(all ranks) over the median step. *vs hand-written*: tokens/s over '
        'that of the plain torch loop of the same kind (DDP rows against '
        'torch DDP, FSDP rows against torch FSDP2 with `fully_shard` on each '
        'block), goal >= 0.98 for DDP and FSDP2; *step-paired*: the median '
        'over steps of baseline step time / layout step time, step i of '
        'each a turn apart (less sensitive to load from other jobs).', '',
        '| layout | tokens/s | vs hand-written | step-paired | model state / '
        'rank (MB) | vs DDP | peak RSS rise / rank (MB) |',
        '|---|---:|---:|---:|---:|---:|---:|',
    ]
    for row in rows:
        base = row['baseline'] == row['strategy']
        ratio = '(baseline)' if base else f'{row["vs_hand_written"]:.3f}x'
        paired = '' if base else f'{row["paired"]:.3f}x'
        lines.append(
            f'| {row["strategy"]} | {row["tokens_per_s"]:.0f} | {ratio} | '
            f'{paired} | '
            f'{row["state_bytes"] / 2**20:.2f} | '
            f'{row["vs_ddp_state"]:.2f}x | {row["peak_rss"] / 2**20:.1f} |')
    return '\n'.join(lines)


def run_cpu(quick: bool, out: Optional[str], world_size: int = 2) -> str:
    """Measure on ``world_size`` gloo ranks; rewrite the report section of
    ``out``/benchmarks.md when ``out`` is given; return the section."""
    plan = load_plan(quick)

    def measure_rows() -> List[dict]:
        rows = measure_on_ranks(measure, world_size, plan)
        add_ratios(rows)
        return rows

    return measured_section(SECTION, out, world_size, measure_rows,
                            lambda rows, meta: format_report(rows, plan,
                                                             meta))


# -- one GPU ------------------------------------------------------------------
def cuda_step_rate(model, batches: List[dict], steps: int) -> float:
    """Tokens/s of bf16-autocast training steps (AdamW, fused when
    available) on the current CUDA device."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch):
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(batch['inputs'], batch['data_samples'],
                         mode='loss')['loss']
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[:3]:  # warm-up (and compilation)
        step(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    torch.cuda.synchronize()
    tokens = steps * batches[0]['inputs'].numel()
    return tokens / (time.perf_counter() - start)


def run_cuda(model_cfg: dict, batch_size: int, context_length: int,
             steps: int) -> List[dict]:
    """bf16 tokens/s and MFU on one GPU: eager, per-block compile, and
    one-GPU FSDP2 (a 1-rank process group)."""
    from mmpar.parallelize.compile import apply_compile
    from mmpar.registry import MODELS
    from mmpar.runner.throughput import device_peak_flops
    device = torch.device('cuda', torch.cuda.current_device())
    model_cfg = dict(model_cfg, max_seq_len=context_length)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, 256, (batch_size, context_length + 1),
                               generator=gen).to(device)
        batches.append(dict(inputs=tokens[:, :-1],
                            data_samples=tokens[:, 1:]))
    peak = device_peak_flops()
    rows = []
    for name in ('eager', 'compile per block', 'FSDP2 (1 GPU)'):
        torch.manual_seed(0)
        model = MODELS.build(copy.deepcopy(model_cfg)).to(device)
        if name == 'compile per block':
            apply_compile(model, dict(per_block=True))
        if name.startswith('FSDP2'):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh('cuda', (1, ))
            for block in model.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        rate = cuda_step_rate(model, batches, steps)
        flops = rate * model.flops_per_token(context_length)
        rows.append(dict(variant=name, tokens_per_s=rate, flops_per_s=flops,
                         mfu=flops / peak if peak else None))
    return rows


def _init_single_process_group() -> None:
    if not dist.is_initialized():
        import tempfile
        fd, path = tempfile.mkstemp(prefix='mmpar_bench_')
        os.close(fd)
        os.unlink(path)
        dist.init_process_group('nccl', init_method=f'file://{path}',
                                rank=0, world_size=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--quick', action='store_true',
                        help='a tiny model, a step or two: a smoke run')
    parser.add_argument('--out', default=os.path.join(ROOT, 'docs'),
                        help='folder of benchmarks.md (CPU section)')
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu')
    parser.add_argument('--world-size', type=int, default=2)
    args = parser.parse_args()
    if args.device == 'cuda':
        if not torch.cuda.is_available():
            parser.error('--device cuda: no CUDA device is available')
        _init_single_process_group()
        import mmpar.models  # noqa: F401  (registers Llama)
        plan = load_plan(args.quick, 'cuda')
        for row in run_cuda(plan['model'], 64, 256, 5 if args.quick else 50):
            mfu = 'n/a' if row['mfu'] is None else f'{row["mfu"]:.3f}'
            print(f'{row["variant"]}: {row["tokens_per_s"]:.0f} tokens/s, '
                  f'{row["flops_per_s"] / 1e12:.2f} TFLOP/s, MFU {mfu}')
        dist.destroy_process_group()
        return
    print(run_cpu(args.quick, args.out, args.world_size))


if __name__ == '__main__':
    main()
