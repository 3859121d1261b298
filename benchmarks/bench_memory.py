"""Memory of models larger than one rank: the build, a model no rank could
hold whole, and activation checkpointing.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py [--out docs] \\
        [--sections build,big,ac]

* ``build``: peak RSS per rank (VmHWM, above the RSS after imports and the
  process group) until the model is built and sharded, and until its first
  optimizer step, for the ~100 M-parameter Llama (dim 1024, 8 blocks) under
  FSDP2 at 1, 2, 4 and 8 gloo ranks and under tp=2, pp=2 and
  pp=2 x tp=2 x FSDP2 at 8, built on the meta device and built whole;
  next to full/N + one block.
* ``big``: a ~0.8 B-parameter Llama (3 GiB in fp32: 8 whole copies do not
  fit this machine's 24 GiB) trained a few steps under FSDP2 and under
  pp=2 x FSDP2 at 8 ranks, built on the meta device: peak per rank, step
  time, loss.
* ``ac``: activation memory of one micro-batch (peak RSS during forward and
  backward, above the RSS before) and step time for activation
  checkpointing none / full / every 2nd block / selective, on one process
  and FSDP2 at 2, next to the plan tool's estimate.

Each row runs in freshly spawned processes. They run with glibc's mmap
threshold fixed at 1 MiB (``MALLOC_MMAP_THRESHOLD_=1048576``, unless the
environment sets one or ``--default-malloc`` is given): with glibc's sliding
default, FSDP's freed per-parameter buffers stay in heap arenas and the
peak RSS runs hundreds of MiB above the live tensors (docs/big_models.md,
training memory on CPU).
"""
import argparse
import os
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks._common import (measure_on_ranks,  # noqa: E402
                                measured_section)
from benchmarks._steps import read_status_kb  # noqa: E402

SECTION = '## Memory: building on the meta device, big models, activations'
LLAMA_100M = dict(type='Llama', vocab_size=256, dim=1024, num_layers=8,
                  num_heads=8, max_seq_len=256)
LLAMA_BIG = dict(type='Llama', vocab_size=256, dim=2048, num_layers=16,
                 num_heads=16, max_seq_len=256)
FSDP2 = dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
    type='module_class', module_classes=['LlamaBlock']))
PIPE = dict(schedule='1F1B', num_microbatches=2)
# The big model's layouts at 8 ranks: (label, parallel section). Under pp
# each FSDP2 stage reshards and reduce-scatters after every micro-batch
# (parallel.pipeline.reshard_per_microbatch, the default); with torch's
# schedule behaviour the stage stays gathered twice and 8 ranks do not fit
# (docs/pipeline_parallel.md).
BIG_ROWS = [('FSDP2', None), ('pp=2 x FSDP2', dict(pp=2, pipeline=PIPE))]
# (label, world size, parallel section)
BUILD_ROWS = [
    ('FSDP2', 1, None),
    ('FSDP2', 2, None),
    ('FSDP2', 4, None),
    ('FSDP2', 8, None),
    ('tp=2 x FSDP2', 8, dict(tp=2, tp_plan='llama')),
    ('pp=2 x FSDP2', 8, dict(pp=2, pipeline=PIPE)),
    ('pp=2 x tp=2 x FSDP2', 8, dict(pp=2, tp=2, tp_plan='llama',
                                    pipeline=PIPE)),
]
AC_MODES = [('none', None),
            ('full', dict(module_classes=['LlamaBlock'])),
            ('every 2nd', dict(module_classes=['LlamaBlock'], every=2)),
            ('selective', dict(module_classes=['LlamaBlock'],
                               mode='selective'))]
MB = 2**20


def _peak_since(start_kb: int) -> int:
    return (read_status_kb('VmHWM') - start_kb) * 1024


def _reset_peak() -> int:
    from benchmarks._steps import reset_peak_rss
    return reset_peak_rss() or read_status_kb('VmRSS')


