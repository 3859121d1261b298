"""Dry-run a config at world size N in one process: axes, wrapper, memory.

``tools/plan.py CONFIG --world-size N`` calls :func:`make_plan` and prints
:func:`mmpar.analysis.plan_report.format_plan`. Nothing here is modelled
when it can be measured: torch's fake process-group backend lets one process
act as rank ``r`` of ``N``, so the topology and the real data-parallel
wrapper are built exactly as in training (collectives do nothing), and the
axes each wrapper reduces and shards over are read back from the wrapper.

The steps follow :mod:`mmpar.parallelize.compose` (TP, CP, PP, then the DP
wrapper); :func:`plan_tensor_parallel`, :func:`plan_context_parallel` and
:func:`plan_pipeline` are where those techniques add their rows (per-rank
bytes under TP; chunks and attention work per cp rank; stages, bubble).
"""
import copy
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist
from mmengine.config import Config
from mmengine.registry import DefaultScope
from torch import nn

from mmpar.analysis.fsdp_units import (POLICY_KEYS, FsdpUnit, PlanError,
                                       fsdp_units, resolve_policy)
from mmpar.analysis.memory import MemoryEstimate, in_flight, sample_batch
from mmpar.device import current_rss
from mmpar.failures import ConfigError
from mmpar.parallel.axes import AXES, DATA_AXES, FLATTENED
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims, ParallelismError
from mmpar.parallel.dtensor import local_tensor
from mmpar.parallel.layout import ParallelLayout
from mmpar.parallel.topology import ParallelTopology, build_topology
from mmpar.parallelize.compose import data_axis_args
from mmpar.parallelize.resolved import ResolvedPlan, builds_on_meta
from mmpar.parallelize.meta import build_on_meta
from mmpar.registry import MODELS, SCOPE
from mmpar.wrappers.base import describe
from mmpar.wrappers.builder import (build_model_wrapper, check_wrapper_cfg,
                                    declared)

# Optimizer state per parameter element, in parameter-sized tensors.
OPTIMIZER_STATE_FACTORS = dict(
    Adam=2, AdamW=2, Adamax=2, NAdam=2, RAdam=2, Adagrad=1, Lion=1)


@dataclass
class Plan:
    """Everything :func:`~mmpar.analysis.plan_report.format_plan` prints.

    ``axes`` says what the built wrapper communicates over, as global ranks:
    ``{'reduce': [...]}`` (gradients all-reduced), ``{'shard': [...]}`` or
    ``{'shard': [...], 'replicate': [...]}`` (HSDP), each with the axis name
    it is (``'dp'``, ``'dp_shard'``, ``'dp_replicate'``).
    """
    world_size: int
    rank: int
    dims: ParallelDims
    layout: ParallelLayout
    wrapper_type: str
    wrapper_source: str
    per_param_shards: bool  # FSDP2's shards; FSDP1's are flat per unit
    wrapper_args: dict
    model_cls: str
    param_numel: int  # every parameter: the weights
    trainable_numel: int  # requires_grad: gradients and optimizer state
    param_bytes_per_elem: int
    axes: Dict[str, Tuple[str, List[int]]] = field(default_factory=dict)
    shard_size: int = 1
    units: List[FsdpUnit] = field(default_factory=list)
    # The tp plan's split modules and their styles (for the dry run's
    # messages).
    tp_labels: Dict[str, str] = field(default_factory=dict)
    policy: Optional[str] = None
    memory: List[Tuple[str, int, int]] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    pp_stages: List[int] = field(default_factory=list)
    estimate: Optional[MemoryEstimate] = None


def build_model(cfg: Config) -> nn.Module:
    """The config's model on the meta device: shapes only, no memory (a
    model of any size plans in seconds)."""
    if 'model' not in cfg:
        raise PlanError('the config has no `model` section to plan for')

    def build():
        with DefaultScope.overwrite_default_scope(
                cfg.get('default_scope', SCOPE)):
            return MODELS.build(cfg.model)

    try:
        model, _ = build_on_meta(build, init_weights=False,
                                 rank0_states=False, shapes_only=True)
    except ConfigError:
        model = build()  # a model that cannot be built on meta: whole
    return model


