"""A user's ViT, written outside mmpar, that tensor parallelism can split.

Imported by a config through ``custom_imports``; its plan is plain
``module_plan`` data in the config (configs/vit_digits/vit_digits_tp_custom.py).
What makes it splittable (docs/tensor_parallel.md):

* attention uses separate ``wq``/``wk``/``wv``/``wo`` Linears, not
  ``nn.MultiheadAttention`` (which reads its weights directly);
* the number of heads is derived from the *local* shape of the projection's
  output (``view(batch, length, -1, head_dim)``): after a column split over
  tp ranks each rank computes ``num_heads / tp`` heads and must reshape by
  that. (A split weight is a DTensor whose ``.shape`` is the *global* shape,
  so do not read the head count off ``wq.weight.shape``.)

``SplittableViT(fused_qkv=True)`` uses timm's layout instead: one ``qkv``
Linear whose rows are ``[q; k; v]``, reshaped to ``(B, N, 3, heads,
head_dim)``. Its plan must say the projection is fused
(``dict(style='colwise', fused=3)``: :data:`FUSED_TP_PLAN`), so that each
rank holds its own heads of q, k and v.
"""
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mmpar.registry import MODELS


@MODELS.register_module()
class SplittableAttention(nn.Module):
    """Multi-head self-attention whose heads follow the local weights."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'num_heads={num_heads} must divide dim={dim}')
        self.head_dim = dim // num_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def split(t):
            # -1: the local heads, num_heads / tp after a column split.
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.wq(x)), split(self.wk(x)), split(self.wv(x)))
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


@MODELS.register_module()
class FusedQKVAttention(nn.Module):
    """timm's attention: one ``qkv`` Linear (rows ``[q; k; v]``), heads
    taken from the local shape."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'num_heads={num_heads} must divide dim={dim}')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1: the local heads, num_heads / tp under the fused column split
        # (timm writes self.num_heads here, which only one process accepts).
        qkv = self.qkv(x).reshape(batch, length, 3, -1, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(batch, length, -1))


@MODELS.register_module()
class SplittableBlock(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 2.0,
                 fused_qkv: bool = False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = (FusedQKVAttention if fused_qkv else
                     SplittableAttention)(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(
            dict(fc1=nn.Linear(dim, int(dim * mlp_ratio)),
                 fc2=nn.Linear(int(dim * mlp_ratio), dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp['fc2'](F.gelu(self.mlp['fc1'](self.norm2(x))))


@MODELS.register_module()
class SplittableViT(BaseModel):
    """A ViT classifier for (B, C, H, W) images built from SplittableBlock."""

    def __init__(self,
                 image_size: int = 8,
                 patch_size: int = 2,
                 in_channels: int = 1,
                 num_classes: int = 10,
                 embed_dim: int = 32,
                 depth: int = 2,
                 num_heads: int = 4,
                 mlp_ratio: float = 2.0,
                 fused_qkv: bool = False,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        num_patches = (image_size // patch_size)**2
        self.patch_embed = nn.Conv2d(
            in_channels, embed_dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(
            torch.randn(1, num_patches, embed_dim) * 0.02)
        self.blocks = nn.ModuleList(
            SplittableBlock(embed_dim, num_heads, mlp_ratio, fused_qkv)
            for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Union[Dict, List, torch.Tensor]:
        x = self.patch_embed(inputs).flatten(2).transpose(1, 2)
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(1))
        if mode == 'tensor':
            return logits
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, data_samples))
        return [
            dict(pred_label=p, gt_label=g)
            for p, g in zip(logits.argmax(1), data_samples)
        ]


# The plan as plain data, for a config's parallel.tp_plan (Megatron-style:
# q/k/v and fc1 split by columns, wo and fc2 by rows). prepare_input lays the
# attention's input out once for q/k/v, so that in backward their input
# gradients are all-reduced once, not three times. (The MLP is a ModuleDict
# the block indexes, not a module it calls: nothing to hook there, and fc1 is
# its only column-split layer anyway.)
TP_PLAN = {
    'blocks.*.attn': 'prepare_input',
    'blocks.*.attn.wq': 'colwise',
    'blocks.*.attn.wk': 'colwise',
    'blocks.*.attn.wv': 'colwise',
    'blocks.*.attn.wo': 'rowwise',
    'blocks.*.mlp.fc1': 'colwise',
    'blocks.*.mlp.fc2': 'rowwise',
}

# The plan of SplittableViT(fused_qkv=True): the fused projection's three
# parts each split over tp, so that rank r holds [q_r; k_r; v_r].
FUSED_TP_PLAN = {
    'blocks.*.attn': 'prepare_input',
    'blocks.*.attn.qkv': dict(style='colwise', fused=3),
    'blocks.*.attn.proj': 'rowwise',
    'blocks.*.mlp.fc1': 'colwise',
    'blocks.*.mlp.fc2': 'rowwise',
}