def _batch(model_cfg: dict, batch: int, seq: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model_cfg['vocab_size'], (batch, seq + 1),
                           generator=gen)
    return dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:])


def _build(model_cfg: dict, parallel, meta: bool):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from mmpar.parallelize.meta import build_on_meta
    from mmpar.registry import MODELS
    topology = setup_parallelism(parallel, FSDP2) \
        if dist.get_world_size() > 1 else None
    torch.manual_seed(0)
    build = lambda: MODELS.build(dict(model_cfg))  # noqa: E731
    if meta and topology is not None:
        model, init = build_on_meta(build)
        return parallelize(model, topology, parallel, FSDP2, meta_init=init,
                           device=torch.device('cpu')), topology
    model = build()
    return parallelize(model, topology, parallel, FSDP2), topology


def _gather(value) -> List:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def measure_build(model_cfg: dict, parallel, meta: bool, steps: int = 1,
                  batch: int = 1, seq: int = 64) -> Dict:
    """On every rank: build, shard, ``steps`` optimizer steps on one batch
    per data rank (seen again each step, so the loss falls); peaks."""
    from mmpar.optim import OptimWrapper
    start = _reset_peak()
    began = time.perf_counter()
    model, topology = _build(model_cfg, parallel, meta)
    build_s = time.perf_counter() - began
    build_peak = _peak_since(start)
    optim_wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(),
                                                   lr=1e-4),
                                 clip_grad=dict(max_norm=1.0))
    dp_rank = topology.dp_rank if topology is not None else 0
    losses, times = [], []
    for step in range(steps):
        began = time.perf_counter()
        log_vars = model.train_step(
            _batch(model_cfg, batch, seq, seed=dp_rank),
            optim_wrapper)
        times.append(time.perf_counter() - began)
        loss = log_vars['loss']
        losses.append(float(loss.detach() if torch.is_tensor(loss) else loss))
    step_peak = _peak_since(start)
    rows = _gather(dict(build=build_peak, step=step_peak, build_s=build_s,
                        step_s=times, losses=losses))
    return dict(ranks=rows)


def _sizes(model_cfg: dict) -> Dict[str, int]:
    from mmpar.parallelize.meta import build_on_meta
    from mmpar.registry import MODELS
    model, _ = build_on_meta(lambda: MODELS.build(dict(model_cfg)),
                             init_weights=False)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size()
                for p in model.layers['0'].parameters())
    return dict(params=sum(p.numel() for p in model.parameters()), full=full,
                block=block)


def build_rows() -> List[dict]:
    sizes = _sizes(LLAMA_100M)
    rows = []
    for label, world, parallel in BUILD_ROWS:
        for meta in (True, False):
            if world == 1 and not meta:
                continue  # one process builds whole anyway
            result = measure_on_ranks(measure_build, world, LLAMA_100M,
                                      parallel, meta)
            ranks = result['ranks']
            rows.append(dict(
                layout=label, world=world, meta=meta and world > 1,
                build=max(r['build'] for r in ranks),
                step=max(r['step'] for r in ranks),
                build_s=max(r['build_s'] for r in ranks),
                bound=sizes['full'] / world + sizes['block']))
            print(f'{label} N={world} meta={meta}: build '
                  f'{rows[-1]["build"] / MB:.0f} MiB', file=sys.stderr)
    return [dict(sizes=sizes)] + rows


