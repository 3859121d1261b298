"""MMEngine's parameter rules (``paramwise_cfg``) on the plain model, under
any layout.

MMEngine's ``DefaultOptimWrapperConstructor``, and the downstream
constructors that override its ``add_params`` (layer-wise lr decay in
mmpretrain, mmdet, mmseg), choose each parameter's lr and weight decay from
its name, its ``ndim`` and its module's type. A layout changes what they
would see: FSDP1 turns every parameter into a 1-D view of its flat parameter
(so ``flat_decay_mult`` matches them all), FSDP1 and activation
checkpointing insert modules into the names, a pipeline rank holds stage
copies. Here ``add_params`` runs on a parameter-free copy of the plain model
(:func:`plain_view`, taken before the layout is applied), and each group it
makes goes to the parameters this rank holds under the same plain names;
the optimizer and its wrapper are then built from those groups as
MMEngine's constructor builds them. Every rank gets exactly one process's
lr and weight decay for its parameters.
"""
import copy
import inspect
from typing import Dict, Iterator, List, Tuple

import torch
from mmengine.model import is_model_wrapper
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapper
from mmengine.registry import (OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS,
                               OPTIMIZERS)
from torch import nn

from mmpar.failures import ConfigError
from mmpar.wrappers.base import describe
from mmpar.wrappers.local_state import (plain_named_modules,
                                        plain_named_parameters)

PARAMS = 'params'


