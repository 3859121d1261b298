"""The plan as text, and the ``tools/plan.py`` command line."""
import argparse
import os.path as osp
import sys
from typing import List, Optional

from mmengine.config import Config

from mmpar.analysis.memory import within_budget
from mmpar.analysis.plan import Plan, PlanError, make_plan
from mmpar.analysis.search_args import add_search_arguments
from mmpar.cfg_options import CfgOptionsAction
from mmpar.parallel.axes import (AXES, BY_NAME, DATA, FLATTENED, MODEL,
                                  SAMPLE_AXES)
from mmpar.parallel.dims import ParallelismError

# Axes on the gradient axis beyond the data axis (cp): ranks that read
# different tokens of the same samples.
TOKEN_AXES = tuple(a for a in FLATTENED['dp_cp'] if a not in SAMPLE_AXES)
ROLES = dict(reduce='all-reduces gradients over',
             shard='shards parameters over',
             replicate='replicates (all-reduces) across')


def _fmt_bytes(num: float) -> str:
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if num < 1024 or unit == 'GiB':
            return f'{num:.0f} {unit}' if unit == 'B' else f'{num:.2f} {unit}'
        num /= 1024


def _kinds(dims) -> tuple:
    """Group kinds in the order the report lists them: the data and model
    axes, fastest first, the data axis; then any other axis only when it
    is there (most plans have no cp), and the gradient axis it makes."""
    kinds = tuple(a for a in reversed(AXES)
                  if BY_NAME[a].role in (DATA, MODEL)) + ('dp', )
    more = tuple(a for a in reversed(AXES) if BY_NAME[a].role not in
                 (DATA, MODEL) and getattr(dims, a) > 1)
    return kinds + (more + ('dp_cp', ) if more else ())


def _layout_lines(plan: Plan) -> List[str]:
    dims, layout, rank = plan.dims, plan.layout, plan.rank
    sizes = ' '.join(f'{axis}={getattr(dims, axis)}' for axis in AXES)
    gradients = f'; gradients over dp_cp = dp x {" x ".join(TOKEN_AXES)} ' \
        f'= {dims.dp_cp}' if dims.dp_cp != dims.dp else ''
    lines = [f'world size {plan.world_size}: {sizes}; dp={dims.dp} '
             f'(mesh dims {AXES}, shape {dims.shape}; dp = dp_replicate x '
             f'dp_shard{gradients})']
    kinds = _kinds(dims)
    lines += [f'  {kind} groups: ' + ' '.join(map(str, layout.groups[kind]))
              for kind in kinds]
    mine = ', '.join(f'{kind} {layout.group_of(kind, rank)}'
                     for kind in kinds)
    return lines + [f'  rank {rank}: {mine}', '']


def _wrapper_lines(plan: Plan) -> List[str]:
    lines = [f'wrapper: {plan.wrapper_type} ({plan.wrapper_source})']
    for role, (axis, ranks) in plan.axes.items():
        lines.append(f'  {ROLES[role]} the {axis} axis: {ranks}')
    lines += [f'  {key}={value!r}' for key, value in plan.wrapper_args.items()]
    return lines + ['']


def _unit_lines(plan: Plan) -> List[str]:
    if not plan.units:
        return []
    lines = [f'FSDP units ({len(plan.units)}; policy: '
             f'{plan.policy or "none, root only"}; shard size '
             f'{plan.shard_size}):']
    width = max(len(u.name) for u in plan.units)
    for unit in plan.units:
        lines.append(f'  {unit.name:<{width}}  {unit.cls:<20} '
                     f'{unit.numel:>12,} params  '
                     f'{unit.numel_per_rank:>12,} per rank')
    return lines + ['']


