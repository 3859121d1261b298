"""A mixture-of-experts language model written the way a user writes one,
outside mmpar (loaded through ``custom_imports``): its experts module meets
the expert-parallel protocol (docs/expert_parallel.md) and nothing in it
knows about ranks. tests/tools/test_ep_end_to_end.py trains it at
ep=2 x dp_shard=2 against one process."""
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn
from torch.distributed.tensor import DTensor

from mmpar.registry import MODELS


class Experts(nn.Module):
    """GELU experts, stacked on dim 0, computed one expert at a time."""

    # The protocol: these parameters hold the experts on dim 0.
    expert_parallel_params = ('up', 'down')

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(num_experts, dim, hidden) /
                               dim**0.5)
        self.down = nn.Parameter(torch.randn(num_experts, hidden, dim) /
                                 hidden**0.5)

    def forward(self, routed: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        # Under expert parallelism the weights are DTensors: compute with
        # this rank's experts (counts then has one entry per local expert).
        up, down = (w.to_local() if isinstance(w, DTensor) else w
                    for w in (self.up, self.down))
        rows = routed.split(counts.tolist())
        return torch.cat([F.gelu(x @ up[e]) @ down[e]
                          for e, x in enumerate(rows)])


class TopKMoE(nn.Module):
    """A softmax router sending each token to its ``top_k`` experts."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k)
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        source = order // self.top_k
        out = self.experts(tokens[source], counts)
        out = out * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(tokens).index_add(0, source, out).view_as(x)


@MODELS.register_module()
class UserMoELM(BaseModel):
    """Embedding, one MoE layer (residual), norm and head."""

    def __init__(self, vocab_size: int = 256, dim: int = 32,
                 hidden: int = 32, num_experts: int = 4, top_k: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.moe = TopKMoE(dim, hidden, num_experts, top_k)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        h = self.embed(inputs)
        logits = self.head(self.norm(h + self.moe(h)))
        if mode == 'loss':
            # With its token count, mmpar logs and trains the loss over
            # every rank's tokens (docs/context_parallel.md).
            return dict(loss=F.cross_entropy(logits.flatten(0, 1),
                                             data_samples.flatten()),
                        num_tokens=torch.tensor(float(data_samples.numel())))
        return logits
