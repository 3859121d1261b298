"""``module_plan``: a tensor-parallel plan as plain data.

Module-name patterns map to styles: torch's ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel`` and mmpar's ``replicate`` and
``prepare_input`` (a block's input laid out once for all its split layers),
``replicate_sharded_input``; an entry may be a dict ``dict(style=...,
input_layouts=..., output_layouts=..., desired_input_layouts=...,
use_local_output=..., fused=...)`` with layouts written ``'replicate'``,
``'shard(N)'`` or ``'partial'``; ``dict(style='colwise', fused=3)`` splits a
projection packing 3 outputs (timm's ``qkv``) part by part. Everything the
data can get wrong (unknown style or layout, a pattern matching no module, a
module the style cannot split, tp (times ``fused``) not dividing a split
dimension) is found before the first collective. See
docs/tensor_parallel.md.
"""
import fnmatch
import re
from typing import Dict, List, Optional, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               ParallelStyle, RowwiseParallel,
                                               SequenceParallel,
                                               parallelize_module)

from mmpar.parallelize.tp_styles import (FusedColwiseParallel, PrepareInput,
                                         ReplicateParallel,
                                         ReplicateShardedInput,
                                         positional_parameters)
from mmpar.registry import TP_PLANS

# style -> the entry keys it takes besides ``style``.
STYLE_KEYS = {
    'colwise': ('input_layouts', 'output_layouts', 'use_local_output',
                'fused'),
    'rowwise': ('input_layouts', 'output_layouts', 'use_local_output'),
    'sequence_parallel': ('use_local_output', ),
    'replicate': ('use_local_output', ),
    'replicate_sharded_input': ('use_local_output', ),
    'prepare_input': ('input_layouts', 'desired_input_layouts',
                      'use_local_output'),
}
STYLES = tuple(STYLE_KEYS)
ENTRY_KEYS = ('style', 'input_layouts', 'output_layouts',
              'desired_input_layouts', 'use_local_output', 'fused')
# Modules torch's Colwise/RowwiseParallel can split, and which weight
# dimension each style splits: (colwise, rowwise).
SPLIT_DIMS = {nn.Linear: (0, 1), nn.Embedding: (1, 0)}
# With sequence parallelism between blocks the residual stream is sharded on
# the sequence dimension (torchtitan's and Megatron's layout).
SEQUENCE_DIM = 1


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


def _layout_tuple(value, key: str) -> Tuple[Optional[Placement], ...]:
    """A ``prepare_input`` layout list: one layout, or a list/tuple of
    layouts and None (arguments left alone)."""
    if isinstance(value, (list, tuple)):
        return tuple(None if v is None else parse_layout(v, f'{key}[{i}]')
                     for i, v in enumerate(value))
    return (parse_layout(value, key), )


def prepare_input_layouts(entry: dict, activation: Placement, where: str
                          ) -> Tuple[tuple, tuple]:
    """``(input_layouts, desired_input_layouts)`` of a ``prepare_input``
    entry, per positional parameter, defaults filled in.

    Default input: ``activation`` (the layout between blocks: ``Shard(1)``
    under sequence parallelism, else ``Replicate()``) for the first
    parameter only; default desired: ``Replicate()`` wherever an input
    layout is given.

    Raises:
        ValueError: lists of different lengths, or a desired layout for an
            argument left alone, naming ``where`` and the values.
    """
    inputs, desired = (
        None if entry.get(name) is None else
        _layout_tuple(entry[name], f'{where}.{name}')
        for name in ('input_layouts', 'desired_input_layouts'))
    if inputs is None:
        inputs = (activation, ) if desired is None else tuple(
            None if d is None else activation for d in desired)
    if desired is None:
        desired = tuple(None if i is None else Replicate() for i in inputs)
    if len(inputs) != len(desired):
        raise ValueError(
            f'{where}: input_layouts={entry.get("input_layouts")!r} and '
            f'desired_input_layouts={entry.get("desired_input_layouts")!r} '
            'have different lengths; allowed: one layout (or None) per '
            'positional argument in each')
    if all(layout is None for layout in inputs):
        raise ValueError(f'{where}: every argument is left alone (None); '
                         'allowed: a layout for at least one argument')
    for index, (given, wanted) in enumerate(zip(inputs, desired)):
        if (given is None) != (wanted is None):
            raise ValueError(
                f'{where}: argument {index} has input layout {given!r} and '
                f'desired layout {wanted!r}; allowed: both layouts, or both '
                'None (the argument left alone)')
    return inputs, desired