def _memory_lines(plan: Plan) -> List[str]:
    held = f'; this rank: pp stage(s) {plan.pp_stages}' \
        if plan.pp_stages else ''
    count = f'{plan.param_numel:,} trainable params' \
        if plan.trainable_numel == plan.param_numel else \
        f'{plan.param_numel:,} params ({plan.trainable_numel:,} trainable)'
    lines = [f'per-rank memory (rank {plan.rank}; model {plan.model_cls}, '
             f'{count}, '
             f'{plan.param_bytes_per_elem} bytes each{held}):']
    total_count = total_bytes = 0
    for name, count, num_bytes in plan.memory:
        lines.append(f'  {name:<34} {count:>14,}  {_fmt_bytes(num_bytes):>11}')
        total_count += count
        total_bytes += num_bytes
    lines.append(f'  {"total":<34} {total_count:>14,}  '
                 f'{_fmt_bytes(total_bytes):>11}')
    return lines


def _estimate_lines(plan: Plan, budget: Optional[float]) -> List[str]:
    if plan.estimate is None:
        return []
    lines = ['', f'predicted memory of rank {plan.rank} (docs/topology.md, '
             '"Memory"):']
    for name, value in plan.estimate.rows():
        shown = value if isinstance(value, str) else _fmt_bytes(value)
        lines.append(f'  {name:<46} {shown:>11}')
    if budget is not None:
        verdict = 'fits' if fits(plan, budget) else 'DOES NOT FIT'
        lines.append(f'  --memory-budget {budget:g} GiB per rank: {verdict}')
    return lines


def fits(plan: Plan, budget_gib: float) -> bool:
    """Whether the predicted peak per rank is within ``budget_gib``."""
    return within_budget(plan.estimate.peak, budget_gib)


def format_plan(plan: Plan, budget: Optional[float] = None) -> str:
    """The plan as the text ``tools/plan.py`` prints."""
    lines = (_layout_lines(plan) + _wrapper_lines(plan) + _unit_lines(plan) +
             _memory_lines(plan) + _estimate_lines(plan, budget))
    lines += [f'note: {note}' for note in plan.notes]
    return '\n'.join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """``tools/plan.py``'s arguments (default: ``sys.argv[1:]``); bad ones
    exit 2 naming the argument."""
    parser = argparse.ArgumentParser(
        description='Dry-run a config at world size N (no processes, no GPU)')
    parser.add_argument('config', help='config file')
    parser.add_argument('--world-size', type=int, required=True)
    parser.add_argument(
        '--rank', type=int, default=0,
        help='the rank whose groups and memory are shown')
    parser.add_argument(
        '--cfg-options', nargs='+', action=CfgOptionsAction,
        help='override config keys, e.g. parallel.dp_replicate=2')
    parser.add_argument(
        '--memory-budget', type=float, metavar='GiB',
        help='memory per rank; the plan says whether the predicted peak '
        'fits (exit status 3 if it does not); with --search, layouts whose '
        'predicted peak exceeds it are not run')
    search = parser.add_argument_group(
        'layout search (--search): launch N local ranks that measure the '
        'layouts and write the fastest as a config (bash '
        'tools/dist_train.sh CONFIG N --search --search-only)')
    search.add_argument('--search', action='store_true',
                        help='search instead of printing one plan')
    add_search_arguments(search)
    args = parser.parse_args(argv)
    if not osp.isfile(args.config):
        parser.error(f'config {args.config!r} does not exist; allowed: a '
                     'config file')
    if args.world_size < 1:
        parser.error(f'--world-size={args.world_size} is not a number of '
                     'ranks; allowed: 1 or more')
    if not 0 <= args.rank < args.world_size:
        parser.error(f'--rank={args.rank} is outside --world-size='
                     f'{args.world_size}; allowed: 0 to '
                     f'{args.world_size - 1}')
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """``tools/plan.py``: print the plan, or ``error: ...`` and return 2."""
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    if args.search:
        from mmpar.analysis.search_report import search_main
        return search_main(args, cfg)
    try:
        plan = make_plan(cfg, args.world_size, args.rank)
    except (PlanError, ParallelismError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 2
    print(f'plan for {args.config}')
    print(format_plan(plan, args.memory_budget))
    if args.memory_budget is not None and not fits(plan, args.memory_budget):
        return 3
    return 0