def big_rows(steps: int, layouts: Optional[List[str]] = None
             ) -> List[dict]:
    """The big model's rows (``layouts``: labels of BIG_ROWS, all if
    None); the loss is the last rank's (under pp: the last stage's)."""
    sizes = _sizes(LLAMA_BIG)
    rows = []
    for label, parallel in BIG_ROWS:
        if layouts is not None and label not in layouts:
            continue
        result = measure_on_ranks(measure_build, 8, LLAMA_BIG, parallel,
                                  True, steps, 2)
        ranks = result['ranks']
        rows.append(dict(
            layout=label, build=max(r['build'] for r in ranks),
            step=max(r['step'] for r in ranks),
            peaks=[r['step'] for r in ranks],
            step_s=[max(r['step_s'][i] for r in ranks)
                    for i in range(steps)],
            losses=ranks[-1]['losses']))
        print(f'big {label}: step peak {rows[-1]["step"] / MB:.0f} MiB '
              f'(ranks: {[round(p / MB) for p in rows[-1]["peaks"]]}), '
              f'build {rows[-1]["build"] / MB:.0f} MiB, steps '
              f'{rows[-1]["step_s"]}, losses {rows[-1]["losses"]}',
              file=sys.stderr)
    return [dict(sizes=sizes)] + rows


def measure_ac(ac_cfg, batch: int, seq: int, steps: int) -> Dict:
    """Activation memory of a micro-batch and step time for ``ac_cfg``."""
    from mmpar.optim import OptimWrapper
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from mmpar.registry import MODELS
    model_cfg = dict(LLAMA_100M, max_seq_len=seq)
    world = dist.get_world_size()
    topology = setup_parallelism(None, FSDP2) if world > 1 else None
    torch.manual_seed(0)
    model = parallelize(MODELS.build(model_cfg), topology, None,
                        FSDP2 if world > 1 else None,
                        activation_checkpointing=ac_cfg)
    optim_wrapper = OptimWrapper(torch.optim.AdamW(model.parameters(),
                                                   lr=1e-4))
    data = _batch(model_cfg, batch, seq, seed=dist.get_rank())
    model.train_step(data, optim_wrapper)  # warm-up: optimizer state made
    start = _reset_peak()
    began = time.perf_counter()
    for _ in range(steps):
        model.train_step(data, optim_wrapper)
    step_s = (time.perf_counter() - began) / steps
    return dict(ranks=_gather(dict(act=_peak_since(start), step_s=step_s)))


def ac_rows(batch: int, seq: int, steps: int) -> List[dict]:
    from mmpar.analysis.activations import activation_bytes
    rows = []
    for world in (1, 2):
        for label, ac_cfg in AC_MODES:
            result = measure_on_ranks(measure_ac, world, ac_cfg, batch, seq,
                                      steps)
            ranks = result['ranks']
            estimate = activation_bytes(dict(LLAMA_100M, max_seq_len=seq),
                                        batch, seq, ac_cfg)
            rows.append(dict(world=world, mode=label,
                             act=max(r['act'] for r in ranks),
                             step_s=max(r['step_s'] for r in ranks),
                             estimate=estimate))
            print(f'ac N={world} {label}: {rows[-1]["act"] / MB:.0f} MiB '
                  f'(estimate {estimate / MB:.0f})', file=sys.stderr)
    return rows


