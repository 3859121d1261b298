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

The plan's own checks (:mod:`mmpar.parallelize.module_plan` for the data
form) run on every rank before the first collective, so a bad plan fails at
start-up, never in a hang; the split model's first call is dry-run on the
meta device first (:mod:`mmpar.parallelize.tp_check`), so split shapes the
model's code does not accept fail naming the plan, never deep in the model.
See docs/tensor_parallel.md. Helpers for this rank's part of a DTensor
live in :mod:`mmpar.parallel.dtensor`.
"""
import copy
import inspect
from typing import Callable, Dict, List, Tuple, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mmpar.parallelize.module_plan import check_module_plan_data, module_plan
from mmpar.parallelize.tp_check import install_dry_run, split_labels
from mmpar.registry import TP_PLANS, lookup_callable, registered_names

PlanCfg = Union[None, str, dict, Callable]


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
    _check_plan_kwargs(plan, kwargs)
    if plan is module_plan:
        if 'plan' not in kwargs:
            raise ValueError("parallel.tp_plan type='module_plan' needs "
                             "'plan', a dict of module-name pattern -> style")
        check_module_plan_data(kwargs['plan'])
    return plan, kwargs


def _check_plan_kwargs(plan: Callable, kwargs: dict) -> None:
    """The keys of ``tp_plan`` besides ``type`` are keyword arguments of
    ``plan(model, tp_mesh, ...)``: refuse one it does not take."""
    try:
        params = list(inspect.signature(plan).parameters.values())[2:]
    except (TypeError, ValueError):
        return  # no signature to read (a builtin)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params
               if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key, value in kwargs.items():
        if key not in allowed:
            name = getattr(plan, '__name__', repr(plan))
            raise ValueError(
                f'parallel.tp_plan.{key}={value!r} is not allowed: the plan '
                f'function {name}() takes no argument {key!r}; allowed: '
                + (', '.join(allowed) if allowed else 'no keys besides type'))


def check_tp_plan(cfg: PlanCfg) -> None:
    """Validate ``parallel.tp_plan`` without a model (for the config check).

    Raises:
        ValueError / TypeError: as :func:`resolve_tp_plan`.
    """
    resolve_tp_plan(cfg)


def splits_sequence(cfg: PlanCfg) -> bool:
    """Whether the ``tp_plan`` config splits each rank's sequence over
    tp (sequence parallelism), so that its length must divide by tp: a
    ``module_plan``, or a registered plan function that declares the
    module plan it applies (its ``plan_data``, as Llama's do), with a
    ``'sequence_parallel'`` entry."""
    plan, kwargs = resolve_tp_plan(cfg)
    data = kwargs['plan'] if plan is module_plan else \
        getattr(plan, 'plan_data', None)
    return data is not None and any(
        entry['style'] == 'sequence_parallel'
        for entry in check_module_plan_data(data).values())


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: PlanCfg,
             dry_run: bool = True) -> nn.Module:
    """Split ``model``'s layers over ``tp_mesh`` as ``tp_plan`` says.

    Call before activation checkpointing and the data-parallel wrapper.
    Parameters the plan splits become DTensors on ``tp_mesh``, initialised
    from the mesh's rank 0, so ranks agree whatever their seeds.

    Args:
        model: the plain model, on its device; changed in place.
        tp_mesh: the 1-D tensor-parallel mesh (``mesh['tp']``).
        tp_plan: a registered name, ``dict(type=NAME, **kwargs)`` or a
            callable ``plan(model, tp_mesh, **kwargs)`` (which may return
            ``{module name: style}`` for the messages below).
        dry_run: dry-run the model's first call on a meta replica
            (:func:`~mmpar.parallelize.tp_check.install_dry_run`).

    Returns:
        ``model``.

    Raises:
        ValueError: a bad plan (see :func:`module_plan_styles`), raised on
            every rank before any collective.
        ConfigError: (at the first call) the split model's forward fails,
            naming the module and its style.
    """
    labels = split_model(model, tp_mesh, tp_plan)
    if dry_run:
        install_dry_run(model, labels)
    return model


def split_model(model: nn.Module, tp_mesh: DeviceMesh,
                tp_plan: PlanCfg) -> Dict[str, str]:
    """Apply ``tp_plan`` to ``model`` (as :func:`apply_tp`, without the dry
    run).

    Returns:
        ``{module name: its style}`` of the split modules, as the plan wrote
        it (``module_plan`` and ``hf``) or as their parameters' layouts.
    """
    plan, kwargs = resolve_tp_plan(tp_plan)
    labels = plan(model, tp_mesh, **kwargs)
    return labels if isinstance(labels, dict) else split_labels(model)
