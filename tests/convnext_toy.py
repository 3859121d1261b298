"""A ConvNeXt-V2 look-alike for the 8x8 digits, and its recipe's rules.

What mmpretrain's ConvNeXt-V2 has that MMEngine's parameter rules read:
depthwise convolutions, ``nn.LayerNorm`` (and a channels-first subclass),
biases, GRN's 1-D ``gamma`` / ``beta`` and a 1-D layer scale (the "flat"
parameters), with the recipe's ``paramwise_cfg`` (norm, bias and flat decay
off). The blocks follow mmpar's pipeline protocol and the head is an MLP
with a tensor-parallel plan (:data:`TP_PLAN`), so every layout can hold it.
"""
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

from mmpar.models import DigitsViT
from mmpar.registry import MODELS

# The recipe (mmpretrain 1.2.0 convnext-v2 atto), plus one of each other
# rule MMEngine's constructor has, so that lr differs too.
RECIPE = dict(norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0)
PARAMWISE = dict(
    RECIPE, dwconv_decay_mult=0.5, bias_lr_mult=2.0,
    custom_keys={'head.2': dict(lr_mult=0.5, decay_mult=3.0)})
OPTIM_WRAPPER = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.5),
    paramwise_cfg=PARAMWISE)
# Layer-wise lr decay, as mmpretrain's constructor does it (by name).
LAYER_DECAY = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=0.01, weight_decay=0.5),
    constructor='ToyLayerDecayConstructor',
    paramwise_cfg=dict(layer_decay_rate=0.5))
TP_PLAN = dict(type='module_plan',
               plan={'head.0': 'colwise', 'head.2': 'rowwise'})


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of (B, C, H, W), as mmpretrain's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class GRN(nn.Module):
    """Global response normalisation (ConvNeXt-V2), channels last."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.gamma = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + self.eps)
        return self.gamma * (x * nx) + self.beta + x


class Block(nn.Module):
    """Depthwise conv, LayerNorm, pointwise MLP with GRN, layer scale."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1 = nn.Linear(dim, 2 * dim)
        self.grn = GRN(2 * dim)
        self.pwconv2 = nn.Linear(2 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim, ), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        h = self.pwconv2(self.grn(F.gelu(self.pwconv1(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


@MODELS.register_module()
class ToyConvNeXtV2(BaseModel):
    """(B, 1, 8, 8) digits -> 10 classes; ``forward`` is DigitsViT's."""

    pipeline_layers = 'blocks'
    pipeline_pre = ('stem', )
    pipeline_post = ('norm', 'head')

    def __init__(self, dim: int = 8, depth: int = 4,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        self.stem = nn.Sequential(
            nn.Conv2d(1, dim, 2, stride=2), LayerNorm2d(dim))
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, 10))

    def pipeline_embed(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.stem(inputs)

    def pipeline_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden.mean(dim=(2, 3))))

    # DigitsViT's classifier ends and dispatch (they read only ``blocks``
    # and the pipeline_* methods).
    pipeline_loss = DigitsViT.pipeline_loss
    pipeline_predict = DigitsViT.pipeline_predict
    logits = DigitsViT.logits
    forward = DigitsViT.forward


@OPTIM_WRAPPER_CONSTRUCTORS.register_module(force=True)
class ToyLayerDecayConstructor(DefaultOptimWrapperConstructor):
    """Layer-wise lr decay as mmpretrain's constructor does it: the depth of
    a parameter from its name (``blocks.<i>``) against the model's number of
    blocks, no decay for 1-D parameters and biases."""

    def add_params(self, params, module, **kwargs):
        rate = self.paramwise_cfg['layer_decay_rate']
        num_layers = len(module.blocks) + 2
        for name, param in module.named_parameters():
            if name.startswith('stem'):
                layer = 0
            elif name.startswith('blocks'):
                layer = int(name.split('.')[1]) + 1
            else:
                layer = num_layers - 1
            flat = param.ndim == 1 or name.endswith('.bias')
            params.append(dict(
                params=[param],
                lr=self.base_lr * rate**(num_layers - 1 - layer),
                weight_decay=0.0 if flat else self.base_wd))


def named_options(model: nn.Module, optimizer) -> Dict[str, tuple]:
    """``{plain name: (lr, weight_decay)}`` of ``optimizer``'s parameters
    that ``model`` (laid out or not) holds on this rank."""
    from mmpar.wrappers.local_state import plain_named_parameters
    names = {}
    for name, param in plain_named_parameters(model):
        names.setdefault(id(param), []).append(name)
    options = {}
    for group in optimizer.param_groups:
        for param in group['params']:
            for name in names[id(param)]:
                options[name] = (group['lr'], group['weight_decay'])
    return options