def plain_view(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta
    device: the same classes, attributes, names, shapes, ``requires_grad``
    and ties, no memory. Take it before the layout changes the model."""
    memo: Dict[int, torch.Tensor] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(
            torch.empty_like(param, device='meta'),
            requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device='meta')
    return copy.deepcopy(model, memo)


def names_rules(cfg) -> bool:
    """Whether an optim wrapper config has parameter rules to apply: a
    ``paramwise_cfg`` or a ``constructor`` of its own (which may make
    groups by name). Only such a config needs :func:`plain_view`."""
    return isinstance(cfg, dict) and (
        bool(cfg.get('paramwise_cfg')) or 'constructor' in cfg)


def _uses_add_params(constructor) -> bool:
    # MMEngine's __call__ is what calls add_params; a constructor with its
    # own __call__ may not build the groups that way.
    return isinstance(constructor, DefaultOptimWrapperConstructor) and \
        type(constructor).__call__ is DefaultOptimWrapperConstructor.__call__


def _unwrapped_named_parameters(
        model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """:func:`plain_named_parameters` of ``model``, also without the
    ``module.`` of MMEngine-style wrappers (``is_model_wrapper``) inside the
    model: MMEngine's ``MMSeparateDistributedDataParallel`` wraps each child
    in a DDP, so the plain ``fc1.weight`` is named ``fc1.module.weight``."""
    # Deepest first, so that a wrapper inside a wrapper is unwound.
    inner = sorted((f'{name}.' if name else ''
                    for name, module in plain_named_modules(model)
                    if is_model_wrapper(module)
                    and 'module' in dict(module.named_children())),
                   key=len, reverse=True)
    for name, param in plain_named_parameters(model):
        for prefix in inner:
            if name.startswith(f'{prefix}module.'):
                name = prefix + name[len(prefix) + len('module.'):]
        yield name, param


def _held(model: nn.Module) -> Dict[str, List[nn.Parameter]]:
    held: Dict[str, List[nn.Parameter]] = {}
    for name, param in _unwrapped_named_parameters(model):
        held.setdefault(name, []).append(param)
    return held


def _refuse(key: str, why: str, allowed: str) -> ConfigError:
    return ConfigError(f'optim_wrapper.{key}: {why}; allowed: {allowed}, '
                       f'or optim_wrapper without {key}')


def groups_on_this_rank(groups: List[dict], view: nn.Module,
                        model: nn.Module) -> List[dict]:
    """``groups`` (of ``view``'s parameters) with this rank's parameters of
    the same plain names; groups left with none are dropped (a pipeline rank
    holds some stages only).

    Raises:
        ConfigError: a parameter of the layout has no plain name, or a plain
            parameter is missing where every rank holds every name (FSDP1
            with ``use_orig_params=False``: no per-parameter groups exist).
    """
    names: Dict[int, List[str]] = {}
    for name, param in view.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    held = _held(model)
    plain = {name for aliases in names.values() for name in aliases}
    unnamed, missing = sorted(set(held) - plain), sorted(plain - set(held))
    if unnamed or (missing and describe(model).pipeline is None):
        raise _refuse(
            'paramwise_cfg', f'the layout holds parameters {unnamed[:3]} '
            f'and lacks {missing[:3]} of the plain model, so the rules '
            'cannot be carried over by name', 'MMFullyShardedDataParallel '
            'with use_orig_params=True (the default) or another wrapper')
    placed = []
    for group in groups:
        params, seen = [], set()
        for param in group[PARAMS]:
            for name in names[id(param)]:
                for own in held.get(name, ()):
                    if id(own) not in seen:
                        seen.add(id(own))
                        params.append(own)
        if params:
            placed.append(dict(group, params=params))
    return placed


def _build(constructor: DefaultOptimWrapperConstructor,
           groups: List[dict]) -> OptimWrapper:
    """What ``DefaultOptimWrapperConstructor.__call__`` (MMEngine 0.10)
    does once ``add_params`` has made the groups."""
    optim_wrapper_cfg = constructor.optim_wrapper_cfg.copy()
    optim_wrapper_cfg.setdefault('type', 'OptimWrapper')
    optimizer_cfg = constructor.optimizer_cfg.copy()
    optimizer_cls = optimizer_cfg['type']
    if isinstance(optimizer_cls, str):
        with OPTIMIZERS.switch_scope_and_registry(None) as registry:
            optimizer_cls = registry.get(optimizer_cls)
    # (HybridAdam-style optimizers name their first argument otherwise.)
    first_arg = next(iter(inspect.signature(optimizer_cls).parameters))
    optimizer_cfg[first_arg] = groups
    optimizer = OPTIMIZERS.build(optimizer_cfg)
    return OPTIM_WRAPPERS.build(
        optim_wrapper_cfg, default_args=dict(optimizer=optimizer))


def _holds_plain_shapes(view: nn.Module, model: nn.Module) -> bool:
    shapes = {n: p.shape for n, p in view.named_parameters(
        remove_duplicate=False)}
    return all(shapes.get(name) == param.shape
               for name, param in _unwrapped_named_parameters(model))


def build_with_plain_rules(cfg: dict, view: nn.Module, model: nn.Module,
                           target: nn.Module) -> OptimWrapper:
    """MMEngine's ``build_optim_wrapper(target, cfg)``, its parameter rules
    applied to the plain model.

    Args:
        cfg: the optim wrapper config (``constructor``, ``paramwise_cfg``,
            ``optimizer``...); not changed.
        view: :func:`plain_view` of the model before the layout.
        model: the laid-out model (the Runner's).
        target: what the constructor takes without rules (the model, or
            every pipeline stage of this rank).

    Raises:
        ConfigError: rules the layout cannot carry (see
            :func:`groups_on_this_rank`), or a constructor with its own
            ``__call__`` under a layout that changes parameter shapes
            (FSDP1), naming the key.
    """
    cfg = copy.deepcopy(cfg)
    constructor = OPTIM_WRAPPER_CONSTRUCTORS.build(dict(
        type=cfg.pop('constructor', 'DefaultOptimWrapperConstructor'),
        paramwise_cfg=cfg.pop('paramwise_cfg', None),
        optim_wrapper_cfg=cfg))
    if not _uses_add_params(constructor):
        if not _holds_plain_shapes(view, model):
            raise _refuse(
                'constructor', f'{type(constructor).__name__} builds its '
                'own groups (its own __call__) and this layout changes the '
                'parameters\' shapes, so it would not see the plain model',
                'a constructor that makes its groups in add_params (MMEngine\'s '
                '__call__), or a wrapper that keeps shapes (MMFullyShard, '
                'MMDistributedDataParallel)')
        return constructor(target)
    if not constructor.paramwise_cfg:
        # No rules: MMEngine's one group of every parameter.
        return constructor(target)
    groups: List[dict] = []
    # As MMEngine's __call__: a model's `module` is what it optimises.
    constructor.add_params(groups, getattr(view, 'module', view))
    return _build(constructor, groups_on_this_rank(groups, view, model))
