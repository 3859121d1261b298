"""A user's model whose forward fails on one rank only, in its first
training step (a config names this module in ``custom_imports``; see
tests/verify/test_verify.py)."""
import torch.distributed as dist
from torch import nn

from mmpar.models import DigitsViT
from mmpar.registry import MODELS

MESSAGE = 'a batch only rank 1 reads'


class FailsOnRankOne(nn.Linear):
    """A linear layer that raises in training on rank 1."""

    def forward(self, x):
        if self.training and dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError(MESSAGE)
        return super().forward(x)


@MODELS.register_module(force=True)
class ViTFailingOnOneRank(DigitsViT):
    """The digits ViT with :class:`FailsOnRankOne` as its head."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head = FailsOnRankOne(self.head.in_features,
                                   self.head.out_features)