def optimizer_state_factor(cfg: Config) -> Tuple[Optional[int], str]:
    """State tensors per parameter for the config's optimizer, and its name."""
    optimizer = (cfg.get('optim_wrapper') or {}).get('optimizer') or {}
    opt_type = optimizer.get('type', 'none')
    name = getattr(opt_type, '__name__', str(opt_type))
    if name == 'SGD':
        return (1 if optimizer.get('momentum', 0) else 0), name
    return OPTIMIZER_STATE_FACTORS.get(name), name


def resolved_wrapper_args(wrapper_cls: type, kwargs: dict) -> dict:
    """The wrapper's keyword arguments with every default filled in.

    Walks the ``__init__`` signatures up the class's MRO (a wrapper passes
    ``**kwargs`` on to torch's class) until one takes no ``**kwargs``.
    """
    import inspect
    resolved = {}
    for klass in wrapper_cls.__mro__:
        if '__init__' not in vars(klass) or klass is object:
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        for param in params:  # self, *args and **kwargs have no default
            if param.name != 'module' and param.default is not param.empty:
                resolved.setdefault(param.name, param.default)
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    resolved.update(kwargs)
    return resolved


def make_plan(cfg: Config, world_size: int, rank: int = 0,
              baseline: Optional[int] = None) -> Plan:
    """Plan ``cfg`` at ``world_size`` ranks, as seen from ``rank``.

    The wrapper and ``parallel`` sections go through the Runner's own checks
    (:func:`mmpar.config_check.check_layout` at ``world_size``), so the plan
    refuses what training would.

    Raises:
        PlanError: anything the Runner would refuse, or a wrapper the real
            constructor rejects; the message names the key.
    """
    from mmpar.config_check import check_custom_imports, check_layout
    if not 0 <= rank < world_size:
        raise PlanError(f'--rank={rank} is outside --world-size={world_size}')
    try:
        check_custom_imports(cfg.get('custom_imports'))
        resolved = check_layout(cfg, world_size)
    except ConfigError as err:
        raise PlanError(str(err)) from None
    dims = resolved.dims
    if baseline is None:
        baseline = current_rss()  # a rank's before its model: imports
    model = build_model(cfg)
    if dist.is_initialized():
        raise PlanError('a process group already exists in this process; '
                        'the plan needs a fresh one')
    # torch's fake backend sends nothing; an in-memory store serves it.
    dist.init_process_group(
        'fake', store=dist.HashStore(), rank=rank, world_size=world_size)
    topology = None
    try:
        topology = build_topology(dims)
        plan = _plan_in_world(cfg, resolved, topology, model)
        plan.estimate.baseline = baseline
        return plan
    except ParallelismError as err:
        raise PlanError(f'parallel: {err}') from err
    finally:
        if topology is not None:
            topology.destroy()
        dist.destroy_process_group()


def plan_tensor_parallel(plan: Plan, model: nn.Module,
                         topology: ParallelTopology,
                         parallel: ParallelConfig) -> nn.Module:
    """Apply the TP plan as :mod:`mmpar.parallelize.compose` does, on the
    fake group: the per-rank counts then follow from the split parameters."""
    from mmpar.parallelize.tensor import split_model
    if not topology.dims.tp_enabled:
        return model
    try:
        plan.tp_labels = split_model(model, topology.mesh['tp'],
                                     parallel.tp_plan)
    except (TypeError, ValueError) as err:
        raise PlanError(str(err)) from err
    split = [p for p in model.parameters() if local_tensor(p) is not p]
    plan.notes.append(
        f'tp={topology.dims.tp}: {len(split)} parameters split by '
        f'tp_plan={parallel.tp_plan!r} (this rank holds '
        f'{sum(local_tensor(p).numel() for p in split)} of '
        f'{sum(p.numel() for p in split)} of their elements)')
    return model


