"""Tensor parallelism from config: ``TP_PLANS`` and :func:`apply_tp`.

A config chooses a plan with ``parallel = dict(tp=2, tp_plan=...)``, where
``tp_plan`` is a registered name, ``dict(type=NAME, **kwargs)`` or a
callable ``plan(model, tp_mesh, **kwargs)`` that splits ``model`` in place.
The built-in ``module_plan`` takes plain data (module-name patterns ->
styles), so most models need no code at all::

    tp_plan = dict(type='module_plan', plan={
        'blocks.*.mlp.fc1': 'colwise',
        'blocks.*.mlp.fc2': 'rowwise',
    })

Styles are torch's ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` plus ``replicate``; an entry may be a dict
``dict(style=..., input_layouts=..., output_layouts=...,
use_local_output=...)`` with layouts written ``'replicate'``,
``'shard(N)'`` or ``'partial'``. Everything a plan can get wrong without
running it (unknown name, unknown style, a pattern matching no module, tp
not dividing a split dimension) is checked on every rank before the first
collective, so a bad plan fails at start-up, never in a hang.
See docs/tensor_parallel.md.
"""
import copy
import fnmatch
import re
from typing import Callable, Dict, List, Tuple, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate,
                                      Shard, distribute_module)
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               ParallelStyle, RowwiseParallel,
                                               SequenceParallel,
                                               parallelize_module)

from mmpar.registry import TP_PLANS, lookup_callable, registered_names

PlanCfg = Union[None, str, dict, Callable]
STYLES = ('colwise', 'rowwise', 'sequence_parallel', 'replicate')
ENTRY_KEYS = ('style', 'input_layouts', 'output_layouts', 'use_local_output')
# Modules torch's Colwise/RowwiseParallel can split, and which weight
# dimension each style splits: (colwise, rowwise).
SPLIT_DIMS = {nn.Linear: (0, 1), nn.Embedding: (1, 0)}
# With sequence parallelism between blocks the residual stream is sharded on
# the sequence dimension (torchtitan's and Megatron's layout).
SEQUENCE_DIM = 1


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, as Replicate DTensors.

    Inputs become Replicate DTensors (a DTensor input is redistributed,
    e.g. all-gathered from a sequence shard), outputs are local tensors
    unless ``use_local_output=False``. Useful for norms between split
    layers when the plan has no sequence parallelism.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _prepare_input(self, module, inputs, device_mesh):
        placements = [Replicate()] * device_mesh.ndim
        return tuple(
            (x.redistribute(placements=placements) if isinstance(x, DTensor)
             else DTensor.from_local(x, device_mesh, placements,
                                     run_check=False))
            if hasattr(x, 'shape') else x for x in inputs)

    def _prepare_output(self, module, outputs, device_mesh):
        if self.use_local_output and isinstance(outputs, DTensor):
            return outputs.to_local()
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=self._prepare_input,
            output_fn=self._prepare_output)


def parse_layout(value, key: str) -> Placement:
    """``'replicate'``, ``'shard(N)'``, ``'partial'`` or a Placement.

    Raises:
        ValueError: naming ``key``, the value and the allowed forms.
    """
    if isinstance(value, Placement):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == 'replicate':
            return Replicate()
        if text == 'partial':
            return Partial()
        match = re.fullmatch(r'shard\((-?\d+)\)', text)
        if match:
            return Shard(int(match.group(1)))
    raise ValueError(f'{key}={value!r} is not a layout; allowed: '
                     "'replicate', 'shard(N)', 'partial' or a torch Placement")


