"""Dry-run a config at world size N in one process: groups, wrapper, memory.

``tools/plan.py CONFIG --world-size N`` calls :func:`make_plan` and prints
:func:`format_plan`. The topology is the real one: torch's fake process-group
backend lets one process act as rank ``r`` of ``N``, so ``init_parallelism``
and (for DDP) the real wrapper are built exactly as in training, while
collectives do nothing.
"""
import argparse
import copy
import functools
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch.distributed as dist
from mmengine.config import Config, DictAction
from mmengine.registry import DefaultScope
from torch import nn
from torch.distributed.fsdp.wrap import (_recursive_wrap,
                                         lambda_auto_wrap_policy,
                                         size_based_auto_wrap_policy)

from mmpar.parallel.config import (DDP_WRAPPER, ParallelConfig,
                                   default_wrapper_cfg)
from mmpar.parallel.layout import (DIMS, ParallelismError, ParallelLayout,
                                   check_sizes)
from mmpar.parallel.topology import init_parallelism, reset_parallelism
from mmpar.registry import FSDP_WRAP_POLICIES, MODELS, SCOPE

# Arguments only FSDP takes: on a DDP wrapper they are a mistake.
FSDP_ONLY_KEYS = ('cpu_offload', 'sharding_strategy', 'sync_module_states',
                  'fsdp_auto_wrap_policy', 'auto_wrap_policy',
                  'hybrid_shard_size', 'activation_checkpointing',
                  'mixed_precision', 'backward_prefetch', 'forward_prefetch',
                  'limit_all_gathers', 'use_orig_params', 'ignored_modules',
                  'param_init_fn', 'reshard_after_forward', 'mp_policy')
# Optimizer state per parameter element, in parameter-sized tensors.
OPTIMIZER_STATE_FACTORS = dict(
    Adam=2, AdamW=2, Adamax=2, NAdam=2, RAdam=2, Adagrad=1, Lion=1)
# Policies the plan understands itself when mmpar's FSDP wrappers (and their
# policy resolver) are not in this checkout.
BUILTIN_POLICIES = ('size_based', 'module_class')
# Where a wrapper config names its wrap policy: mmpar's FSDP wrappers, then
# MMEngine's / torch's spelling.
POLICY_KEYS = ('fsdp_auto_wrap_policy', 'auto_wrap_policy')


class PlanError(ValueError):
    """A config that cannot run at the requested world size."""


@dataclass
class FsdpUnit:
    """One FSDP unit: the module and the parameters its flat param holds."""
    name: str
    cls: str
    numel: int
    numel_per_rank: int


