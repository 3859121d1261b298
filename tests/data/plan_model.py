"""A small transformer-shaped model for the plan tool's tests."""
from mmengine.model import BaseModel
from torch import nn

from mmpar.registry import MODELS


class PlanBlock(nn.Module):
    """A residual MLP block (stands in for a transformer block)."""

    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


@MODELS.register_module()
class PlanToyNet(BaseModel):
    """Embedding, ``depth`` blocks and a classifier head."""

    def __init__(self, in_dim=64, dim=32, depth=4, num_classes=10):
        super().__init__()
        self.embed = nn.Linear(in_dim, dim)
        self.blocks = nn.ModuleList(PlanBlock(dim) for _ in range(depth))
        self.head = nn.Linear(dim, num_classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
