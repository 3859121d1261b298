"""A small vision transformer classifier for the 8x8 digits.

Patch embedding, a stack of :class:`TransformerBlock` and a linear head. Each
block is a natural FSDP unit (``module_class`` wrap policy).

Tensor parallelism (``parallel.tp_plan='digits_vit'``) splits the MLPs only,
Megatron-style (first Linear by columns, second by rows: one all-reduce per
MLP and pass). ``nn.MultiheadAttention`` reads its projection weights
directly and reshapes by its fixed head count, so it cannot be split; the
attention stays replicated on every tp rank.
"""
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mmpar.parallelize.module_plan import module_plan
from mmpar.registry import MODELS, TP_PLANS

# Module-name patterns -> tensor-parallel styles (the ``module_plan`` form).
TP_PLAN = {'blocks.*.mlp.0': 'colwise', 'blocks.*.mlp.3': 'rowwise'}


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0,
                 dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(
            dim, num_heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


@MODELS.register_module()
class DigitsViT(BaseModel):
    """ViT classifier for (B, C, H, W) images.

    Args:
        image_size: side of the square input.
        patch_size: side of a square patch; must divide ``image_size``.
        in_channels: input channels.
        num_classes: classes of the head.
        embed_dim: token width.
        depth: number of :class:`TransformerBlock`.
        num_heads: attention heads per block.
        mlp_ratio: MLP hidden width over ``embed_dim``.
        dropout: dropout in attention and MLP.
        data_preprocessor: MMEngine data preprocessor config.

    ``forward(inputs, data_samples, mode)``: ``'loss'`` returns
    ``dict(loss=cross-entropy, acc=batch accuracy)``; ``'predict'`` returns a
    list of ``dict(pred_label, gt_label)``, one per sample; ``'tensor'`` the
    logits.
    """

    def __init__(self,
                 image_size: int = 8,
                 patch_size: int = 2,
                 in_channels: int = 1,
                 num_classes: int = 10,
                 embed_dim: int = 64,
                 depth: int = 4,
                 num_heads: int = 4,
                 mlp_ratio: float = 2.0,
                 dropout: float = 0.0,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        if image_size % patch_size:
            raise ValueError(f'patch_size={patch_size} must divide '
                             f'image_size={image_size}')
        num_patches = (image_size // patch_size)**2
        self.patch_embed = nn.Conv2d(
            in_channels, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(
            torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList(
            TransformerBlock(embed_dim, num_heads, mlp_ratio, dropout)
            for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    # The registered tensor-parallel plan that splits this model (what
    # tools/plan.py --search tries for tp > 1 when the config names none).
    default_tp_plan = 'digits_vit'

    # -- the pipeline protocol (docs/pipeline_parallel.md) ------------------
    pipeline_layers = 'blocks'
    pipeline_pre = ('patch_embed', 'cls_token', 'pos_embed')
    pipeline_post = ('norm', 'head')

    def pipeline_embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """Patch tokens plus the class token and positions."""
        x = self.patch_embed(inputs).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        return torch.cat([cls, x], dim=1) + self.pos_embed

    def pipeline_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from the class token."""
        return self.head(self.norm(hidden[:, 0]))

    def pipeline_loss(self, logits: torch.Tensor,
                      data_samples: torch.Tensor) -> Dict:
        """``mode='loss'``'s dict from the logits."""
        loss = F.cross_entropy(logits, data_samples)
        acc = (logits.argmax(1) == data_samples).float().mean()
        return dict(loss=loss, acc=acc.detach())

    def pipeline_predict(self, logits: torch.Tensor,
                         data_samples: torch.Tensor) -> List:
        """``mode='predict'``'s list from the logits."""
        preds = logits.argmax(1)
        return [
            dict(pred_label=p, gt_label=g)
            for p, g in zip(preds.cpu(), data_samples.cpu())
        ]

    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.pipeline_embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.pipeline_head(x)

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Union[Dict, List, torch.Tensor]:
        logits = self.logits(inputs)
        if mode == 'tensor':
            return logits
        if mode == 'loss':
            return self.pipeline_loss(logits, data_samples)
        if mode == 'predict':
            return self.pipeline_predict(logits, data_samples)
        raise ValueError(f'mode={mode!r} is not supported; allowed: tensor, '
                         'loss, predict')


@TP_PLANS.register_module(name='digits_vit')
def digits_vit_tp_plan(model: nn.Module, tp_mesh) -> None:
    """Split :class:`DigitsViT`'s MLPs over ``tp_mesh`` (:data:`TP_PLAN`)."""
    module_plan(model, tp_mesh, TP_PLAN)
