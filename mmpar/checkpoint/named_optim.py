"""Optimizer state keyed by the plain model's parameter names, built by hand.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` need
one module that owns every parameter of the optimizer under its plain name.
A pipelined rank has no such module: its optimizer spans several stage
copies (each a wrapper around a part of the model). These functions take
the name of each parameter instead (``names[param] -> 'layers.3.weight'``)
and produce or consume the same form torch does (``state`` keyed by names,
``param_groups`` listing names), so checkpoints move between a pipelined run
and any other layout.
"""
from typing import Dict, List, Mapping

import torch
from torch.distributed.tensor import DTensor

from mmpar.failures import ConfigError
from mmpar.parallel.dtensor import distribute_like

STATE, GROUPS, PARAMS = 'state', 'param_groups', 'params'


def named_optim_state(optimizer: torch.optim.Optimizer,
                      names: Mapping[torch.Tensor, str],
                      full: bool) -> dict:
    """This optimizer's state keyed by ``names``.

    Args:
        optimizer: the optimizer.
        names: each of its parameters' plain name.
        full: gather DTensor state into whole tensors (a collective over each
            tensor's mesh, in parameter order: ranks of one mesh hold the same
            parameters); else DTensors stay (for DCP, which writes shards).

    Returns:
        ``{'state': {name: {key: value}}, 'param_groups': [{..., 'params':
        [names]}]}``.
    """
    state, groups = {}, []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != PARAMS})
        groups[-1][PARAMS] = [names[p] for p in group[PARAMS]]
        for param in group[PARAMS]:
            entries = optimizer.state.get(param)
            if entries:
                state[names[param]] = {
                    k: v.full_tensor() if full and isinstance(v, DTensor)
                    else v
                    for k, v in entries.items()
                }
    return {STATE: state, GROUPS: groups}


def merge_named_optim_states(parts: List[dict]) -> dict:
    """One named state from the parts of ranks holding disjoint parameters
    (pipeline stages): states united, param groups listed one after another
    (torch and :func:`localize_named_optim_state` match groups by name)."""
    state, groups = {}, []
    for part in parts:
        state.update(part[STATE])
        groups.extend(part[GROUPS])
    return {STATE: state, GROUPS: groups}


def localize_named_optim_state(optimizer: torch.optim.Optimizer,
                               names: Mapping[torch.Tensor, str],
                               saved: dict) -> Dict[str, object]:
    """``saved`` (keyed by names) as ``optimizer.state_dict()`` would be.

    Each of this optimizer's groups takes the hyper-parameters of the saved
    group that lists its first parameter (learning rates as the schedulers
    left them); each parameter takes its own saved state, cut to this rank's
    shard where the parameter is a DTensor. The optimizer is not changed.

    Raises:
        ConfigError: a parameter of this rank that the checkpoint's param
            groups do not list.
    """
    group_of = {name: g for g in saved[GROUPS] for name in g[PARAMS]}
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        ids, source = [], None
        for param in group[PARAMS]:
            name = names[param]
            if name not in group_of:
                # Not CheckpointLoadError (a corrupt file, for which resume
                # tries the previous one): another model's checkpoint.
                raise ConfigError(
                    f'the checkpoint has no optimizer entry for parameter '
                    f'{name!r}; it was saved from another model. Allowed: a '
                    'checkpoint of this model, or load_from (weights only)')
            source = source or group_of[name]
            if name in saved[STATE]:
                state[index] = {
                    k: distribute_like(v, param)
                    for k, v in saved[STATE][name].items()
                }
            ids.append(index)
            index += 1
        hyper = {k: v for k, v in (source or group).items() if k != PARAMS}
        groups.append(dict(hyper, params=ids))
    return {STATE: state, GROUPS: groups}
