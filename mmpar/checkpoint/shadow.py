"""A shadow of the model: a second set of its values, shaped as this rank's.

An averaged copy of the weights (EMA) under a sharded or pipelined layout
holds, for each of the model's local tensors, one tensor of the same shape
(:func:`mmpar.wrappers.local_state.local_module`, deep-copied). Its
checkpoint state is the model's, only with the shadow's values: rather
than teach every format every layout again, the shadow's values are swapped
into the model in place (:func:`swapped_in`), the model's own checkpoint
code runs (gathers, DCP, pipeline stages), and the values are swapped back.
Swapping needs no communication and no memory beyond one tensor at a time.
"""
import contextlib
from collections import OrderedDict
from typing import Dict, Iterator

import torch
from mmengine.runner.checkpoint import weights_to_cpu
from torch import nn

from mmpar.checkpoint.state import load_model_state, model_state
from mmpar.wrappers.local_state import local_module, named_tensors


def _pairs(model: nn.Module, shadow: nn.Module):
    live = named_tensors(local_module(model))
    own = named_tensors(shadow)
    missing = [name for name in own if name not in live]
    # An internal invariant: the shadow was copied from local_module(model).
    assert not missing, f'shadow tensors the model lacks: {missing[:5]}'
    return [(own[name], live[name]) for name in own]


@torch.no_grad()
def swap_with_model(model: nn.Module, shadow: nn.Module) -> None:
    """Exchange the values of ``shadow`` and this rank's part of ``model``
    in place (no communication)."""
    for mine, theirs in _pairs(model, shadow):
        held = mine.clone()
        mine.copy_(theirs)
        theirs.copy_(held)


@contextlib.contextmanager
def swapped_in(model: nn.Module, shadow: nn.Module) -> Iterator[None]:
    """Within the block ``model`` holds the shadow's values (and ``shadow``
    the model's); afterwards both hold their own again."""
    swap_with_model(model, shadow)
    try:
        yield
    finally:
        swap_with_model(model, shadow)


def _storages(module: nn.Module) -> set:
    return {t.untyped_storage().data_ptr()
            for t in named_tensors(module).values() if t.numel()}


def full_shadow_state(model: nn.Module,
                      shadow: nn.Module) -> Dict[str, torch.Tensor]:
    """The shadow's values as a full state dict of the plain model (keys as
    ``model_state``), on the CPU. A collective when the model holds shards
    (every rank calls it)."""
    with swapped_in(model, shadow):
        state = model_state(model)
        # A layout whose state dict shares memory with the model (whole or
        # replicated tensors) would see the model's own values again once
        # swapped back: copy those now.
        live = _storages(local_module(model))
        state = OrderedDict(
            (k, v.clone() if isinstance(v, torch.Tensor) and v.numel() and
             v.untyped_storage().data_ptr() in live else v)
            for k, v in state.items())
    return weights_to_cpu(state)


def load_full_shadow_state(model: nn.Module, shadow: nn.Module,
                           state_dict: Dict[str, torch.Tensor]) -> None:
    """Load a plain model's full state dict into the shadow (every rank:
    a collective for some layouts). Keys the state dict lacks keep their
    values; the caller reports mismatched keys."""
    with swapped_in(model, shadow):
        load_model_state(model, dict(state_dict=state_dict), strict=False,
                         revise_keys=[])
