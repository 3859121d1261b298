"""A mixture-of-experts feed-forward block for :class:`mmpar.models.Llama`.

A router scores each token against ``E`` experts (softmax, or sigmoid as
DeepSeek-V3), sends it to its ``top_k`` best, and adds their SwiGLU
outputs weighted by the scores; an optional shared expert sees every token.
No token is dropped (no capacity factor). The experts' weights are stacked,
``w1``/``w3`` ``(E, dim, hidden)`` and ``w2`` ``(E, hidden, dim)``, and run
as one grouped matmul over the tokens sorted by expert
(``torch._grouped_mm``, which runs on CPU in torch 2.13 where the rows are
16-byte aligned; a per-expert loop elsewhere, bit-identical).

Load balancing, ``balance=``:

``'aux_loss'``  a sequence-wise auxiliary loss (DeepSeek-V3's
                ``L = weight * sum_e f_e * P_e`` per sequence, averaged over
                sequences), returned as ``moe_aux_loss`` next to the
                language-model loss (MMEngine adds every ``*loss*`` term
                and logs it). Per sequence, so a mean over sequences on
                many ranks is the one-process mean.
``'bias'``      auxiliary-loss-free: a per-expert bias (a buffer, not a
                parameter) added to the scores for choosing experts only,
                nudged after each training forward towards the mean load
                by ``bias_update_rate`` (sign of the deviation), from the
                counts summed over every data rank.
``None``        no balancing.

The per-expert token counts of a training forward are logged as
``moe_tokens_e<i>`` (summed over layers).
"""
import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn

from mmpar.checks import check_int
from mmpar.parallel.experts import SharedGroup, local_experts
from mmpar.parallel.sequence import ContextParallel

SCORE_FUNCS = ('softmax', 'sigmoid')
BALANCE = ('aux_loss', 'bias', None)


@dataclass(frozen=True)
class MoEConfig:
    """The ``model.moe`` section, checked on construction.

    Attributes:
        num_experts: routed experts per layer (E).
        top_k: experts per token.
        hidden_dim: one expert's SwiGLU width (None: the model's
            ``hidden_dim``).
        score_func: ``'softmax'`` or ``'sigmoid'``.
        route_norm: divide each token's top-k scores by their sum (default:
            for sigmoid scores).
        shared_expert: add a SwiGLU expert every token goes through.
        balance: ``'aux_loss'``, ``'bias'`` or None.
        aux_loss_weight: the auxiliary loss's weight.
        bias_update_rate: the bias step per training forward.
        grouped_mm: use ``torch._grouped_mm`` where it runs (False: always
            the per-expert loop).
        force_balanced: route token ``t`` to experts ``(t*k + j) mod E``
            whatever the scores (a test and benchmark switch; the scores
            still weight the outputs and train the router): True for every
            layer, or the indices of the blocks that route so (the others
            route by their scores; one run then checks both routings).

    Raises:
        ValueError: naming ``model.moe.<key>``, the value and what is
            allowed.
    """
    num_experts: int = 8
    top_k: int = 2
    hidden_dim: Optional[int] = None
    score_func: str = 'softmax'
    route_norm: Optional[bool] = None
    shared_expert: bool = False
    balance: Optional[str] = 'aux_loss'
    aux_loss_weight: float = 0.01
    bias_update_rate: float = 1e-3
    grouped_mm: bool = True
    force_balanced: Union[bool, Tuple[int, ...]] = False

    def __post_init__(self) -> None:
        for key in ('num_experts', 'top_k'):
            check_int(f'model.moe.{key}', getattr(self, key))
        if self.top_k > self.num_experts:
            raise ValueError(
                f'model.moe.top_k={self.top_k} is not allowed; allowed: at '
                f'most model.moe.num_experts={self.num_experts}')
        if self.hidden_dim is not None and (
                not isinstance(self.hidden_dim, int) or self.hidden_dim < 1):
            raise ValueError(f'model.moe.hidden_dim={self.hidden_dim!r} is '
                             'not allowed; allowed: None or an int >= 1')
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(
                f'model.moe.score_func={self.score_func!r} is not allowed; '
                f'allowed: {", ".join(SCORE_FUNCS)}')
        if self.balance not in BALANCE:
            raise ValueError(f'model.moe.balance={self.balance!r} is not '
                             "allowed; allowed: 'aux_loss', 'bias', None")
        for key in ('aux_loss_weight', 'bias_update_rate'):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(
                    value, (int, float)) or value < 0:
                raise ValueError(f'model.moe.{key}={value!r} is not '
                                 'allowed; allowed: a number >= 0')
        for key in ('shared_expert', 'grouped_mm'):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f'model.moe.{key}={getattr(self, key)!r} '
                                 'is not allowed; allowed: True or False')
        layers = self.force_balanced
        if not isinstance(layers, bool):
            if not isinstance(layers, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and
                    i >= 0 for i in layers):
                raise ValueError(
                    f'model.moe.force_balanced={layers!r} is not allowed; '
                    'allowed: True, False or a list of block indices')
            object.__setattr__(self, 'force_balanced', tuple(layers))

    @classmethod
    def from_cfg(cls, cfg) -> 'MoEConfig':
        """From the ``model.moe`` dict.

        Raises:
            ValueError: an unknown key (naming it and the allowed ones) or
                a bad value.
        """
        if isinstance(cfg, cls):
            return cfg
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(cfg, Mapping):
            raise ValueError(f'model.moe={cfg!r} is not allowed; allowed: '
                             f'None or a dict with keys {", ".join(names)}')
        for key in cfg:
            if key not in names:
                raise ValueError(f'model.moe.{key} is not a known key; '
                                 f'allowed: {", ".join(names)}')
        return cls(**dict(cfg))

    def at_layer(self, index: int) -> 'MoEConfig':
        """This config for block ``index`` (``force_balanced`` a bool)."""
        if isinstance(self.force_balanced, bool):
            return self
        return dataclasses.replace(
            self, force_balanced=index in self.force_balanced)

    @property
    def normalises_routes(self) -> bool:
        if self.route_norm is None:
            return self.score_func == 'sigmoid'
        return self.route_norm


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous:
    ``_grouped_mm``'s backward refuses the stride-0 gradient of a sum."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs on these operands here: 2-D
    contiguous rows, every row 16-byte aligned (measured on torch 2.13's
    CPU build: others fail with "strides should be multiple of 16 bytes"),
    float32 or bfloat16."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.dim() != 2:
        return False
    size = x.element_size()
    return x.is_contiguous() and all(
        w.dtype == x.dtype and w.is_contiguous() and
        (w.shape[1] * size) % 16 == 0 and (w.shape[2] * size) % 16 == 0
        for w in weights)


