"""A digits classifier with BatchNorm (loaded through custom_imports)."""
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn

from mmpar.registry import MODELS


class ConvBlock(nn.Module):

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


@MODELS.register_module(force=True)
class BNDigitsNet(BaseModel):
    """Two conv + BatchNorm blocks and a linear head; MMEngine's contract."""

    def __init__(self, width: int = 8, num_classes: int = 10):
        super().__init__()
        self.blocks = nn.Sequential(ConvBlock(1, width), ConvBlock(width, width))
        self.head = nn.Linear(width * 64, num_classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.head(self.blocks(inputs).flatten(1))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, data_samples))
        if mode == 'predict':
            return [
                dict(pred_label=p, gt_label=g)
                for p, g in zip(logits.argmax(1), data_samples)
            ]
        return logits
