"""A pipelined model written outside mmpar's package, and the runs the
pipeline tests share (module level: spawned workers unpickle them)."""
import copy
from unittest import mock

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from tests.toy import make_optim_wrapper

IN_DIM, HIDDEN, OUT_DIM = 8, 16, 4


def _layer(expand=None):
    if expand is None:
        return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
    # Wider inside: a colwise -> rowwise pair for tensor parallelism
    # (PIPE_TP_PLAN).
    return nn.Sequential(nn.Linear(HIDDEN, expand * HIDDEN), nn.Tanh(),
                         nn.Linear(expand * HIDDEN, HIDDEN))


# A tensor-parallel plan for PipeMLP(expand=k) as plain data: each layer a
# Megatron colwise -> rowwise pair, the head split by output features and
# gathered whole (the loss needs every output). embed and norm stay plain.
PIPE_TP_PLAN = dict(type='module_plan', plan={
    'layers.*.0': 'colwise',
    'layers.*.2': 'rowwise',
    'head': dict(style='colwise', output_layouts='replicate'),
})


class PipeMLP(BaseModel):
    """An MLP regressor meeting mmpar's pipeline protocol.

    ``forward(inputs, targets, mode)`` is the usual one-process model; the
    ``pipeline_*`` members let mmpar cut it into stages.
    """
    pipeline_layers = 'layers'
    pipeline_pre = ('embed', )
    pipeline_post = ('norm', 'head')

    def __init__(self, depth=4, expand=None):
        super().__init__()
        self.embed = nn.Linear(IN_DIM, HIDDEN)
        self.layers = nn.ModuleList(_layer(expand) for _ in range(depth))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT_DIM)

    def pipeline_embed(self, inputs):
        return self.embed(inputs)

    def pipeline_head(self, hidden):
        return self.head(self.norm(hidden))

    def pipeline_loss(self, outputs, targets):
        return dict(loss=F.mse_loss(outputs, targets),
                    mae=(outputs - targets).abs().mean().detach())

    def pipeline_predict(self, outputs, targets):
        return [dict(pred=o, target=t) for o, t in zip(outputs, targets)]

    def forward(self, inputs, targets=None, mode='tensor'):
        x = self.pipeline_embed(inputs)
        for layer in self.layers:
            x = layer(x)
        out = self.pipeline_head(x)
        if mode == 'loss':
            return self.pipeline_loss(out, targets)
        if mode == 'predict':
            return self.pipeline_predict(out, targets)
        return out


def make_pipe_model(seed=0, depth=4, expand=None):
    torch.manual_seed(seed)
    return PipeMLP(depth, expand)


def reference(model, batches, **optim_kwargs):
    """One process on the same batches: final state and logged losses."""
    model = copy.deepcopy(model)
    optim_wrapper = make_optim_wrapper(model, **optim_kwargs)
    losses = [float(model.train_step(b, optim_wrapper)["loss"].detach())
              for b in batches]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, \
        losses


def build_pipelined(parallel, wrapper_cfg, depth=4, expand=None):
    """``(model, topology)``: PipeMLP through ``parallelize`` on this rank."""
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    topology = setup_parallelism(parallel, wrapper_cfg)  # reset by harness
    model = parallelize(make_pipe_model(depth=depth, expand=expand),
                        topology, parallel, wrapper_cfg)
    return model, topology


def train_pipelined(parallel, wrapper_cfg, batches, optim_kwargs, depth=4,
                    expand=None):
    """Train through ``parallelize`` on this rank; returns this rank's
    stage states (plain names, gathered), logged losses, data rank and how
    many of its parameters are tensor-parallel DTensors."""
    from tests.toy import shard_batch
    model, topology = build_pipelined(parallel, wrapper_cfg, depth, expand)
    optim_wrapper = make_optim_wrapper(model, **optim_kwargs)
    losses = []
    for batch in batches:
        log_vars = model.train_step(
            shard_batch(batch, topology.dp_rank, topology.dp_size),
            optim_wrapper)
        losses.append(float(log_vars['loss']))
    return stage_state(model), losses, topology.dp_rank, num_tp_params(model)


def num_tp_params(model):
    """How many of ``model``'s parameters are split over the tp mesh."""
    from torch.distributed.tensor import DTensor
    return sum(isinstance(p, DTensor) and 'tp' in (
        p.device_mesh.mesh_dim_names or ()) for p in model.parameters())


def stage_state(model):
    """Plain-named state of every stage on this rank (gathered if sharded)."""
    state = {}
    for stage in model.stages:
        if hasattr(stage, 'full_state_dict'):
            part = stage.full_state_dict()
        else:
            part = getattr(stage, 'module', stage).state_dict()
        state.update({k: v.detach().clone() for k, v in part.items()})
    return state


def _units_with_parameters(module):
    """FSDP2 units in ``module`` that manage parameters of their own (a
    middle stage's root manages none: its layers are units)."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    count = 0
    for unit in units:
        own = {id(p) for p in unit.parameters()}
        for inner in unit.modules():
            if inner is not unit and isinstance(inner, FSDPModule):
                own -= {id(p) for p in inner.parameters()}
        count += bool(own)
    return count


def train_recording_fsdp_backwards(parallel, wrapper_cfg, batches,
                                   optim_kwargs):
    """:func:`train_pipelined`, recording after each micro-batch's backward
    of every FSDP2 stage: ``(stage index, whether every parameter of the
    stage is sharded again, reduce-scatters during that backward, FSDP2
    units of the stage with parameters of their own)``, and the
    reduce-scatters of each stage's end-of-step reduction (torch's
    ``perform_reduce_grad``)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.tensor import DTensor
    count = [0]
    reduce_scatter = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        count[0] += 1
        return reduce_scatter(*args, **kwargs)

    backward, reduce_grad = (PipelineStage.backward_one_chunk,
                             PipelineStage.perform_reduce_grad)
    backwards, reductions = [], []

    def recorded(stage, *args, **kwargs):
        before = count[0]
        backward(stage, *args, **kwargs)
        if isinstance(stage.submod, FSDPModule):
            # FSDP2 swaps a gathered parameter in as a plain tensor and
            # the sharded DTensor back in when it reshards.
            sharded = all(isinstance(p, DTensor)
                          for p in stage.submod.parameters())
            units = _units_with_parameters(stage.submod)
            backwards.append((stage.stage_index, sharded, count[0] - before,
                              units))

    def reduced(stage, *args, **kwargs):
        before = count[0]
        reduce_grad(stage, *args, **kwargs)
        reductions.append((stage.stage_index, count[0] - before))

    # Patched on torch's class: mmpar's stage inherits both methods.
    with mock.patch.object(dist, 'reduce_scatter_single', counted), \
            mock.patch.object(PipelineStage, 'backward_one_chunk',
                              recorded), \
            mock.patch.object(PipelineStage, 'perform_reduce_grad', reduced):
        result = train_pipelined(parallel, wrapper_cfg, batches,
                                 optim_kwargs)
    return result + (backwards, reductions)
