"""What a wrapped model is, said in one place.

Code that must know how a model is laid out (the checkpoint formats, the
Runner, the plan tool, the pipeline) calls
:func:`mmpar.wrappers.base.describe` and reads the :class:`WrappedModel` it
returns; it never probes attributes or class names. mmpar's wrappers (and
the pipeline) build theirs from what their class declares
(:class:`mmpar.wrappers.base.StepMixin`); any other model is described as
what it is: a plain module, or an MMEngine wrapper around one.
"""
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class PipelineParts:
    """This rank's part of a pipelined model.

    Attributes:
        stages: this rank's stages as built (data-parallel wrapped or plain).
        stage_modules: the same stages unwrapped: copies of the user's model
            holding only their stage's modules, under the original names.
        stage_indices: their global stage indices.
        pp_group: the pipeline group (every stage of one data replica).
    """
    stages: Tuple[nn.Module, ...]
    stage_modules: Tuple[nn.Module, ...]
    stage_indices: Tuple[int, ...]
    pp_group: Optional[dist.ProcessGroup]


@dataclass(frozen=True)
class WrappedModel:
    """The description of a (possibly wrapped) model.

    Attributes:
        model: the user's model (for a pipeline: this rank's stage copy).
        state_module: the module whose state-dict names are the plain
            model's, for torch's state-dict API (an FSDP root, or the
            wrapped module). None for a pipelined model (see ``pipeline``).
        shards_parameters: parameters are sharded over the data axis (FSDP):
            no rank holds them whole.
        holds_shards: some tensors are only this rank's part (FSDP, or
            tensor-parallel DTensors): a full checkpoint gathers them, and
            its optimizer state is keyed by parameter names.
        axes: what the wrapper communicates over: ``'reduce'`` (gradients
            all-reduced) or ``'shard'`` (+ ``'replicate'`` for HSDP).
        pipeline: this rank's stages, for a pipelined model.
        sync_buffers: makes buffers equal over the data axis (collective).
        load_full_state: loads a plain model's state dict into this layout
            (``(state_dict, strict)``; every rank).
        reshard: frees parameters a forward left gathered (FSDP keeps them
            after a forward without backward, e.g. an evaluation), so the
            local shards are their only values and the next forward
            gathers them again; call it before editing local shards in
            place outside forward and backward (no communication).
    """
    model: nn.Module
    state_module: Optional[nn.Module]
    shards_parameters: bool = False
    holds_shards: bool = False
    axes: Dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    pipeline: Optional[PipelineParts] = None
    sync_buffers: Callable[[], None] = lambda: None
    load_full_state: Optional[Callable[[dict, bool], Any]] = None
    reshard: Callable[[], None] = lambda: None