def plan_context_parallel(plan: Plan, model: nn.Module,
                          topology: ParallelTopology, cfg: Config) -> None:
    """CP rows: the model switched to context-parallel attention as compose
    does (its protocol checked), and for each sequence length the config
    names, this rank's chunks and positions and the attention work of every
    cp rank (equal: the load balance)."""
    from mmpar.config_check import config_seq_lens
    from mmpar.parallelize.context import (apply_context_parallel,
                                           attention_work, chunk_ids,
                                           check_seq_len)
    dims = topology.dims
    if not dims.cp_enabled:
        return
    try:
        apply_context_parallel(model, topology.mesh['cp'])
    except ValueError as err:
        raise PlanError(f'parallel.cp={dims.cp}: {err}') from err
    rank = topology.cp.rank
    chunks = chunk_ids(rank, dims.cp)
    plan.notes.append(
        f'cp={dims.cp}: each sequence cut into {2 * dims.cp} equal chunks, '
        f'cp rank {rank} (this rank) holds chunks {chunks[0]} and '
        f'{chunks[1]}; keys/values all-gathered over cp group '
        f'{topology.cp.global_ranks} in every attention layer; gradients '
        f'reduced over dp x cp = {dims.dp_cp} ranks '
        f'{topology.dp_cp.global_ranks}; activations per rank ~1/{dims.cp} '
        'of one rank holding the whole sequence')
    keys = {}
    for key, length in config_seq_lens(cfg):
        keys.setdefault(length, []).append(key)
    for length, named in keys.items():
        chunk = check_seq_len(length, dims.cp)
        work = [attention_work(length, r, dims.cp)[0]
                for r in range(dims.cp)]
        first, last = (c * chunk for c in chunks)
        plan.notes.append(
            f'cp at sequence length {length} ({", ".join(named)}): this '
            f'rank holds positions {first}..{first + chunk - 1} and '
            f'{last}..{last + chunk - 1} ({2 * chunk} tokens); attention '
            f'scores per (sample, head) and cp rank {work} (equal)')


def plan_pipeline(plan: Plan, model: nn.Module, topology: ParallelTopology,
                  pipe) -> List[nn.Module]:
    """PP rows: each stage's layers and parameters, this rank's stages and
    the schedule's theoretical bubble. Under tp the stages are cut from the
    split model: this rank's share is its local shards.

    Returns:
        The modules the data-parallel wrapper is planned on: this rank's
        stages, cut as :func:`~mmpar.parallelize.pipeline.
        pipeline_parallelize` cuts them (so the memory table counts only
        them); ``[model]`` without pp.
    """
    if not topology.dims.pp_enabled:
        return [model]
    from mmpar.parallelize.pipeline.schedules import (stage_indices,
                                                      theoretical_bubble)
    from mmpar.parallelize.pipeline.split import (layer_names, split_stage,
                                                  stage_starts)
    pp = topology.dims.pp
    num_stages = pp * pipe.stages_per_rank
    starts = stage_starts(model, pipe.split_points, num_stages)
    names = layer_names(model)
    plan.pp_stages = stage_indices(pipe.schedule, topology.pp.rank, pp,
                                   pipe.stages_per_rank)
    numels, local, mine = [], [], []
    for stage, start in enumerate(starts):
        end = starts[stage + 1] if stage + 1 < num_stages else len(names)
        stage_model = split_stage(model, starts, stage)
        params = list(stage_model.parameters())
        numels.append(sum(p.numel() for p in params))
        local.append(sum(local_tensor(p).numel() for p in params))
        plan.notes.append(f'pp stage {stage}: {names[start]} .. '
                          f'{names[end - 1]}, {numels[-1]:,} parameters')
        if stage in plan.pp_stages:
            mine.append(stage_model)
    held = sum(numels[s] for s in plan.pp_stages)
    here = sum(local[s] for s in plan.pp_stages)
    split = f'; its tp={topology.dims.tp} shards: {here:,} elements' \
        if topology.dims.tp_enabled else ''
    plan.notes.append(
        f'this rank holds pp stage(s) {plan.pp_stages}: {held:,} parameters'
        f'{split} ({4 * here:,} bytes in fp32); the memory table counts only '
        'these')
    m, v = pipe.num_microbatches, pipe.stages_per_rank
    bubble, formula = theoretical_bubble(pipe.schedule, pp, m, v)
    kind = 'GPipe/1F1B' if v == 1 else f'{v} stages per rank'
    plan.notes.append(
        f'schedule {pipe.schedule}, {m} micro-batches: theoretical bubble '
        f'of {kind} {formula} = {bubble:.3f}')
    return mine


# What a wrapper's group is called, the first name whose group it is: the
# data axis, its parts, the other axes (fastest first), the other flattened
# axes.
AXIS_NAMES = ('dp', ) + DATA_AXES[::-1] + tuple(
    a for a in reversed(AXES) if a not in DATA_AXES) + tuple(
        name for name in FLATTENED if name != 'dp')