def _normalize_entry(pattern: str, entry, key: str) -> dict:
    """One plan entry as ``dict(style=..., **layout options)``."""
    entry = dict(style=entry) if isinstance(entry, str) else entry
    where = f'{key}[{pattern!r}]'
    if not isinstance(entry, dict):
        raise ValueError(f'{where}={entry!r} is not allowed; '
                         f'allowed: a style ({", ".join(STYLES)}) or '
                         f'dict with keys {", ".join(ENTRY_KEYS)}')
    unknown = [k for k in entry if k not in ENTRY_KEYS]
    if unknown:
        raise ValueError(f'{where}.{unknown[0]} is not a known '
                         f'key; allowed: {", ".join(ENTRY_KEYS)}')
    style = entry.get('style')
    if style not in STYLES:
        raise ValueError(f'{where} style={style!r} is not a '
                         f'tensor-parallel style; allowed: {", ".join(STYLES)}')
    for name, value in entry.items():
        if name != 'style' and name not in STYLE_KEYS[style]:
            raise ValueError(
                f'{where}.{name}={value!r}: style {style!r} takes no {name}; '
                f'allowed: {", ".join(STYLE_KEYS[style])}')
    if not isinstance(entry.get('use_local_output', False), bool):
        raise ValueError(f'{where}.use_local_output='
                         f'{entry["use_local_output"]!r} is not allowed; '
                         'allowed: True or False')
    if style == 'prepare_input':
        prepare_input_layouts(entry, Replicate(), where)
        return dict(entry)
    if 'fused' in entry:
        _check_fused(entry, where)
    for name in ('input_layouts', 'output_layouts'):
        if entry.get(name) is not None:
            parse_layout(entry[name], f'{where}.{name}')
    return dict(entry)


def _check_fused(entry: dict, where: str) -> None:
    fused = entry['fused']
    if not isinstance(fused, int) or isinstance(fused, bool) or fused < 1:
        raise ValueError(f'{where}.fused={fused!r} is not allowed; allowed: '
                         'an int >= 1, the number of equal parts the '
                         "output packs (3 for a fused q/k/v, 2 for "
                         'gate/up)')
    output = entry.get('output_layouts')
    if fused > 1 and output is not None and \
            parse_layout(output, f'{where}.output_layouts') != Replicate():
        raise ValueError(f'{where}.output_layouts={output!r} is not allowed '
                         'with fused; allowed: None (this rank\'s part of '
                         "each packed part) or 'replicate'")


def check_module_plan_data(plan, key: str = 'parallel.tp_plan.plan'
                           ) -> Dict[str, dict]:
    """Check a ``module_plan`` mapping without a model (styles, layouts).

    Returns:
        ``{pattern: dict(style=..., ...)}``, each entry as a dict.

    Raises:
        ValueError: naming the key, the bad value and what is allowed.
    """
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f'{key}={plan!r} is not allowed; allowed: a '
                         'non-empty dict of module-name pattern -> style')
    entries = {}
    for pattern, entry in plan.items():
        if not isinstance(pattern, str):
            raise ValueError(f'{key}: pattern {pattern!r} must be a str')
        entries[pattern] = _normalize_entry(pattern, entry, key)
    return entries


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


def _check_split(name: str, module: nn.Module, entry: dict, tp_size: int,
                 key: str) -> None:
    style, fused = entry['style'], entry.get('fused', 1)
    if style not in ('colwise', 'rowwise'):
        return
    if fused > 1 and not isinstance(module, nn.Linear):
        raise ValueError(
            f'{key}: {name!r} is a {type(module).__name__}; '
            f'dict(style={style!r}, fused={fused}) splits only nn.Linear')
    kinds = [cls for cls in SPLIT_DIMS if isinstance(module, cls)]
    if not kinds:
        raise ValueError(
            f'{key}: {name!r} is a {type(module).__name__}; style {style!r} '
            'splits only nn.Linear and nn.Embedding (give its Linear '
            'children their own entries, or use sequence_parallel/replicate)')
    dim = SPLIT_DIMS[kinds[0]][0 if style == 'colwise' else 1]
    size = module.weight.shape[dim]
    if fused > 1 and size % (fused * tp_size):
        raise ValueError(
            f'{key}: tp={tp_size} x fused={fused} does not divide {name!r} '
            f'(colwise): its weight {tuple(module.weight.shape)} packs '
            f'{fused} parts in dim 0 of size {size}, each split over tp; '
            f'allowed: fused x tp dividing {size}')
    if size % tp_size:
        raise ValueError(
            f'{key}: tp={tp_size} does not divide {name!r} ({style}): its '
            f'weight {tuple(module.weight.shape)} is split on dim {dim} of '
            f'size {size}; allowed: a tp that divides {size}')


def _check_prepare_input(name: str, module: nn.Module, inputs: tuple,
                         key: str) -> None:
    """The layouts point at parameters ``module.forward`` has."""
    names, var_args = positional_parameters(module)
    last = max(i for i, layout in enumerate(inputs) if layout is not None)
    if last >= len(names) and not var_args:
        raise ValueError(
            f'{key}: {name!r} ({type(module).__name__}) prepare_input has a '
            f'layout for positional argument {last}, but its forward takes '
            f'{len(names)} ({", ".join(names) or "none"}); allowed: one '
            'layout (or None) per positional parameter, in order')