def format_report(results: Dict[str, List[dict]], meta: dict) -> str:
    malloc = os.environ.get('MALLOC_MMAP_THRESHOLD_')
    lines = [f'{meta["machine"]}; {meta["date"]}; load average '
             f'{meta["load_before"]:.2f} before, {meta["load_after"]:.2f} '
             f'after; `python benchmarks/bench_memory.py`; malloc: '
             + (f'`MALLOC_MMAP_THRESHOLD_={malloc}`' if malloc else
                "glibc's default") + '.', '']
    if 'build' in results:
        sizes, rows = results['build'][0]['sizes'], results['build'][1:]
        lines += [
            f'**Build peak per rank**, Llama {sizes["params"]:,} parameters '
            f'({sizes["full"] / MB:.0f} MiB fp32; one block '
            f'{sizes["block"] / MB:.0f} MiB), gloo, peak RSS above the RSS '
            'after imports and the process group (the worst rank):', '',
            '| layout | ranks | built on | build peak | bound full/N + one '
            'block | ratio | peak through the first AdamW step |',
            '|---|---:|---|---:|---:|---:|---:|']
        for r in rows:
            lines.append(
                f'| {r["layout"]} | {r["world"]} | '
                f'{"meta" if r["meta"] else "whole"} | '
                f'{r["build"] / MB:.0f} MiB | {r["bound"] / MB:.0f} MiB | '
                f'{r["build"] / r["bound"]:.2f} | {r["step"] / MB:.0f} MiB |')
        lines.append('')
    if 'big' in results:
        sizes, rows = results['big'][0]['sizes'], results['big'][1:]
        lines += [
            f'**A model no rank holds whole**: Llama {sizes["params"]:,} '
            f'parameters ({sizes["full"] / 2**30:.2f} GiB fp32; 8 whole '
            f'copies = {8 * sizes["full"] / 2**30:.1f} GiB, against this '
            "machine's 24 GiB), 8 gloo ranks, built on the meta device, "
            'AdamW, batch 2 x 64 tokens per data rank:', '',
            '| layout | build peak / rank | peak through the steps / rank '
            '(ranks: lowest-highest) | step times | loss |',
            '|---|---:|---:|---|---|']
        for r in rows:
            times = ', '.join(f'{t:.1f} s' for t in r['step_s'])
            losses = ' -> '.join(f'{x:.3f}' for x in r['losses'])
            lines.append(f'| {r["layout"]} | {r["build"] / MB:.0f} MiB | '
                         f'{r["step"] / MB:.0f} MiB ({min(r["peaks"]) / MB:.0f}'
                         f'-{max(r["peaks"]) / MB:.0f}) | {times} | '
                         f'{losses} |')
        lines.append('')
    if 'ac' in results:
        lines += [
            '**Activation checkpointing**, Llama 100 M, one micro-batch: '
            'peak RSS during a training step above the RSS before it (the '
            'saved activations and the gradients backward makes meanwhile: '
            'up to 388 MiB on 1 rank, 194 MiB a rank on 2), step time, and '
            'the plan tool\'s activation estimate (activations alone):', '',
            '| ranks | mode | measured | estimate | step time |',
            '|---:|---|---:|---:|---:|']
        for r in results['ac']:
            lines.append(f'| {r["world"]} | {r["mode"]} | '
                         f'{r["act"] / MB:.0f} MiB | '
                         f'{r["estimate"] / MB:.0f} MiB | '
                         f'{r["step_s"]:.2f} s |')
        lines.append('')
    return '\n'.join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--out', help='write the section of OUT/benchmarks.md')
    parser.add_argument('--sections', default='build,big,ac')
    parser.add_argument('--big-steps', type=int, default=3)
    parser.add_argument('--big-layouts', default=None,
                        help='comma-separated labels of BIG_ROWS (default: '
                        'all), e.g. "pp=2 x FSDP2"')
    parser.add_argument('--ac-batch', type=int, default=4)
    parser.add_argument('--ac-seq', type=int, default=256)
    parser.add_argument('--ac-steps', type=int, default=2)
    parser.add_argument('--default-malloc', action='store_true',
                        help="keep glibc's sliding mmap threshold")
    args = parser.parse_args(argv)
    if not args.default_malloc:
        # Read by each rank's C library at start-up (ranks are spawned).
        os.environ.setdefault('MALLOC_MMAP_THRESHOLD_', str(1 << 20))
    wanted = args.sections.split(',')

    def measure():
        results = {}
        if 'build' in wanted:
            results['build'] = build_rows()
        if 'big' in wanted:
            results['big'] = big_rows(
                args.big_steps, args.big_layouts and
                args.big_layouts.split(','))
        if 'ac' in wanted:
            results['ac'] = ac_rows(args.ac_batch, args.ac_seq,
                                    args.ac_steps)
        return results

    print(measured_section(SECTION, args.out, 8, measure, format_report))
    return 0


if __name__ == '__main__':
    sys.exit(main())
