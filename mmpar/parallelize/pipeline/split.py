"""How a model becomes pipeline stages: the protocol and the split.

A BaseModel can be pipelined when it says which modules run before, inside
and after an ordered container of layers, and how to run each part::

    class MyModel(BaseModel):
        pipeline_layers = 'blocks'                 # ModuleList/Sequential/Dict
        pipeline_pre = ('patch_embed', 'pos_embed')  # first stage only
        pipeline_post = ('norm', 'head')           # last stage only

        def pipeline_embed(self, inputs): ...      # inputs -> hidden
        def pipeline_head(self, hidden): ...       # hidden -> outputs
        def pipeline_loss(self, outputs, data_samples): ...     # loss dict
        def pipeline_predict(self, outputs, data_samples): ...  # predictions

Optionally ``pipeline_layer(layer, hidden)`` runs one layer when it needs
more than the hidden state (e.g. rotary tables the model holds); the default
is ``layer(hidden)``. Optionally ``pipeline_kwargs = ('doc_ids', )`` names
entries of the preprocessed batch that every stage needs besides the hidden
state: each stage gets its micro-batch's rows of them, by keyword, in
``pipeline_layer(layer, hidden, doc_ids=...)`` (torch's schedules cut a
``step``'s keyword tensors per micro-batch and hand them to every stage).
Every parameter must belong to one of the three parts, and no two parameters
may share one tensor (tied weights: the stages would hold two copies, each
trained on its own gradient). A stage is a deep copy
of the model with the modules of other stages set to ``None`` (as torchtitan
does), so parameter names stay the original ones and one checkpoint loads at
any layout. Its ``forward(x)`` runs ``pipeline_embed`` (first stage), its own
layers, then ``pipeline_head`` (last stage): only tensors pass between stages.
"""
import copy
from typing import List, Optional, Sequence

import torch
from torch import nn

from mmpar.parallel.tied import refuse_shared_parameters

LAYERS_ATTR = 'pipeline_layers'
PARTS = ('pipeline_pre', 'pipeline_post')
METHODS = ('pipeline_embed', 'pipeline_head', 'pipeline_loss',
           'pipeline_predict')