def _named_axis(group, topology: ParallelTopology) -> Tuple[str, List[int]]:
    """A wrapper's group as ``(axis name, global ranks)``."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    rank = dist.get_rank()
    name = next((name for name in AXIS_NAMES
                 if topology.layout.group_of(name, rank) == ranks),
                'world' if len(ranks) == topology.dims.world_size else 'group')
    return name, ranks


def _build_wrapper(plan: Plan, wrapper_cfg: dict, model: nn.Module,
                   topology: ParallelTopology):
    """The real wrapper on the fake group around the meta model, given the
    data axis as compose gives it: it rejects what it would reject in
    training, and nothing is sent or allocated. A wrapper that needs real
    parameters (``meta_materialize='before'``: the replicating ones, which
    hold everything) is checked, not built; its axis is its data group."""
    cls = declared(wrapper_cfg['type'])
    axis = data_axis_args(wrapper_cfg, topology)
    try:
        if cls.meta_materialize == 'before' and \
                any(p.is_meta for p in model.parameters()):
            check_wrapper_cfg(wrapper_cfg)
            return None
        if cls.meta_materialize not in ('before', 'after'):
            # FSDP1 flattens real tensors: its units get empty memory, one
            # at a time (the shards it keeps are this rank's share).
            axis[cls.meta_materialize] = lambda module: module.to_empty(
                device='cpu', recurse=False)
        return build_model_wrapper(wrapper_cfg, model, default_args=axis)
    except (TypeError, ValueError) as err:
        raise PlanError(
            f'model_wrapper_cfg for {plan.wrapper_type}: {err}') from err


def _plan_in_world(cfg, resolved: ResolvedPlan, topology, model) -> Plan:
    # The wrapper compose builds (around a TP model, DDP replicates it as
    # MMTensorParallelDDP).
    parallel = resolved.parallel
    explicit = resolved.given_wrapper_cfg is not None
    wrapper_cfg = copy.deepcopy(resolved.wrapper_cfg)
    # Frozen parameters (requires_grad=False) are weights every layout
    # holds, but get no gradient and no optimizer state.
    params = list(model.parameters())
    elem = params[0].element_size() if params else 4
    kwargs = {k: v for k, v in wrapper_cfg.items() if k != 'type'}
    wrapper_cls = declared(wrapper_cfg['type'])
    plan = Plan(
        world_size=topology.dims.world_size,
        rank=dist.get_rank(),
        dims=topology.dims,
        layout=topology.layout,
        wrapper_type=wrapper_cls.__name__,
        per_param_shards=getattr(wrapper_cls, 'shards_each_parameter', False),
        wrapper_source='model_wrapper_cfg' if explicit else
        f'default for parallel.use_fsdp={parallel.use_fsdp}',
        wrapper_args=resolved_wrapper_args(wrapper_cls, kwargs),
        model_cls=type(model).__name__,
        param_numel=sum(p.numel() for p in params),
        trainable_numel=sum(p.numel() for p in params if p.requires_grad),
        param_bytes_per_elem=elem)
    if plan.world_size == 1:
        plan.notes.append('world size 1: the Runner does not wrap the model')
    if explicit:
        # The parallel section's FSDP options only shape the default wrapper.
        unused = [f'parallel.{key}={value!r}'
                  for key, value in parallel.fsdp_kwargs.items()
                  if value != getattr(ParallelConfig, key)]
        if unused:
            plan.notes.append(f'{", ".join(unused)} not used: '
                              'model_wrapper_cfg is given and wins')
    # One micro-batch's activations, on the plain (meta) model.
    activations = _activations(cfg, model, resolved, topology)
    # compose's order: TP, CP, PP, then the data-parallel wrapper.
    model = plan_tensor_parallel(plan, model, topology, parallel)
    if topology.dims.tp_enabled:
        # Measured again on the split model: a tp rank holds whole what the
        # plan all-gathers (the input of column-split projections, logits
        # gathered whole), which the plain model's share (1/tp) misses.
        split = _activations(cfg, model, resolved, topology,
                             tp_labels=plan.tp_labels)
        if split is None:
            plan.notes.append('activations: the split model\'s meta forward '
                              'failed; the plain model\'s divided by tp')
        activations = split if split is not None else activations
    plan_context_parallel(plan, model, topology, cfg)
    # Under pp each of this rank's stages gets its own wrapper, as in
    # training; without pp the one "stage" is the whole model.
    stages = plan_pipeline(plan, model, topology, resolved.pipeline)
    sharded = wrapper_cls.shards_parameters  # FSDP units
    if sharded:
        # Before the wrapper: its errors then name the config key.
        key = next((k for k in POLICY_KEYS if k in kwargs), POLICY_KEYS[0])
        policy, plan.policy = resolve_policy(kwargs.get(key), model, key)
        # The wrapper shards in place.
        units_stages = [copy.deepcopy(stage) for stage in stages]
    if topology.dims.pp_enabled:
        wrapper_cfg = copy.deepcopy(resolved.stage_wrapper_cfg)
    built = [_build_wrapper(plan, wrapper_cfg, stage, topology)
             for stage in stages]
    # What the wrapper communicates over, from its description: 'reduce'
    # for replicating wrappers (their data group when only checked),
    # 'shard' and, for HSDP, 'replicate' for FSDP1/FSDP2.
    groups = describe(built[0]).axes if built[0] is not None else dict(
        reduce=data_axis_args(wrapper_cfg, topology)['process_group'])
    plan.axes = {role: _named_axis(group, topology)
                 for role, group in groups.items()}
    # This rank's elements: every parameter (held) and the trainable ones
    # (their gradients and optimizer state).
    if sharded:
        _plan_fsdp(plan, units_stages, policy, key, kwargs)
        held = sum(u.numel_per_rank for u in plan.units)
        trained = sum(u.trainable_per_rank for u in plan.units)
    else:
        held, trained = _numel_held_and_trained(stages)
    if topology.dims.tp_enabled:
        # Split (and, under FSDP2, sharded) DTensors: the real local shards.
        held, trained = _numel_held_and_trained(
            [wrapper or stage for wrapper, stage in zip(built, stages)],
            local_tensor)
    factor, opt_name = optimizer_state_factor(cfg)
    plan.memory = [('params', held, held * elem),
                   ('grads', trained, trained * elem)]
    if factor is None:
        plan.notes.append(f'optimizer {opt_name}: state size unknown, '
                          'not counted')
    else:
        state = factor * trained
        plan.memory.append((f'optimizer state ({opt_name}: {factor} x '
                            'params)', state, state * elem))
    pipe = resolved.pipeline if topology.dims.pp_enabled else None
    if pipe is not None and plan.units:
        if pipe.reshards_per_microbatch:
            plan.notes.append(
                'FSDP stages reshard and reduce-scatter after every '
                'micro-batch (parallel.pipeline.reshard_per_microbatch)')
        else:
            plan.notes.append(
                'FSDP stages stay gathered, gradients unsharded, from the '
                'first micro-batch\'s backward to the step\'s end (torch\'s '
                'schedule: ' + ('reshard_per_microbatch=False)'
                                if not pipe.reshard_per_microbatch else
                                f'{pipe.schedule} splits backward)'))
    plan.estimate = _estimate(cfg, plan, stages, wrapper_cfg, activations,
                              held * elem, pipe)
    return plan


def _numel_held_and_trained(modules: List[nn.Module],
                            local=lambda p: p) -> Tuple[int, int]:
    """``(elements of every parameter, of the trainable ones)`` of
    ``modules``, each parameter as ``local`` gives it (its local shard)."""
    params = [p for module in modules for p in module.parameters()]
    return (sum(local(p).numel() for p in params),
            sum(local(p).numel() for p in params if p.requires_grad))


def _activations(cfg, model: nn.Module, resolved: ResolvedPlan,
                 topology: ParallelTopology,
                 tp_labels: Optional[Dict[str, str]] = None
                 ) -> Optional[int]:
    """One micro-batch's activations on this rank, in flight (``model``
    already split by tp when ``tp_labels`` names its split modules: its
    DTensors' local shards are what is counted, after the dry run training
    runs at the first call: a plan the model's code cannot run is a
    PlanError naming the module and its style)."""
    from mmpar.analysis.activations import (_block_class, activation_profile,
                                            estimate_from_profile)
    dims = topology.dims
    batch = (cfg.get('train_dataloader') or {}).get('batch_size') or 1
    pipe = resolved.pipeline if dims.pp_enabled else None
    microbatches = pipe.num_microbatches if pipe is not None else 1
    data = sample_batch(cfg, model, max(1, batch // microbatches))
    if data is None:
        return None
    ac_cfg = resolved.activation_checkpointing
    tp_split = tp_labels is not None
    if tp_split:
        # The split model's first call on the meta device, as training
        # runs it (mmpar.parallelize.tp_check).
        from mmpar.parallelize.tp_check import dry_run
        model.to('meta')  # nothing is computed
        args, kwargs = ((), dict(data)) if isinstance(data, dict) else (
            tuple(data), {})
        try:
            dry_run(model, tp_labels, args, dict(kwargs, mode='loss'))
        except ConfigError as err:
            raise PlanError(str(err)) from err
    try:
        model.to('meta')  # buffers too: nothing is computed
        profile = activation_profile(
            model, data, ac_cfg or dict(module_classes=_block_class(model)))
    except Exception:  # noqa: B902 - a forward that needs real values
        return None
    one = estimate_from_profile(profile, ac_cfg)
    if pipe is not None:
        # This rank's share of the blocks, for each micro-batch it holds.
        one = one // dims.pp * in_flight(pipe.schedule, dims.pp,
                                         microbatches, pipe.stages_per_rank)
    # cp splits each sequence; tp (on the plain model) each layer's.
    return one // (dims.cp * (1 if tp_split else dims.tp))


def _gathered_numel(plan: Plan, pipe) -> int:
    """Elements FSDP holds whole at the peak, parameters and gradients
    (of the trainable parameters only, :func:`~mmpar.analysis.fsdp_units.
    fsdp_units`).

    One unit's parameters and gradients at a time, as FSDP2 runs a whole
    model and as mmpar's pipeline stage runs an FSDP2 stage (it reshards
    and reduce-scatters after every micro-batch); but where torch's
    schedule keeps a stage's parameters gathered and its gradients
    unsharded from the first micro-batch's backward to the reduction after
    the last (``reshard_per_microbatch=False``, the zero-bubble schedules:
    PipelineStage turns resharding after backward and gradient sync off),
    every unit of this rank's stages, parameters and gradients. The
    virtual-stage schedules also gather every unit of this rank's stages at
    the start of a step (torch's UNSHARD action), parameters only.
    """
    largest = max(u.numel + u.trainable for u in plan.units)
    if pipe is None:
        return largest
    stages = sum(u.numel for u in plan.units)
    if not pipe.reshards_per_microbatch:
        return stages + sum(u.trainable for u in plan.units)
    if pipe.stages_per_rank > 1:
        return max(stages, largest)
    return largest


def _estimate(cfg, plan: Plan, stages, wrapper_cfg: dict,
              activations: Optional[int], local_bytes: int, pipe=None):
    elem = plan.param_bytes_per_elem
    meta = bool(cfg.get('meta_init', True)) and \
        builds_on_meta(plan.dims, wrapper_cfg)
    if meta:
        largest = max((p.numel() for stage in stages
                       for p in stage.parameters()), default=0)
        build = local_bytes + largest * elem
    else:
        build = plan.param_numel * elem + local_bytes
    gathered = 0
    if plan.units:
        gathered = _gathered_numel(plan, pipe) * elem // plan.dims.tp
    grads = next(b for name, _, b in plan.memory if name == 'grads')
    optimizer = sum(b for name, _, b in plan.memory
                    if name.startswith('optimizer'))
    return MemoryEstimate(baseline=0, build=build, params=local_bytes,
                          grads=grads, optimizer=optimizer,
                          gathered_unit=gathered, activations=activations,
                          meta_init=meta)


def _plan_fsdp(plan: Plan, stages: List[nn.Module], policy, key: str,
               kwargs: dict) -> None:
    """FSDP units and shards of each stage (each its own root), with the
    shard size the real wrapper uses."""
    plan.shard_size = len(plan.axes['shard'][1]) if 'shard' in plan.axes \
        else 1
    for index, stage in zip(plan.pp_stages or [None], stages):
        units = fsdp_units(stage, policy, plan.shard_size,
                           per_param=plan.per_param_shards)
        if index is not None:
            units[0].name = f'(stage {index} root)'
        plan.units += units
    if policy is not None and len(plan.units) == len(stages):
        raise PlanError(
            f'model_wrapper_cfg.{key}={kwargs.get(key)!r} wraps no '
            f'module of {plan.model_cls}: only the root would be an FSDP '
            'unit')
    if kwargs.get('cpu_offload'):
        plan.notes.append('cpu_offload=True: params and grads live in CPU '
                          'memory (counts unchanged)')