def _grouped(x: torch.Tensor, w: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm: private in torch 2.13, the grouped GEMM torchtitan
    # runs its experts with; no public grouped matmul exists.
    return _ContiguousGrad.apply(torch._grouped_mm(x, w, offs=offsets))


def expert_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                  w3: torch.Tensor, w2: torch.Tensor,
                  grouped_mm: bool = True) -> torch.Tensor:
    """SwiGLU of each expert over its rows of ``x`` (sorted by expert,
    ``counts`` rows each): one grouped matmul per weight where it runs,
    else a loop over experts (bit-identical)."""
    if grouped_mm and grouped_mm_runs(x, w1, w3, w2):
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = F.silu(_grouped(x, w1, offsets)) * _grouped(x, w3, offsets)
        return _grouped(hidden, w2, offsets)
    outs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = x[start:start + count]
        start += count
        outs.append((F.silu(rows @ w1[expert]) * (rows @ w3[expert]))
                    @ w2[expert])
    return torch.cat(outs) if outs else x.new_zeros((0, w2.shape[2]))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights; meets the
    expert-parallel protocol (:mod:`mmpar.parallel.experts`): under ep the
    tokens reach this rank's experts through hooks on :meth:`forward`."""

    expert_parallel_params = ('w1', 'w2', 'w3')

    def __init__(self, dim: int, hidden_dim: int, num_experts: int,
                 grouped_mm: bool = True):
        super().__init__()
        self.num_experts, self.grouped_mm = num_experts, grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def reset_parameters(self, std: float, residual_std: float) -> None:
        nn.init.normal_(self.w1, std=std)
        nn.init.normal_(self.w3, std=std)
        nn.init.normal_(self.w2, std=residual_std)

    def forward(self, routed: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """``routed`` ``(N, dim)`` sorted by expert, ``counts`` the rows of
        each expert this rank holds."""
        return expert_swiglu(routed, counts, local_experts(self.w1),
                             local_experts(self.w3), local_experts(self.w2),
                             self.grouped_mm)


class MoE(nn.Module):
    """Router, routed experts and an optional shared expert.

    Args:
        dim: model width.
        hidden_dim: an expert's SwiGLU width.
        cfg: the ``model.moe`` section.
        feed_forward: the dense SwiGLU class (the shared expert).

    ``forward(x)`` maps ``(B, T, dim)`` to ``(B, T, dim)``; in training it
    keeps :attr:`aux_loss` (``'aux_loss'`` balancing) and
    :attr:`tokens_per_expert` of the last forward for the model's loss
    dict.
    """

    def __init__(self, dim: int, hidden_dim: int, cfg: MoEConfig,
                 feed_forward: type):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden_dim, cfg.num_experts,
                                      cfg.grouped_mm)
        self.shared_expert = feed_forward(dim, hidden_dim) \
            if cfg.shared_expert else None
        # Balancing bias: persistent (checkpointed), not trained.
        self.register_buffer('expert_bias', torch.zeros(cfg.num_experts))
        # The ranks whose counts the bias update sums (set by
        # mmpar.parallelize.expert; None: this process's).
        self.balance_group: Optional[SharedGroup] = None
        # The cp ranks this layer's sequences are split over (set by
        # mmpar.parallelize.context; None: whole sequences here): the
        # auxiliary loss sums its per-sequence counts over them.
        self.context_parallel: Optional[ContextParallel] = None
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    def route(self, tokens: torch.Tensor):
        """Scores ``(N, E)`` fp32, chosen experts ``(N, k)`` and their
        weights ``(N, k)``."""
        cfg = self.cfg
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if cfg.score_func == 'softmax' \
            else logits.sigmoid()
        if cfg.force_balanced:
            slots = torch.arange(tokens.shape[0] * cfg.top_k,
                                 device=tokens.device)
            chosen = (slots % cfg.num_experts).view(-1, cfg.top_k)
        else:
            select = scores.detach()
            if cfg.balance == 'bias':
                select = select + self.expert_bias
            chosen = select.topk(cfg.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if cfg.normalises_routes:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, chosen, weights = self.route(tokens)
        flat = chosen.flatten()
        counts = torch.bincount(flat, minlength=self.cfg.num_experts)
        order = flat.argsort(stable=True)
        token_of = order // self.cfg.top_k
        out = self.experts(tokens[token_of], counts)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, token_of, out)
        if self.shared_expert is not None:
            combined = combined + self.shared_expert(tokens)
        if self.training:
            self.tokens_per_expert = counts.detach()
            if self.cfg.balance == 'aux_loss':
                self.aux_loss = self.sequence_aux_loss(
                    scores.view(batch, seq, -1), chosen.view(batch, seq, -1))
        return combined.view(batch, seq, dim)

    def sequence_aux_loss(self, scores: torch.Tensor,
                          chosen: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, averaged over the
        sequences: ``weight * sum_e f_e * P_e`` with ``f_e`` the share of
        the sequence's routed slots going to ``e`` times ``E``, ``P_e`` its
        mean normalised score."""
        num_experts, top_k = self.cfg.num_experts, self.cfg.top_k
        seq = scores.shape[1]
        hits = F.one_hot(chosen, num_experts).sum((1, 2)).float()
        probs = scores / scores.sum(-1, keepdim=True)
        cp = self.context_parallel
        if cp is None:
            mean_probs = probs.mean(1)
        else:
            # This rank holds part of each sequence: its counts and score
            # sums are summed over the cp ranks (the scores' with autograd:
            # the backward of a sum is the sum of the ranks' gradients), so
            # every cp rank computes the whole sequence's loss.
            dist.all_reduce(hits, group=cp.group)
            seq *= cp.size
            mean_probs = dist_fn.all_reduce(probs.sum(1),
                                            group=cp.group) / seq
        share = hits * num_experts / (top_k * seq)
        per_seq = (share * mean_probs).sum(-1)
        return self.cfg.aux_loss_weight * per_seq.mean()

    @torch.no_grad()
    def update_bias(self) -> None:
        """Nudge the balancing bias by the last training forward's loads
        (summed over :attr:`balance_group`): up for experts below the mean
        load, down above it. Collective over the group."""
        if self.cfg.balance != 'bias' or self.tokens_per_expert is None:
            return
        counts = self.tokens_per_expert.float()
        if self.balance_group is not None:
            dist.all_reduce(counts, group=self.balance_group.group)
        self.expert_bias.add_(self.cfg.bias_update_rate *
                              torch.sign(counts.mean() - counts))
        self.tokens_per_expert = None