def _normalize_entry(pattern: str, entry, key: str) -> dict:
    """One plan entry as ``dict(style=..., **layout options)``."""
    entry = dict(style=entry) if isinstance(entry, str) else entry
    if not isinstance(entry, dict):
        raise ValueError(f'{key}[{pattern!r}]={entry!r} is not allowed; '
                         f'allowed: a style ({", ".join(STYLES)}) or '
                         f'dict with keys {", ".join(ENTRY_KEYS)}')
    unknown = [k for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise ValueError(f'{key}[{pattern!r}].{unknown[0]} is not a known '
                         f'key; allowed: {", ".join(ENTRY_KEYS)}')
    style = entry.get('style')
    if style not in STYLES:
        raise ValueError(f'{key}[{pattern!r}] style={style!r} is not a '
                         f'tensor-parallel style; allowed: {", ".join(STYLES)}')
    for name in ('input_layouts', 'output_layouts'):
        if entry.get(name) is not None:
            parse_layout(entry[name], f'{key}[{pattern!r}].{name}')
    return dict(entry)


def check_module_plan_data(plan, key: str = 'parallel.tp_plan.plan') -> None:
    """Check a ``module_plan`` mapping without a model (styles, layouts).

    Raises:
        ValueError: naming the key, the bad value and what is allowed.
    """
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f'{key}={plan!r} is not allowed; allowed: a '
                         'non-empty dict of module-name pattern -> style')
    for pattern, entry in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f'{key}: pattern {pattern!r} must be a str')
        _normalize_entry(pattern, entry, key)


def match_modules(model: nn.Module, pattern: str) -> List[str]:
    """Names of ``model``'s modules that ``pattern`` matches.

    Matching is per dot-separated part (``'blocks.*.mlp.fc1'`` matches
    ``blocks.3.mlp.fc1`` but not ``blocks.3.x.mlp.fc1``), with ``fnmatch``
    wildcards inside a part, as ``parallelize_module`` does.
    """
    atoms = pattern.split('.')
    names = []
    for name, _ in model.named_modules():
        parts = name.split('.')
        if name and len(parts) == len(atoms) and all(
                fnmatch.fnmatchcase(p, a) for p, a in zip(parts, atoms)):
            names.append(name)
    return names


def _check_split(name: str, module: nn.Module, style: str, tp_size: int,
                 key: str) -> None:
    if style not in ('colwise', 'rowwise'):
        return
    kinds = [cls for cls in SPLIT_DIMS if isinstance(module, cls)]
    if not kinds:
        raise ValueError(
            f'{key}: {name!r} is a {type(module).__name__}; style {style!r} '
            'splits only nn.Linear and nn.Embedding (give its Linear '
            'children their own entries, or use sequence_parallel/replicate)')
    dim = SPLIT_DIMS[kinds[0]][0 if style == 'colwise' else 1]
    size = module.weight.shape[dim]
    if size % tp_size:
        raise ValueError(
            f'{key}: tp={tp_size} does not divide {name!r} ({style}): its '
            f'weight {tuple(module.weight.shape)} is split on dim {dim} of '
            f'size {size}; allowed: a tp that divides {size}')


def _style(entry: dict, sequence_parallel: bool,
           module: nn.Module) -> ParallelStyle:
    kwargs = {
        k: (parse_layout(v, k) if k.endswith('layouts') else v)
        for k, v in entry.items() if k != 'style' and v is not None
    }
    style = entry['style']
    if style == 'colwise':
        if sequence_parallel:
            kwargs.setdefault('input_layouts', Shard(SEQUENCE_DIM))
        return ColwiseParallel(**kwargs)
    if style == 'rowwise':
        if isinstance(module, nn.Embedding):
            # Token ids are whole on every rank; torch's default (a shard of
            # the last dim) would read them as pieces of a longer sequence.
            kwargs.setdefault('input_layouts', Replicate())
        if sequence_parallel:
            kwargs.setdefault('output_layouts', Shard(SEQUENCE_DIM))
        return RowwiseParallel(**kwargs)
    if style == 'sequence_parallel':
        extra = [k for k in kwargs if k != 'use_local_output']
        if extra:
            raise ValueError(f'sequence_parallel takes no {extra[0]}; '
                             'allowed: use_local_output')
        return SequenceParallel(sequence_dim=SEQUENCE_DIM, **kwargs)
    return ReplicateParallel(**kwargs)


