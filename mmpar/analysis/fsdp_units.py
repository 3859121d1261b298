"""FSDP units of a model, and what each rank holds of them (arithmetic).

The plan tool shows, for an FSDP wrapper, the units its wrap policy makes and
the parameters a rank keeps. Tests check these numbers against real torch
FSDP1 flat parameters and FSDP2 ``fully_shard`` shards built on the fake
process group.
"""
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from torch import nn

# Where a wrapper config names its wrap policy: mmpar's FSDP wrappers, then
# MMEngine's / torch's spelling.
POLICY_KEYS = ('fsdp_auto_wrap_policy', 'auto_wrap_policy')


class PlanError(ValueError):
    """A config that cannot run at the requested world size."""


@dataclass
class FsdpUnit:
    """One FSDP unit: the module and the parameters its flat param holds.

    ``numel`` and ``numel_per_rank`` count every parameter (the weights);
    ``trainable`` and ``trainable_per_rank`` the elements that get a
    gradient and optimizer state (:func:`fsdp_units` says which).
    """
    name: str
    cls: str
    numel: int
    numel_per_rank: int
    trainable: int
    trainable_per_rank: int


def resolve_policy(policy_cfg, model: Optional[nn.Module] = None,
                   key: str = 'fsdp_auto_wrap_policy'
                   ) -> Tuple[Optional[Callable], Optional[str]]:
    """Turn a wrap-policy config (name, dict, callable or None) into a callable.

    Uses the FSDP wrappers' own resolver
    (:func:`mmpar.wrappers.policies.resolve_wrap_policy`), so the plan and
    training agree.

    Returns:
        ``(policy, description)``; ``(None, None)`` for no policy.

    Raises:
        PlanError: an unknown policy or bad arguments, naming ``key``.
    """
    from mmpar.wrappers.policies import resolve_wrap_policy
    if policy_cfg is None:
        return None, None
    if callable(policy_cfg):
        return policy_cfg, getattr(policy_cfg, '__name__', repr(policy_cfg))
    if isinstance(policy_cfg, dict) and 'type' in policy_cfg:
        kwargs = {k: v for k, v in policy_cfg.items() if k != 'type'}
        name = policy_cfg['type']
    else:
        name, kwargs = policy_cfg, {}
    description = f'{getattr(name, "__name__", name)}' + ''.join(
        f', {k}={v!r}' for k, v in kwargs.items())
    try:
        return resolve_wrap_policy(policy_cfg, model), description
    except (TypeError, ValueError) as err:
        raise PlanError(f'model_wrapper_cfg.{key}: {err}') from err


def fsdp_units(model: nn.Module, policy: Optional[Callable],
               shard_size: int, per_param: bool = False) -> List[FsdpUnit]:
    """The FSDP units ``policy`` makes of ``model``, root first.

    The units are :func:`mmpar.wrappers.policies.modules_to_wrap`'s choice
    (FSDP1's recursive wrap, which the FSDP2 wrapper runs too); tests check
    them against real FSDP1 and FSDP2 units. Each unit holds the parameters
    not inside a nested unit. FSDP1 flattens them into one parameter padded to a multiple
    of the shard size: a rank holds ``ceil(numel / shard_size)``. FSDP2
    (``per_param``) shards every parameter along dim 0, padded per parameter:
    a rank holds ``ceil(rows / shard_size) * row_numel`` for each.

    Frozen parameters (``requires_grad=False``) are weights but get no
    gradient: FSDP2 leaves each one without a gradient or optimizer state.
    FSDP1 gives a flat parameter with any trainable parameter a whole
    gradient (torch's ``_flat_param.py``; its frozen parameters' optimizer
    state, which they do not get, is over-counted with it) and one with
    none no gradient.
    """
    from mmpar.wrappers.policies import modules_to_wrap
    chosen = [] if policy is None else modules_to_wrap(model, policy)
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
        held = _unit_numel(params, shard_size, per_param)
        if per_param:
            trained = _unit_numel([p for p in params if p.requires_grad],
                                  shard_size, per_param)
        else:
            trained = held if any(p.requires_grad for p in params) else (0, 0)
        units.append(FsdpUnit(names[unit] or '(root)', type(unit).__name__,
                              *held, *trained))
    return units


def _unit_numel(params: List[nn.Parameter], shard_size: int,
                per_param: bool) -> Tuple[int, int]:
    """``(elements, elements a rank holds)`` of ``params`` in one unit."""
    numel = sum(p.numel() for p in params)
    if per_param:
        per_rank = sum(
            math.ceil(p.shape[0] / shard_size) * (p.numel() // p.shape[0])
            if p.dim() else p.numel() for p in params)
    else:
        per_rank = math.ceil(numel / shard_size)
    return numel, per_rank