@dataclass
class Plan:
    """Everything :func:`format_plan` prints."""
    world_size: int
    rank: int
    layout: ParallelLayout
    wrapper_type: Optional[str]
    wrapper_source: str
    wrapper_args: dict
    model_cls: str
    param_numel: int
    param_bytes_per_elem: int
    shard_size: int = 1
    units: List[FsdpUnit] = field(default_factory=list)
    policy: Optional[str] = None
    memory: List[Tuple[str, int, int]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _type_name(wrapper_type) -> str:
    return getattr(wrapper_type, '__name__', str(wrapper_type))


def is_fsdp_type(wrapper_type) -> bool:
    """FSDP1 (``...FullyShardedDataParallel``) or FSDP2 (``...FullyShard``)."""
    name = _type_name(wrapper_type)
    return 'FullyShard' in name or name.upper().startswith('FSDP')


def is_fsdp2_type(wrapper_type) -> bool:
    """``fully_shard`` wrappers: each parameter sharded on its own."""
    name = _type_name(wrapper_type)
    return 'FullyShard' in name and 'FullySharded' not in name


def check_wrapper_against_parallel(wrapper_cfg: dict, explicit: bool,
                                   parallel: ParallelConfig) -> None:
    """Reject FSDP options on a non-FSDP wrapper and a use_fsdp mismatch.

    Raises:
        PlanError: naming the offending key.
    """
    wrapper_type = wrapper_cfg.get('type', DDP_WRAPPER)
    if is_fsdp_type(wrapper_type):
        return
    name = _type_name(wrapper_type)
    for key in FSDP_ONLY_KEYS:
        if key in wrapper_cfg:
            raise PlanError(
                f'model_wrapper_cfg.{key}={wrapper_cfg[key]!r} is an FSDP '
                f'option, but model_wrapper_cfg.type={name!r} is not FSDP; '
                'remove it or use MMFullyShardedDataParallel')
    if explicit and parallel.use_fsdp:
        raise PlanError(
            'parallel.use_fsdp=True but model_wrapper_cfg.type='
            f'{name!r} is not FSDP; use_fsdp only picks the wrapper when '
            'model_wrapper_cfg is absent: drop one of them')


def resolve_policy(policy_cfg, model: Optional[nn.Module] = None,
                   key: str = 'fsdp_auto_wrap_policy'
                   ) -> Tuple[Optional[Callable], Optional[str]]:
    """Turn a wrap-policy config (name, dict, callable or None) into a callable.

    mmpar's own resolver (``mmpar.wrappers.policies.resolve_wrap_policy``,
    the one the FSDP wrappers use) decides when it exists, so the plan and
    training agree. Without it, the plan understands ``size_based``
    (``min_num_params``) and ``module_class`` (``module_classes``: class
    names) itself.

    Returns:
        ``(policy, description)``; ``(None, None)`` for no policy.

    Raises:
        PlanError: an unknown policy or bad arguments, naming ``key``.
    """
    if policy_cfg is None:
        return None, None
    if callable(policy_cfg):
        return policy_cfg, getattr(policy_cfg, '__name__', repr(policy_cfg))
    if isinstance(policy_cfg, str):
        name, kwargs = policy_cfg, {}
    elif isinstance(policy_cfg, dict) and 'type' in policy_cfg:
        kwargs = dict(policy_cfg)
        name = kwargs.pop('type')
    else:
        raise PlanError(f'model_wrapper_cfg.{key}={policy_cfg!r} is not '
                        'allowed; allowed: a policy name or '
                        'dict(type=NAME, **kwargs)')
    description = f'{getattr(name, "__name__", name)}' + ''.join(
        f', {k}={v!r}' for k, v in kwargs.items())
    try:
        from mmpar.wrappers.policies import resolve_wrap_policy
    except ImportError:  # no FSDP wrappers in this checkout
        return _builtin_policy(name, kwargs, key), description
    try:
        return resolve_wrap_policy(policy_cfg, model), description
    except (TypeError, ValueError) as err:
        raise PlanError(f'model_wrapper_cfg.{key}: {err}') from err


def _builtin_policy(name, kwargs: dict, key: str) -> Callable:
    if name == 'size_based':
        return functools.partial(
            size_based_auto_wrap_policy,
            min_num_params=int(kwargs.get('min_num_params', int(1e8))))
    if name == 'module_class':
        classes = frozenset(kwargs.get('module_classes', ()))
        return functools.partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: type(m).__name__ in classes)
    raise PlanError(f'model_wrapper_cfg.{key}={name!r} is not a known '
                    f'policy; allowed: {", ".join(BUILTIN_POLICIES)}')