def module_plan_styles(model: nn.Module, plan: dict, tp_size: int,
                       key: str = 'parallel.tp_plan.plan'
                       ) -> Dict[str, ParallelStyle]:
    """Expand a ``module_plan`` into ``{module name: torch ParallelStyle}``.

    Defaults follow torchtitan: without ``sequence_parallel`` entries,
    colwise takes a replicated input and rowwise gives a replicated output;
    with them, the activations between blocks are sharded on the sequence
    dimension (colwise's input and rowwise's output default to
    ``Shard(1)``). An entry's own layouts override either default.

    Raises:
        ValueError: a bad style or layout, a pattern that matches no module
            (listing the model's module names), a module matched twice, a
            module the style cannot split, or tp not dividing a split
            dimension (naming the module and sizes).
    """
    check_module_plan_data(plan, key)
    entries = {p: _normalize_entry(p, e, key) for p, e in plan.items()}
    sequence_parallel = any(
        e['style'] == 'sequence_parallel' for e in entries.values())
    modules = dict(model.named_modules())
    styles: Dict[str, ParallelStyle] = {}
    for pattern, entry in entries.items():
        names = match_modules(model, pattern)
        if not names:
            listed = ', '.join(n for n in modules if n)
            raise ValueError(f'{key}: pattern {pattern!r} matches no module '
                             f'of {type(model).__name__}; its modules: '
                             f'{listed}')
        for name in names:
            if name in styles:
                raise ValueError(f'{key}: {name!r} is matched by more than '
                                 f'one pattern (the last is {pattern!r})')
            _check_split(name, modules[name], entry['style'], tp_size, key)
            styles[name] = _style(entry, sequence_parallel, modules[name])
    return styles


@TP_PLANS.register_module(name='module_plan')
def module_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """Split ``model`` by plain data: module-name patterns -> styles.

    Args:
        model: the plain model; changed in place.
        tp_mesh: the 1-D tensor-parallel mesh.
        plan: ``{pattern: style or dict(style=..., input_layouts=...,
            output_layouts=..., use_local_output=...)}``.
    """
    styles = module_plan_styles(model, plan, tp_mesh.size())
    parallelize_module(model, tp_mesh, styles)


# -- resolving a tp_plan config ---------------------------------------------
def registered_plans() -> List[str]:
    """Names a ``parallel.tp_plan`` may take."""
    return registered_names(TP_PLANS)


def _lookup(name: str) -> Callable:
    return lookup_callable(TP_PLANS, name, 'parallel.tp_plan')


def resolve_tp_plan(cfg: PlanCfg) -> Tuple[Callable, dict]:
    """``(plan function, kwargs)`` for a ``tp_plan`` config (not mutated).

    Raises:
        ValueError: None, an unknown name (listing the registered ones), a
            dict without ``type``, or bad ``module_plan`` data.
        TypeError: a value of the wrong type.
    """
    if cfg is None:
        raise ValueError('parallel.tp_plan=None: tp > 1 needs a plan; '
                         f'registered: {", ".join(registered_plans())}, or '
                         "dict(type='module_plan', plan={...}), or a callable")
    if callable(cfg):
        return cfg, {}
    if isinstance(cfg, str):
        return _lookup(cfg), {}
    if not isinstance(cfg, dict):
        raise TypeError('parallel.tp_plan must be a registered name, '
                        f'dict(type=NAME, ...) or a callable; got {cfg!r}')
    if 'type' not in cfg:
        raise ValueError(f'parallel.tp_plan={cfg!r} needs a "type" key; '
                         f'registered: {", ".join(registered_plans())}')
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k != 'type'})
    plan = cfg['type'] if callable(cfg['type']) else _lookup(cfg['type'])
    if plan is module_plan:
        if 'plan' not in kwargs:
            raise ValueError("parallel.tp_plan type='module_plan' needs "
                             "'plan', a dict of module-name pattern -> style")
        check_module_plan_data(kwargs['plan'])
    return plan, kwargs


def check_tp_plan(cfg: PlanCfg) -> None:
    """Validate ``parallel.tp_plan`` without a model (for the config check).

    Raises:
        ValueError / TypeError: as :func:`resolve_tp_plan`.
    """
    resolve_tp_plan(cfg)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh,
             tp_plan: PlanCfg) -> nn.Module:
    """Split ``model``'s layers over ``tp_mesh`` as ``tp_plan`` says.

    Call before activation checkpointing and the data-parallel wrapper.
    Parameters the plan splits become DTensors on ``tp_mesh``, initialised
    from the mesh's rank 0, so ranks agree whatever their seeds.

    Args:
        model: the plain model, on its device; changed in place.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh['tp']``).
        tp_plan: a registered name, ``dict(type=NAME, **kwargs)`` or a
            callable ``plan(model, tp_mesh, **kwargs)``.

    Returns:
        ``model``.

    Raises:
        ValueError: a bad plan (see :func:`module_plan_styles`), raised on
            every rank before any collective.
    """
    plan, kwargs = resolve_tp_plan(tp_plan)
    plan(model, tp_mesh, **kwargs)
    return model


