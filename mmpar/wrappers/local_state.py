"""This rank's values of a model, as a plain module sharing their memory.

FSDP2 and tensor parallelism keep parameters as DTensors whose local
tensors are this rank's shards, FSDP1 as views into this rank's part of a
flat parameter, and a pipeline rank holds only its stages. Work that goes
tensor by tensor and element by element over a model's values (weight
averaging: :mod:`mmpar.runner.ema`) can do it on this rank's part alone:
:func:`local_module` gives that part as an ordinary module whose
parameters and buffers *are* the model's local tensors, so in-place edits
land in the model, and whose ``copy.deepcopy`` holds one shard, not the
model.
"""
from typing import Dict, Iterator, Tuple

import torch
from torch import nn

from mmpar.parallel.dtensor import local_tensor
from mmpar.wrappers.base import describe
from mmpar.wrappers.description import WrappedModel


def holds_whole_model(model: nn.Module) -> bool:
    """Whether every rank holds the whole model, whole tensors only (one
    process, DDP, naive and bucketed data parallel)."""
    info = describe(model)
    return info.pipeline is None and not info.holds_shards


# The module FSDP1 wraps is its attribute of this name: FSDP1's
# named_parameters / named_modules carry it, its state dict does not.
FSDP1_PREFIX = '_fsdp_wrapped_module.'


def plain_name(name: str) -> str:
    """``name`` of a parameter or module of an FSDP1-wrapped model as the
    plain model names it (FSDP1's wrapper prefix removed)."""
    return name.replace(FSDP1_PREFIX, '')


def _sources(info: WrappedModel) -> Tuple[nn.Module, ...]:
    """The modules holding this rank's tensors under plain names (with
    wrapper prefixes): the stage copies of a pipeline rank, else the one
    state module."""
    if info.pipeline is not None:
        return info.pipeline.stage_modules
    return (info.state_module, )


def plain_named_parameters(
        model: nn.Module) -> Iterator[Tuple[str, nn.Parameter]]:
    """Every parameter this rank holds of ``model``, as the layout holds it
    (a DTensor, a view into FSDP1's flat parameter, a whole tensor), under
    the plain model's name; a tied parameter once under each of its names.
    No communication."""
    for source in _sources(describe(model)):
        for name, param in source.named_parameters(remove_duplicate=False):
            yield plain_name(name), param


def plain_named_modules(
        model: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """Every module this rank runs of ``model`` under the plain model's
    name (a pipeline rank: the modules of its stages); where a wrapper
    (FSDP1, activation checkpointing) stands around a module under the same
    plain name, the innermost one. No communication."""
    named: Dict[str, nn.Module] = {}
    for source in _sources(describe(model)):
        for name, module in source.named_modules():
            named[plain_name(name)] = module
    yield from named.items()


def _owner(root: nn.Module, name: str):
    """The module of ``root`` that holds dotted ``name`` (made on the way)
    and the last part of the name."""
    *path, leaf = name.split('.')
    module = root
    for part in path:
        child = dict(module.named_children()).get(part)
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    return module, leaf


def local_module(model: nn.Module) -> nn.Module:
    """This rank's part of ``model`` as a module of its local tensors.

    A model every rank holds whole is returned as its plain module
    (``describe(model).state_module``). Otherwise a new ``nn.Module`` tree
    under the plain model's names (a pipeline rank: the parameters and
    buffers of its stages), whose parameters and buffers share memory with
    the model's local tensors; parameters the model ties are tied here too.
    Gathered parameters are freed first (``describe(model).reshard``), so
    the local tensors are the model's only values. Built anew on each call:
    FSDP may move its shards to new tensors (at its lazy initialisation).
    No communication.
    """
    info = describe(model)
    if info.pipeline is None and not info.holds_shards:
        return info.state_module
    info.reshard()
    root = nn.Module()
    aliases: Dict[int, nn.Parameter] = {}
    placed = set()
    for name, param in plain_named_parameters(model):
        if name in placed:
            continue
        placed.add(name)
        alias = aliases.get(id(param))
        if alias is None:
            alias = aliases[id(param)] = nn.Parameter(
                local_tensor(param).detach(), requires_grad=False)
        owner, leaf = _owner(root, name)
        owner.register_parameter(leaf, alias)
    for source in _sources(info):
        for prefix, module in source.named_modules():
            for leaf, buffer in module.named_buffers(recurse=False):
                name = plain_name(f'{prefix}.{leaf}' if prefix else leaf)
                if name in placed:
                    continue
                placed.add(name)
                owner, leaf_name = _owner(root, name)
                # Private set: torch 2.13 has no public way to ask whether
                # a buffer is persistent (part of the state dict).
                persistent = leaf not in module._non_persistent_buffers_set
                owner.register_buffer(
                    leaf_name, local_tensor(buffer).detach(), persistent)
    return root


def named_tensors(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``module``'s parameters (a tied one once) and buffers by name."""
    tensors = dict(module.named_parameters())
    tensors.update(module.named_buffers())
    return tensors