def _prepared_layout(name: str, prepared: Dict[str, Placement]
                     ) -> Optional[Placement]:
    """The layout the nearest ``prepare_input`` ancestor of ``name`` gives
    its first argument, or None."""
    while '.' in name:
        name = name.rsplit('.', 1)[0]
        if name in prepared:
            return prepared[name]
    return None


def _style(entry: dict, sequence_parallel: bool, module: nn.Module,
           prepared: Optional[Placement]) -> ParallelStyle:
    kwargs = {
        k: (parse_layout(v, k) if k.endswith('layouts') else v)
        for k, v in entry.items() if k != 'style' and v is not None
    }
    style = entry['style']
    fused = kwargs.pop('fused', 1)
    if style == 'colwise':
        if prepared is not None:
            # Inside a prepare_input module: the input was laid out (e.g.
            # gathered) once for every split layer there.
            kwargs.setdefault('input_layouts', prepared)
        elif sequence_parallel:
            kwargs.setdefault('input_layouts', Shard(SEQUENCE_DIM))
        if fused > 1:
            return FusedColwiseParallel(fused=fused, **kwargs)
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
        return SequenceParallel(sequence_dim=SEQUENCE_DIM, **kwargs)
    if style == 'replicate_sharded_input':
        return ReplicateShardedInput(**kwargs)
    return ReplicateParallel(**kwargs)


def module_plan_styles(model: nn.Module, plan: dict, tp_size: int,
                       key: str = 'parallel.tp_plan.plan'
                       ) -> Dict[str, ParallelStyle]:
    """Expand a ``module_plan`` into ``{module name: torch ParallelStyle}``.

    Defaults follow torchtitan: without ``sequence_parallel`` entries,
    colwise takes a replicated input and rowwise gives a replicated output;
    with them, the activations between blocks are sharded on the sequence
    dimension (colwise's input and rowwise's output default to
    ``Shard(1)``). A ``prepare_input`` module's first argument defaults to
    that layout between blocks, made ``Replicate()`` once; the colwise
    layers inside it then default to a replicated input. An entry's own
    layouts override any default.

    Raises:
        ValueError: a bad style or layout, a pattern that matches no module
            (listing the model's module names), a module matched twice, a
            module the style cannot split, tp not dividing a split
            dimension (naming the module and sizes), or a ``prepare_input``
            layout for a parameter the module's forward does not have.
    """
    entries = check_module_plan_data(plan, key)
    sequence_parallel = any(
        e['style'] == 'sequence_parallel' for e in entries.values())
    activation = Shard(SEQUENCE_DIM) if sequence_parallel else Replicate()
    modules = dict(model.named_modules())
    assigned: Dict[str, dict] = {}
    for pattern, entry in entries.items():
        names = match_modules(model, pattern)
        if not names:
            listed = ', '.join(n for n in modules if n)
            raise ValueError(f'{key}: pattern {pattern!r} matches no module '
                             f'of {type(model).__name__}; its modules: '
                             f'{listed}')
        for name in names:
            if name in assigned:
                raise ValueError(f'{key}: {name!r} is matched by more than '
                                 f'one pattern (the last is {pattern!r})')
            _check_split(name, modules[name], entry, tp_size, key)
            assigned[name] = dict(entry, pattern=pattern)
    styles: Dict[str, ParallelStyle] = {}
    prepared: Dict[str, Placement] = {}
    for name, entry in assigned.items():
        if entry['style'] == 'prepare_input':
            inputs, desired = prepare_input_layouts(
                entry, activation, f'{key}[{entry["pattern"]!r}]')
            _check_prepare_input(name, modules[name], inputs, key)
            prepared[name] = desired[0]
            styles[name] = PrepareInput(
                input_layouts=inputs, desired_input_layouts=desired,
                use_local_output=entry.get('use_local_output', False))
    for name, entry in assigned.items():
        if entry['style'] != 'prepare_input':
            entry = {k: v for k, v in entry.items() if k != 'pattern'}
            styles[name] = _style(entry, sequence_parallel, modules[name],
                                  _prepared_layout(name, prepared))
    return styles


@TP_PLANS.register_module(name='module_plan')
def module_plan(model: nn.Module, tp_mesh: DeviceMesh,
                plan: dict) -> Dict[str, str]:
    """Split ``model`` by plain data: module-name patterns -> styles.

    Args:
        model: the plain model; changed in place.
        tp_mesh: the 1-D tensor-parallel mesh.
        plan: ``{pattern: style or dict(style=..., input_layouts=...,
            output_layouts=..., use_local_output=..., fused=...)}``.

    Returns:
        ``{module name: its entry as written}``, for messages.
    """
    styles = module_plan_styles(model, plan, tp_mesh.size())
    parallelize_module(model, tp_mesh, styles)
    return {name: _label(plan[pattern]) for pattern in plan
            for name in match_modules(model, pattern)}


def _label(entry) -> str:
    if isinstance(entry, str):
        return repr(entry)
    return 'dict(' + ', '.join(f'{k}={v!r}' for k, v in entry.items()) + ')'