def fsdp_units(model: nn.Module, policy: Optional[Callable],
               shard_size: int, per_param: bool = False) -> List[FsdpUnit]:
    """The FSDP units ``policy`` makes of ``model``, root first.

    Runs ``torch.distributed.fsdp.wrap._recursive_wrap`` (what FSDP1 runs for
    a callable policy) with a wrapper that only records the module, so the
    units are torch's own choice. Each unit holds the parameters not inside a
    nested unit. FSDP1 flattens them into one parameter padded to a multiple
    of the shard size: a rank holds ``ceil(numel / shard_size)``. FSDP2
    (``per_param``) shards every parameter along dim 0, padded per parameter:
    a rank holds ``ceil(rows / shard_size) * row_numel`` for each.
    """
    chosen = []

    def record(module, **_):
        chosen.append(module)
        return module

    if policy is not None:
        _recursive_wrap(model, policy, record, set(), set(),
                        only_wrap_children=True)
    roots = [model] + [m for m in chosen if m is not model]
    names = {m: n for n, m in model.named_modules()}
    owner = {}
    # Inner units first: a parameter belongs to the innermost unit over it.
    depth = {m: len(names[m].split('.')) if names[m] else 0 for m in roots}
    for unit in sorted(roots, key=depth.get, reverse=True):
        for param in unit.parameters():
            owner.setdefault(param, unit)
    units = []
    for unit in roots:
        params = [p for p, u in owner.items() if u is unit]
        numel = sum(p.numel() for p in params)
        if per_param:
            per_rank = sum(
                math.ceil(p.shape[0] / shard_size) * (p.numel() // p.shape[0])
                if p.dim() else p.numel() for p in params)
        else:
            per_rank = math.ceil(numel / shard_size)
        units.append(
            FsdpUnit(names[unit] or '(root)', type(unit).__name__, numel,
                     per_rank))
    return units


def optimizer_state_factor(cfg: Config) -> Tuple[Optional[int], str]:
    """State tensors per parameter for the config's optimizer, and its name."""
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer') or {}
    opt_type = optimizer.get('type', 'none')
    name = getattr(opt_type, '__name__', str(opt_type))
    if name == 'SGD':
        return (1 if optimizer.get('momentum', 0) else 0), name
    return OPTIMIZER_STATE_FACTORS.get(name), name


def resolved_wrapper_args(wrapper_cls: Optional[type], kwargs: dict) -> dict:
    """The wrapper's keyword arguments with every default filled in.

    Walks the ``__init__`` signatures up the class's MRO (a wrapper passes
    ``**kwargs`` on to torch's class) until one takes no ``**kwargs``.
    """
    resolved = {}
    for klass in (wrapper_cls.__mro__ if wrapper_cls else ()):
        if '__init__' not in vars(klass) or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        for param in params:
            if param.name in ('self', 'module') or param.kind in (
                    param.VAR_KEYWORD, param.VAR_POSITIONAL):
                continue
            if param.default is not param.empty:
                resolved.setdefault(param.name, param.default)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    resolved.update(kwargs)
    return resolved


def _fake_world(world_size: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise PlanError('a process group already exists in this process; '
                        'the plan needs a fresh one')
    dist.init_process_group(
        'fake', store=FakeStore(), rank=rank, world_size=world_size)


def build_model(cfg: Config) -> nn.Module:
    if 'model' not in cfg:
        raise PlanError('the config has no `model` section to plan for')
    with DefaultScope.overwrite_default_scope(cfg.get('default_scope',
                                                      SCOPE)):
        return MODELS.build(cfg.model)


def make_plan(cfg: Config, world_size: int, rank: int = 0) -> Plan:
    """Plan ``cfg`` at ``world_size`` ranks, as seen from ``rank``.

    Raises:
        PlanError: bad sizes, an FSDP option on a DDP wrapper, a wrap policy
            that wraps nothing, an argument the wrapper rejects.
        ValueError: a bad ``parallel`` section (names the key).
    """
    if not 0 <= rank < world_size:
        raise PlanError(f'--rank={rank} is outside --world-size={world_size}')
    parallel = ParallelConfig.from_cfg(cfg.get('parallel'))
    try:  # sizes first: cheaper than building the model, and the likelier slip
        check_sizes(world_size, parallel.model_parallelism,
                    parallel.pipeline_parallelism)
    except ParallelismError as err:
        raise PlanError(f'parallel: {err}') from err
    explicit = cfg.get('model_wrapper_cfg') is not None
    wrapper_cfg = copy.deepcopy(
        dict(cfg.model_wrapper_cfg) if explicit else
        default_wrapper_cfg(parallel))
    check_wrapper_against_parallel(wrapper_cfg, explicit, parallel)
    model = build_model(cfg)
    from mmpar.wrappers.builder import check_wrapper_cfg, wrapper_class
    wrapper_type = wrapper_cfg.get('type', DDP_WRAPPER)
    fsdp = is_fsdp_type(wrapper_type)
    try:
        wrapper_cls = wrapper_class(wrapper_type)
    except ValueError as err:
        # The FSDP wrapper may not exist in this checkout; plan it from
        # torch's FSDP rules rather than refuse.
        if not fsdp:
            raise PlanError(str(err)) from err
        wrapper_cls = None
    if wrapper_cls is not None:
        try:  # the wrapper's own up-front checks (check_cfg)
            check_wrapper_cfg(wrapper_cfg)
        except (TypeError, ValueError) as err:
            raise PlanError(f'model_wrapper_cfg: {err}') from err
    _fake_world(world_size, rank)
    try:
        topology = init_parallelism(parallel.model_parallelism,
                                    parallel.pipeline_parallelism)
        return _plan_in_world(cfg, parallel, topology, model, wrapper_cfg,
                              wrapper_cls, fsdp, explicit)
    except ParallelismError as err:
        raise PlanError(f'parallel: {err}') from err
    finally:
        reset_parallelism()
        dist.destroy_process_group()


def _plan_in_world(cfg, parallel, topology, model, wrapper_cfg, wrapper_cls,
                   fsdp, explicit) -> Plan:
    layout, world_size = topology.layout, topology.layout.world_size
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    elem = params[0].element_size() if params else 4
    kwargs = {k: v for k, v in wrapper_cfg.items() if k != 'type'}
    plan = Plan(
        world_size=world_size,
        rank=dist.get_rank(),
        layout=layout,
        wrapper_type=_type_name(wrapper_cfg.get('type', DDP_WRAPPER)),
        wrapper_source='model_wrapper_cfg' if explicit else
        f'default for parallel.use_fsdp={parallel.use_fsdp}',
        wrapper_args=resolved_wrapper_args(wrapper_cls, kwargs),
        model_cls=type(model).__name__,
        param_numel=numel,
        param_bytes_per_elem=elem)
    plan.wrapper_args['process_group'] = (
        f'dp group {topology.dp.global_ranks}')
    if world_size == 1:
        plan.notes.append('world size 1: the Runner does not wrap the model')
    if explicit:
        # The parallel section's FSDP options only shape the default wrapper.
        unused = [f'parallel.{key}={value!r}'
                  for key, value in parallel.fsdp_kwargs.items()
                  if value != getattr(ParallelConfig, key)]
        if unused:
            plan.notes.append(f'{", ".join(unused)} not used: '
                              'model_wrapper_cfg is given and wins')
    if layout.mp > 1 or layout.pp > 1:
        plan.notes.append(
            'counts are for the model as built: splitting it over the mp/pp '
            'groups is up to the model')
    if fsdp:
        _plan_fsdp(plan, model, kwargs, topology)
        if wrapper_cls is None:
            plan.notes.append(f'{plan.wrapper_type} is not registered in '
                              'this checkout: units and shards follow '
                              "torch's FSDP1 rules")
    else:
        from mmpar.wrappers.builder import build_model_wrapper
        try:
            # The real wrapper on the fake group: it rejects what it would
            # reject in training, and nothing is sent anywhere.
            build_model_wrapper(wrapper_cfg, model)
        except TypeError as err:
            raise PlanError(
                f'model_wrapper_cfg for {plan.wrapper_type}: {err}') from err
    per_rank = sum(u.numel_per_rank for u in plan.units) if fsdp else numel
    grads = per_rank if plan.shard_size > 1 or not fsdp else numel
    factor, opt_name = optimizer_state_factor(cfg)
    plan.memory = [('params', per_rank, per_rank * elem),
                   ('grads', grads, grads * elem)]
    if factor is None:
        plan.notes.append(f'optimizer {opt_name}: state size unknown, '
                          'not counted')
    else:
        state = factor * per_rank
        plan.memory.append((f'optimizer state ({opt_name}: {factor} x '
                            'params)', state, state * elem))
    return plan


def _plan_fsdp(plan: Plan, model: nn.Module, kwargs: dict,
               topology) -> None:
    strategy = kwargs.get('sharding_strategy', 'FULL_SHARD')
    strategy = getattr(strategy, 'name', strategy)
    if strategy == 'NO_SHARD':
        plan.shard_size = 1
    elif strategy in ('HYBRID_SHARD', '_HYBRID_SHARD_ZERO2'):
        _plan_hybrid(plan, kwargs.get('hybrid_shard_size'), topology)
    else:
        plan.shard_size = topology.dp.world_size
    key = next((k for k in POLICY_KEYS if k in kwargs), POLICY_KEYS[0])
    policy_cfg = kwargs.get(key)
    policy, plan.policy = resolve_policy(policy_cfg, model, key)
    plan.units = fsdp_units(model, policy, plan.shard_size,
                            per_param=is_fsdp2_type(plan.wrapper_type))
    if policy is not None and len(plan.units) == 1:
        raise PlanError(
            f'model_wrapper_cfg.{key}={policy_cfg!r} wraps no '
            f'module of {plan.model_cls}: only the root would be an FSDP '
            'unit')
    if kwargs.get('cpu_offload'):
        plan.notes.append('cpu_offload=True: params and grads live in CPU '
                          'memory (counts unchanged)')


def _plan_hybrid(plan: Plan, explicit_size, topology) -> None:
    """HSDP: shard within the mp group, replicate across the dp group.

    An explicit ``hybrid_shard_size`` wins (shard groups of that many
    consecutive ranks).
    """
    world = topology.layout.world_size
    if explicit_size is not None:
        if isinstance(explicit_size, bool) or not isinstance(
                explicit_size, int) or explicit_size < 1 or \
                world % explicit_size:
            raise PlanError(
                f'model_wrapper_cfg.hybrid_shard_size={explicit_size!r} is '
                f'not allowed; allowed: an int >= 1 dividing the world size '
                f'{world}')
        plan.shard_size = explicit_size
        start = plan.rank // explicit_size * explicit_size
        plan.wrapper_args['process_group'] = (
            f'shard over {list(range(start, start + explicit_size))}, '
            'replicate over '
            f'{list(range(plan.rank % explicit_size, world, explicit_size))}')
        return
    plan.shard_size = topology.mp.world_size
    plan.wrapper_args['process_group'] = (
        f'shard over mp group {topology.mp.global_ranks}, replicate over dp '
        f'group {topology.dp.global_ranks}')
    if plan.shard_size == 1 and world > 1:
        plan.notes.append(
            'HYBRID_SHARD with parallel.model_parallelism=1 shards within '
            'one-rank groups: nothing is sharded; set '
            'parallel.model_parallelism or model_wrapper_cfg.'
            'hybrid_shard_size')


def _fmt_bytes(num: int) -> str:
    for unit in ('B', 'KiB', 'MiB', 'GiB'):
        if num < 1024 or unit == 'GiB':
            return f'{num:.0f} {unit}' if unit == 'B' else f'{num:.2f} {unit}'
        num /= 1024


def format_plan(plan: Plan) -> str:
    """The plan as the text ``tools/plan.py`` prints."""
    layout, rank = plan.layout, plan.rank
    lines = [
        f'world size {plan.world_size}: dp={layout.dp} pp={layout.pp} '
        f'mp={layout.mp} (mesh dims {DIMS}, shape {layout.shape})'
    ]
    for kind in ('mp', 'pp', 'dp'):
        groups = ' '.join(str(g) for g in layout.groups[kind])
        lines.append(f'  {kind} groups: {groups}')
    mine = ', '.join(
        f'{kind} {layout.group_of(kind, rank)}' for kind in ('mp', 'pp', 'dp'))
    lines += [f'  rank {rank}: {mine}', '']
    lines.append(f'wrapper: {plan.wrapper_type} ({plan.wrapper_source})')
    for key, value in plan.wrapper_args.items():
        shown = value if isinstance(value, str) and key == 'process_group' \
            else repr(value)
        lines.append(f'  {key}={shown}')
    lines.append('')
    if plan.units:
        lines.append(f'FSDP units ({len(plan.units)}; policy: '
                     f'{plan.policy or "none, root only"}; shard size '
                     f'{plan.shard_size}):')
        width = max(len(u.name) for u in plan.units)
        for unit in plan.units:
            lines.append(f'  {unit.name:<{width}}  {unit.cls:<20} '
                         f'{unit.numel:>12,} params  '
                         f'{unit.numel_per_rank:>12,} per rank')
        lines.append('')
    lines.append(f'per-rank memory (rank {rank}; model {plan.model_cls}, '
                 f'{plan.param_numel:,} trainable params, '
                 f'{plan.param_bytes_per_elem} bytes each):')
    total_count = total_bytes = 0
    for name, count, num_bytes in plan.memory:
        lines.append(f'  {name:<34} {count:>14,}  {_fmt_bytes(num_bytes):>11}')
        total_count += count
        total_bytes += num_bytes
    lines.append(f'  {"total":<34} {total_count:>14,}  '
                 f'{_fmt_bytes(total_bytes):>11}')
    lines += [f'note: {note}' for note in plan.notes]
    return '\n'.join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Dry-run a config at world size N (no processes, no GPU)')
    parser.add_argument('config', help='config file')
    parser.add_argument('--world-size', type=int, required=True)
    parser.add_argument(
        '--rank', type=int, default=0,
        help='the rank whose groups and memory are shown')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config keys, e.g. parallel.use_fsdp=True')
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """``tools/plan.py``: print the plan, or ``error: ...`` and return 2."""
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    try:
        plan = make_plan(cfg, args.world_size, args.rank)
    except (ParallelismError, ValueError) as err:  # PlanError is a ValueError
        print(f'error: {err}', file=sys.stderr)
        return 2
    print(f'plan for {args.config}')
    print(format_plan(plan))
    return 0