def check_protocol(model: nn.Module, pp: int = 2) -> None:
    """Refuse a model that cannot be split over ``parallel.pp=pp`` stages,
    naming what is missing.

    Args:
        model: the plain (possibly tensor-parallel) model.
        pp: ``parallel.pp``, for the messages (a model is split only when
            it is > 1).

    Raises:
        ValueError: a missing attribute or method, a layers container that
            is not ordered, or a parameter outside the three parts.
        ConfigError: parameters that share one tensor (tied weights),
            which two stages would hold as two.
    """
    refuse_shared_parameters(model, None, pp)
    name = type(model).__name__
    missing = [a for a in (LAYERS_ATTR, ) + PARTS + METHODS
               if not hasattr(model, a)]
    if missing:
        raise ValueError(
            f'{name} cannot be pipelined (parallel.pp > 1): it has no '
            f'{", ".join(missing)}; see docs/pipeline_parallel.md for the '
            'protocol (an ordered container of layers, the modules before '
            'and after it, and pipeline_embed/head/loss/predict)')
    if pipeline_kwargs(model) and not hasattr(model, 'pipeline_layer'):
        # Else layer(hidden) would run without them, silently.
        raise ValueError(
            f'{name}.pipeline_kwargs={pipeline_kwargs(model)!r} needs a '
            'pipeline_layer(layer, hidden, **kwargs) that hands them to '
            'the layers; allowed: define pipeline_layer, or no '
            'pipeline_kwargs')
    layers = model.get_submodule(getattr(model, LAYERS_ATTR))
    if not isinstance(layers, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        raise ValueError(
            f'{name}.{LAYERS_ATTR}={getattr(model, LAYERS_ATTR)!r} is a '
            f'{type(layers).__name__}; allowed: an nn.ModuleList, '
            'nn.Sequential or nn.ModuleDict')
    owners = [getattr(model, LAYERS_ATTR)] + [
        p for part in PARTS for p in getattr(model, part)]
    for param_name, _ in model.named_parameters():
        if not any(param_name == o or param_name.startswith(o + '.')
                   for o in owners):
            raise ValueError(
                f'{name} parameter {param_name!r} is in none of '
                f'{LAYERS_ATTR}, pipeline_pre, pipeline_post; every '
                'parameter must belong to one stage')


def layer_names(model: nn.Module) -> List[str]:
    """Full names of the layers, in order (the split-point candidates)."""
    prefix = getattr(model, LAYERS_ATTR)
    return [f'{prefix}.{key}'
            for key, _ in model.get_submodule(prefix).named_children()]


def stage_starts(model: nn.Module, split_points: Optional[Sequence[str]],
                 num_stages: int) -> List[int]:
    """Index of the first layer of each stage.

    Raises:
        ValueError: more stages than layers, a split point naming no layer
            (listing the candidates), or split points out of order.
    """
    names = layer_names(model)
    if num_stages > len(names):
        raise ValueError(
            f'parallel.pipeline asks for {num_stages} stages but '
            f'{type(model).__name__} has {len(names)} layers in '
            f'{getattr(model, LAYERS_ATTR)!r}; allowed: at most '
            f'{len(names)} stages (pp x stages_per_rank)')
    if split_points is None:
        # Even split; the earlier stages take the remainder.
        size, extra = divmod(len(names), num_stages)
        return [i * size + min(i, extra) for i in range(num_stages)]
    starts = [0]
    for point in split_points:
        if point not in names:
            raise ValueError(
                f'parallel.pipeline.split_points: {point!r} names no layer '
                f'of {type(model).__name__}; allowed: {", ".join(names[1:])}')
        index = names.index(point)
        if index <= starts[-1]:
            raise ValueError(
                f'parallel.pipeline.split_points={list(split_points)!r} are '
                f'out of order at {point!r}; allowed: distinct names in '
                'model order, after the first layer')
        starts.append(index)
    return starts


def _drop(model: nn.Module, name: str) -> None:
    # Set to None, not deleted: ModuleList indices (and so parameter names)
    # of the layers kept stay the original ones.
    parent_name, _, attr = name.rpartition('.')
    parent = model.get_submodule(parent_name) if parent_name else model
    if attr in dict(parent.named_children()):
        parent.register_module(attr, None)
    elif attr in dict(parent.named_parameters(recurse=False)):
        parent.register_parameter(attr, None)
    elif attr in dict(parent.named_buffers(recurse=False)):
        parent.register_buffer(attr, None)
    else:
        raise ValueError(f'{type(model).__name__}: {name!r} in pipeline_pre/'
                         'pipeline_post names no module, parameter or buffer')


def pipeline_kwargs(model: nn.Module) -> tuple:
    """The batch entries every stage receives (``pipeline_kwargs``)."""
    return tuple(getattr(model, 'pipeline_kwargs', ()))


def _stage_forward(self, x: torch.Tensor, **batch_kwargs) -> torch.Tensor:
    info = self._pp_stage
    if info['first']:
        x = self.pipeline_embed(x)
    run_layer = getattr(self, 'pipeline_layer', None)
    # named_children skips the layers other stages own (set to None).
    for _, layer in self.get_submodule(self.pipeline_layers).named_children():
        x = layer(x) if run_layer is None else run_layer(layer, x,
                                                         **batch_kwargs)
    if info['last']:
        x = self.pipeline_head(x)
    return x


def split_stage(model: nn.Module, starts: List[int], stage: int) -> nn.Module:
    """A copy of ``model`` holding only stage ``stage``'s modules.

    Its class becomes a subclass whose ``forward(x)`` is the stage's part
    (as FSDP2 swaps classes), so the copy keeps ``data_preprocessor``,
    ``parse_losses`` and the ``pipeline_*`` methods.
    """
    names = layer_names(model)
    num_stages = len(starts)
    end = starts[stage + 1] if stage + 1 < num_stages else len(names)
    keep = set(names[starts[stage]:end])
    stage_model = copy.deepcopy(model)
    for name in names:
        if name not in keep:
            _drop(stage_model, name)
    if stage != 0:
        for name in model.pipeline_pre:
            _drop(stage_model, name)
    if stage != num_stages - 1:
        for name in model.pipeline_post:
            _drop(stage_model, name)
    cls = type(model)
    stage_model.__class__ = type(f'PipelineStage{cls.__name__}', (cls, ),
                                 {'forward': _stage_forward})
    stage_model._pp_stage = dict(
        index=stage, first=stage == 0, last=stage == num_stages - 1)
    return stage_model
