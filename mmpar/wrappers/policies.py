"""FSDP auto-wrap policies by name, so configs stay plain data.

A policy is a callable with torch's signature
``(module, recurse, nonwrapped_numel, **kwargs) -> bool``: with
``recurse=True`` it answers "look inside this module?", with ``recurse=False``
"give this module its own FSDP unit?". Both FSDP wrappers take
``fsdp_auto_wrap_policy`` as a registered name, ``dict(type=NAME, **kwargs)``
or a callable; :func:`resolve_wrap_policy` turns any of those into one torch
policy callable. User policies register with
``@FSDP_WRAP_POLICIES.register_module()`` in a module that the config imports
through ``custom_imports``.
"""
import functools
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

from mmpar.registry import (FSDP_WRAP_POLICIES, lookup_callable,
                            registered_names)

PolicyCfg = Union[None, str, dict, Callable]


# Wraps a module once its not-yet-wrapped parameters reach
# ``min_num_params`` (1e8 by default): torch's policy, under a short name.
size_based = FSDP_WRAP_POLICIES.register_module(
    name='size_based', module=size_based_auto_wrap_policy)


def _bind_module_class(model: nn.Module, kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    if 'module_classes' not in kwargs:
        raise ValueError("fsdp_auto_wrap_policy type='module_class' needs "
                         "'module_classes', a list of class names or classes")
    kwargs['module_classes'] = resolve_module_classes(
        model, kwargs['module_classes'], key='module_classes')
    return kwargs


_FORCE_LEAF_MODULES = tuple(size_based_auto_wrap_policy.FORCE_LEAF_MODULES)


@FSDP_WRAP_POLICIES.register_module(name='module_class')
def module_class(module: nn.Module,
                 recurse: bool,
                 nonwrapped_numel: int,
                 module_classes: Iterable[type] = (),
                 **kwargs) -> bool:
    """Wrap every instance of the given classes (torch's ModuleWrapPolicy).

    Args:
        module_classes: classes, or class names resolved against the model's
            own modules when the policy is bound to a model.
    """
    if recurse:
        # Like torch's size-based policy, never look inside modules that read
        # their children's weights without calling them (MultiheadAttention
        # uses ``out_proj.weight`` directly): a unit there never all-gathers.
        return not isinstance(module, _FORCE_LEAF_MODULES)
    # Names still unresolved (no model was bound) match the exact class.
    return any(
        isinstance(module, cls) if isinstance(cls, type) else
        type(module).__name__ == cls for cls in module_classes)


# Runs when the policy is bound to a model: class names become classes, and a
# name the model does not contain is an error now rather than a silent no-op.
module_class.bind_to_model = _bind_module_class


def model_classes(model: nn.Module) -> Dict[str, type]:
    """``{class name: class}`` for every module in ``model`` and itself (a
    module whose class a technique replaced by a subclass in place, such as
    activation checkpointing, by the class it was built as:
    ``mmpar_plain_class``)."""
    found = {}
    for module in model.modules():
        cls = getattr(type(module), 'mmpar_plain_class', type(module))
        found.setdefault(cls.__name__, cls)
        found.setdefault(f'{cls.__module__}.{cls.__qualname__}', cls)
    return found


def resolve_module_classes(model: nn.Module,
                           classes: Union[str, type, Iterable],
                           key: str = 'module_classes') -> tuple:
    """Turn class names (or classes) into the classes ``model`` contains.

    Args:
        model: the model whose modules the names are looked up in.
        classes: a name, a class, or a list of them. A name may be the bare
            class name or ``'package.module.ClassName'``.
        key: the config key, for error messages.

    Returns:
        A tuple of classes.

    Raises:
        ValueError: a name that matches no module in ``model``; the message
            lists the class names the model does contain.
        TypeError: an entry that is neither a str nor a class.
    """
    if isinstance(classes, (str, type)):
        classes = [classes]
    found = model_classes(model)
    resolved: List[type] = []
    for entry in classes:
        if isinstance(entry, type):
            resolved.append(entry)
        elif isinstance(entry, str):
            if entry not in found:
                names = sorted(n for n in found if '.' not in n)
                raise ValueError(
                    f'{key}: {entry!r} matches no module in '
                    f'{type(model).__name__}; its modules are of classes: '
                    f'{", ".join(names)}')
            resolved.append(found[entry])
        else:
            raise TypeError(f'{key}: entries must be class names or classes, '
                            f'got {entry!r}')
    return tuple(resolved)


def _policy_and_kwargs(cfg: PolicyCfg) -> Tuple[Optional[Callable], dict]:
    """A policy config's callable (None: none) and the kwargs to bind,
    checked without a model."""
    if cfg is None or callable(cfg):
        return cfg, {}
    if isinstance(cfg, str):
        cfg = dict(type=cfg)
    elif not isinstance(cfg, dict):
        raise TypeError('fsdp_auto_wrap_policy must be None, a registered '
                        'name, dict(type=NAME, ...) or a callable; got '
                        f'{cfg!r}')
    elif 'type' not in cfg:
        raise ValueError('fsdp_auto_wrap_policy dict needs a "type" key '
                         f'naming a policy; got {cfg!r}; registered: '
                         f'{", ".join(registered_names(FSDP_WRAP_POLICIES))}')
    policy = cfg['type']
    if not callable(policy):
        policy = lookup_callable(FSDP_WRAP_POLICIES, policy,
                                 'fsdp_auto_wrap_policy')
    return policy, {k: v for k, v in cfg.items() if k != 'type'}


def check_wrap_policy(cfg: PolicyCfg) -> PolicyCfg:
    """Validate a policy config without a model (name and kwargs' shape);
    returns it.

    Raises:
        ValueError: unknown name, or a dict without ``type``.
        TypeError: a value of the wrong type, or a non-callable entry.
    """
    _policy_and_kwargs(cfg)
    return cfg


def resolve_wrap_policy(cfg: PolicyCfg,
                        model: Optional[nn.Module] = None
                        ) -> Optional[Callable]:
    """Turn a policy config into a torch policy callable.

    Args:
        cfg: None; a registered name; ``dict(type=NAME_OR_CALLABLE,
            **kwargs)`` (kwargs are bound to the policy); or a callable.
        model: the model the policy will wrap; a policy with a
            ``bind_to_model(model, kwargs)`` attribute (``module_class``)
            resolves its kwargs against it.

    Returns:
        None or ``policy(module, recurse, nonwrapped_numel) -> bool``. The
        config is not mutated.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
        TypeError: a registered entry that is not callable.
    """
    policy, kwargs = _policy_and_kwargs(cfg)
    if policy is cfg:  # None, or a callable as given
        return policy
    bind = getattr(policy, 'bind_to_model', None)
    if bind is not None and model is not None:
        kwargs = bind(model, kwargs)
    return functools.partial(policy, **kwargs) if kwargs else policy


def modules_to_wrap(root: nn.Module, policy: Callable) -> List[nn.Module]:
    """The submodules ``policy`` gives their own unit, children first.

    Mirrors FSDP1's ``_recursive_wrap`` (the root itself is never returned;
    callers wrap it last), so a policy picks the same modules under FSDP2's
    ``fully_shard`` as under FSDP1.
    """
    chosen: List[nn.Module] = []

    def visit(module: nn.Module) -> int:
        # Returns how many of module's parameters ended up in a unit.
        numel = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child) for child in module.children())
        if module is not root and policy(
                module=module, recurse=False,
                nonwrapped_numel=numel - wrapped):
            chosen.append(module)
            return numel
        return wrapped

    visit(root)
    return chosen
