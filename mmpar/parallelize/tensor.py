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
start-up, never in a hang. The module also says which data-parallel wrapper
composes with a TP model and gives the wrappers this rank's local shards.
See docs/tensor_parallel.md.
"""
import copy
from typing import Callable, List, Tuple, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from mmpar.parallelize.module_plan import check_module_plan_data, module_plan
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


def distribute_like(value, like: torch.Tensor):
    """A whole tensor (as a full checkpoint holds it) as this rank's part of
    DTensor ``like``, cut locally (no collective: every rank has the whole
    value); anything else (``like`` not a DTensor, ``value`` already one or
    of another shape, e.g. an optimizer's step count) unchanged."""
    if isinstance(like, DTensor) and isinstance(value, torch.Tensor) and \
            not isinstance(value, DTensor) and value.shape == like.shape:
        return distribute_tensor(value.to(like.device), like.device_mesh,
                                 like.placements, src_data_rank=None)
    return value