def has_dtensor_params(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (TP or FSDP2)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its local shard if a DTensor.

    Data-parallel wrappers reduce and broadcast these: ranks at the same
    tensor-parallel coordinate hold the same shard, so reducing local shards
    over the data axis is plain data parallelism for a TP model.
    """
    if isinstance(tensor, DTensor):
        return tensor._local_tensor  # no autograd view: in-place edits land
    return tensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``param.grad``, laid out as ``param`` is.

    DTensor's backward may leave a gradient in another layout than its
    parameter (a vocabulary-split embedding gets a replicated gradient); it
    is redistributed to the parameter's layout first (from Replicate no
    communication, from Partial a reduce-scatter every tp rank joins).
    """
    grad = param.grad
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(
            param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
        param.grad = grad
    return local_tensor(grad)


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: a DTensor with its layout if
    ``param`` is one (sharing ``local``'s memory), else ``local``."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements,
                              run_check=False, shape=param.shape,
                              stride=param.stride())


# -- composing with the data-parallel wrapper ---------------------------------
TP_DDP_WRAPPER = 'MMTensorParallelDDP'
# DDP arguments with no meaning for the by-hand replication: unused
# parameters are found by the bucket flags, buffers are broadcast once at
# wrap time, gradients always live in the buckets.
_DDP_ONLY_KEYS = ('find_unused_parameters', 'broadcast_buffers',
                  'gradient_as_bucket_view', 'static_graph', 'device_ids')
_REPLICATE_KEYS = ('sync_strategy', 'process_group', 'bucket_cap_mb',
                   'grad_dtype')


def data_parallel_cfg_for_tp(model_wrapper_cfg: dict, tp: int) -> dict:
    """The wrapper config to build around a tensor-parallel model.

    * ``MMDistributedDataParallel`` (the default) and
      ``MMBucketDataParallel`` become ``MMTensorParallelDDP``: local shards
      all-reduced over the data axis, full checkpoints;
    * ``MMFullyShard`` (FSDP2) and ``MMTensorParallelDDP`` stay;
    * FSDP1, the naive wrapper and any other wrapper are refused.

    Args:
        model_wrapper_cfg: the config's wrapper (None: the default DDP).
        tp: the tensor-parallel size, for messages.

    Returns:
        A new dict; the input is not mutated.

    Raises:
        ValueError: a wrapper (or DDP argument) that cannot replicate a TP
            model, naming the key, the value and what to use instead.
    """
    from mmpar.wrappers import (MMBucketDataParallel,
                                MMDistributedDataParallel,
                                MMFullyShardedDataParallel, MMFullyShard,
                                MMTensorParallelDDP)
    from mmpar.wrappers.builder import DEFAULT_WRAPPER, wrapper_class
    cfg = dict(model_wrapper_cfg or {})
    given = cfg.pop('type', DEFAULT_WRAPPER)
    cls = wrapper_class(given)
    where = f'model_wrapper_cfg.type={given!r} with parallel.tp={tp}'
    if issubclass(cls, (MMFullyShard, MMTensorParallelDDP)):
        return dict(type=given, **cfg)
    if issubclass(cls, MMFullyShardedDataParallel):
        raise ValueError(
            f'{where}: torch FSDP1 does not compose with tensor parallelism '
            "reliably; allowed: type='MMFullyShard' (FSDP2 over the data "
            "axis) or 'MMDistributedDataParallel'")
    if not issubclass(cls, (MMDistributedDataParallel, MMBucketDataParallel)):
        raise ValueError(
            f'{where} is not supported; allowed: MMDistributedDataParallel '
            '(default), MMBucketDataParallel, MMFullyShard')
    for key in list(cfg):
        if key in _DDP_ONLY_KEYS:
            cfg.pop(key)
        elif key not in _REPLICATE_KEYS:
            raise ValueError(
                f'model_wrapper_cfg.{key}={cfg[key]!r}: not supported with '
                f'parallel.tp={tp} (the TP model is replicated by '
                f'{TP_DDP_WRAPPER}); allowed: {", ".join(_REPLICATE_KEYS)}')
    return dict(type=TP_DDP_WRAPPER, **cfg)
