"""A small BaseModel, data and a single-process reference for parity tests."""
import copy
from typing import List

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper as MMEngineOptimWrapper
from torch import nn

from mmpar.optim import OptimWrapper


class ToyModel(BaseModel):
    """An MLP regressor: ``mode='loss'`` gives MSE, ``'predict'`` outputs."""

    def __init__(self, in_dim=8, hidden=16, out_dim=4, num_layers=3):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
        layers = []
        for i in range(num_layers):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < num_layers - 1:
                layers.append(nn.Tanh())
        self.net = nn.Sequential(*layers)

    def forward(self, inputs, targets=None, mode='tensor'):
        out = self.net(inputs)
        if mode == 'loss':
            return dict(loss=F.mse_loss(out, targets))
        return out


def make_model(seed=0, **kwargs) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(**kwargs)


def make_head_only_model() -> ToyModel:
    """A model whose last layer alone trains (fine-tuning a head): FSDP1's
    one flat parameter over 2 ranks puts it wholly in rank 1's shard, so
    rank 0 has no gradient to clip."""
    model = make_model()
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith('net.4.'))
    return model


def make_batches(num_batches=4, batch_size=8, in_dim=8, out_dim=4, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [
        dict(
            inputs=torch.randn(batch_size, in_dim, generator=gen),
            targets=torch.randn(batch_size, out_dim, generator=gen))
        for _ in range(num_batches)
    ]


def shard_batch(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's contiguous slice of a global batch."""
    return {k: v.chunk(world_size)[rank] for k, v in batch.items()}


def make_optim_wrapper(model, lr=0.1, accumulative_counts=1, clip=None,
                       optimizer='SGD', reference=False):
    """mmpar's optim wrapper (what a wrapped model trains with); with
    ``reference``, MMEngine's own, for the one-process oracle."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == 'SGD':
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(params, lr=lr)
    clip_grad = None if clip is None else dict(max_norm=clip)
    cls = MMEngineOptimWrapper if reference else OptimWrapper
    return cls(opt, accumulative_counts=accumulative_counts,
               clip_grad=clip_grad)


def train_reference(model: BaseModel, batches: List[dict], **optim_kwargs):
    """Single-process training on the global batches; returns the params."""
    model = copy.deepcopy(model)
    optim_wrapper = make_optim_wrapper(model, reference=True, **optim_kwargs)
    for batch in batches:
        model.train_step(batch, optim_wrapper)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_states_close(actual: dict, expected: dict, atol=1e-6, rtol=1e-5):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(
            actual[key], expected[key], atol=atol, rtol=rtol, msg=key)
