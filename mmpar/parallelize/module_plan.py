"""``module_plan``: a tensor-parallel plan as plain data.

Module-name patterns map to styles: torch's ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel`` and mmpar's ``replicate``; an entry
may be a dict ``dict(style=..., input_layouts=..., output_layouts=...,
use_local_output=...)`` with layouts written ``'replicate'``, ``'shard(N)'``
or ``'partial'``. Everything the data can get wrong (unknown style or layout,
a pattern matching no module, a module the style cannot split, tp not
dividing a split dimension) is found before the first collective. See
docs/tensor_parallel.md.
"""
import fnmatch
import re
from typing import Dict, List

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate,
                                      Shard, distribute_module)
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               ParallelStyle, RowwiseParallel,
                                               SequenceParallel,
                                               parallelize_module)

from mmpar.registry import TP_PLANS

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
