"""A Llama-family decoder-only causal language model, written for parallelism.

RMSNorm, rotary position embeddings, a SwiGLU MLP and optional grouped-query
attention, as in Llama 2/3 (and torchtitan's ``models/llama3``). Three choices
make it easy to parallelise:

* :class:`Attention` derives its *local* head count from the width of its
  projections' outputs, so a tensor-parallel plan that splits ``wq``/``wk``/
  ``wv`` by columns and ``wo`` by rows needs no change here (see
  :data:`TP_PLAN`).
* The blocks sit in ``layers``, an ``nn.ModuleDict`` keyed ``'0'``, ``'1'``,
  ...; a pipeline stage deletes the blocks it does not own and sets
  ``tok_embeddings`` / ``norm`` / ``output`` to ``None`` where they live on
  another stage, and :meth:`Llama.logits` skips what is missing (see
  :func:`pipeline_split_points`).
* Embeddings are untied by default: tied weights cannot live on two pipeline
  stages or take two different tensor-parallel layouts, so
  ``tie_embeddings=True`` is refused under ``parallel.tp > 1`` or
  ``parallel.pp > 1`` (:mod:`mmpar.parallel.tied`); data parallelism
  (DDP, FSDP) trains it.
"""
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (PrepareModuleInputOutput,
                                               parallelize_module)

from mmpar.models import llama_hf
from mmpar.models.lm_loss import (LMPipelineOutputs, lm_outputs,
                                   transformer_flops_per_token)
from mmpar.models.moe import GroupedExperts, MoE, MoEConfig
from mmpar.parallel.experts import no_experts_error
from mmpar.parallel.sequence import ContextParallel
from mmpar.parallelize.context import (causal_attention,
                                       context_parallel_attention)
from mmpar.parallelize.documents import document_rotary
from mmpar.parallelize.module_plan import match_modules, module_plan
from mmpar.registry import MODELS, TP_PLANS

# Module-name patterns -> tensor-parallel styles for :class:`Llama`, as plain
# data (the tensor-parallel ``module_plan`` form). Column-split q/k/v and the
# SwiGLU gate/up projections, row-split the output projections, as
# Megatron-LM does. The norms run sequence-parallel between the blocks; the
# attention's and the MLP's input (``prepare_input``) is all-gathered once
# and shared by q/k/v (gate/up), and in backward their input gradients add
# up before one reduce-scatter: 2 all-gathers and 2 reduce-scatters per
# block and pass (torchtitan's Llama plan).
TP_PLAN: Dict[str, Union[str, dict]] = {
    'tok_embeddings': 'rowwise',
    'layers.*.attn_norm': 'sequence_parallel',
    # Attention(x, cos, sin): x is prepared, the rotary tables left alone.
    'layers.*.attn': 'prepare_input',
    'layers.*.attn.wq': 'colwise',
    'layers.*.attn.wk': 'colwise',
    'layers.*.attn.wv': 'colwise',
    'layers.*.attn.wo': 'rowwise',
    'layers.*.mlp_norm': 'sequence_parallel',
    'layers.*.mlp': 'prepare_input',
    'layers.*.mlp.w1': 'colwise',
    'layers.*.mlp.w3': 'colwise',
    'layers.*.mlp.w2': 'rowwise',
    'norm': 'sequence_parallel',
    # Vocabulary-split head, logits gathered whole: the loss is computed on
    # every tp rank from the full logits (a local vocabulary shard would give
    # a wrong cross-entropy).
    'output': dict(style='colwise', output_layouts='replicate'),
}

# The same split without sequence parallelism (norms replicated): the simplest
# plan, and the one to use when the sequence length does not divide by tp.
# ``prepare_input`` then takes a replicated input: one all-reduce of the
# input gradient per attention and per MLP in backward, not one per
# projection.
TP_PLAN_NO_SP: Dict[str, Union[str, dict]] = {
    name: ('replicate' if style == 'sequence_parallel' else style)
    for name, style in TP_PLAN.items() if name != 'tok_embeddings'
}


# The dense MLP's entries; a mixture of experts is not split over tp.
MLP_ENTRIES = ('layers.*.mlp', 'layers.*.mlp.w1', 'layers.*.mlp.w3',
               'layers.*.mlp.w2')


def split_with_moe(model: nn.Module, tp_mesh, plan: dict) -> None:
    """Apply a Llama ``plan``; with ``model.moe`` the MLP entries give way
    to the mixture of experts kept whole on every tp rank.

    Each tp rank computes the whole MoE layer on the whole sequence: the
    router, the shared expert and the experts (split over ep, not over tp)
    stay plain tensors, so their gradients come out the same on every tp
    rank (no reduction over tp), and the global-norm clip counts them once
    (each rank adds its own copy's norm, never the tp peers'). Tokens are
    dispatched over the ep ranks that share this rank's tp coordinate
    (``mesh['ep']``). Under sequence parallelism the MoE's input is
    all-gathered from the sequence shards once and its output cut back to
    this rank's shard (backward: an all-gather of the output's gradient);
    without it the block's input is already whole (docs/expert_parallel.md,
    "ep with tp").

    Args:
        model: the plain :class:`Llama`; changed in place.
        tp_mesh: the 1-D tensor-parallel mesh.
        plan: :data:`TP_PLAN` or :data:`TP_PLAN_NO_SP`.
    """
    if getattr(model, 'moe', None) is None:
        module_plan(model, tp_mesh, plan)
        return
    module_plan(model, tp_mesh,
                {k: v for k, v in plan.items() if k not in MLP_ENTRIES})
    if any(style == 'sequence_parallel' for style in plan.values()):
        parallelize_module(model, tp_mesh, {
            name: PrepareModuleInputOutput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(),
                use_local_input=True, output_layouts=Replicate(),
                desired_output_layouts=Shard(1))
            for name in match_modules(model, 'layers.*.mlp')})


@TP_PLANS.register_module(name='llama')
def llama_tp_plan(model: nn.Module, tp_mesh) -> None:
    """Split :class:`Llama` over ``tp_mesh`` (:data:`TP_PLAN`: Megatron
    splits with sequence-parallel norms; the sequence length must divide by
    tp). MoE layers stay whole on every tp rank (:func:`split_with_moe`)."""
    split_with_moe(model, tp_mesh, TP_PLAN)


@TP_PLANS.register_module(name='llama_no_sp')
def llama_no_sp_tp_plan(model: nn.Module, tp_mesh) -> None:
    """Split :class:`Llama` over ``tp_mesh`` without sequence parallelism
    (:data:`TP_PLAN_NO_SP`: norms and embedding replicated). MoE layers
    stay whole on every tp rank (:func:`split_with_moe`)."""
    split_with_moe(model, tp_mesh, TP_PLAN_NO_SP)


# The module plans the two apply, for the config check
# (:func:`mmpar.parallelize.tensor.splits_sequence`).
llama_tp_plan.plan_data = TP_PLAN
llama_no_sp_tp_plan.plan_data = TP_PLAN_NO_SP


def pipeline_split_points(num_layers: int, num_stages: int) -> List[str]:
    """Default pipeline split points: ``num_stages`` runs of blocks.

    Blocks are spread as evenly as possible; the remainder goes to the
    middle stages first, then the first stage, because the last stage also
    runs the output head (a ``dim x vocab`` matmul) and the first only an
    embedding lookup.

    Args:
        num_layers: number of transformer blocks (``Llama.num_layers``).
        num_stages: number of pipeline stages.

    Returns:
        ``num_stages - 1`` module names such as ``'layers.2'``; a new stage
        starts at each of them.

    Raises:
        ValueError: when there are fewer blocks than stages.
    """
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f'pipeline stages={num_stages} needs 1 <= stages <= '
                         f'num_layers={num_layers}')
    base, extra = divmod(num_layers, num_stages)
    sizes = [base] * num_stages
    # Middle stages first, then outwards; on a tie the earlier stage.
    order = sorted(range(num_stages),
                   key=lambda s: abs(s - (num_stages - 1) / 2))
    for stage in order[:extra]:
        sizes[stage] += 1
    points, start = [], 0
    for size in sizes[:-1]:
        start += size
        points.append(f'layers.{start}')
    return points


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(
            x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int,
                  theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each ``(max_seq_len, head_dim // 2)``."""
    freqs = 1.0 / theta**(
        torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, T, H, D)`` by position (half-split pairs, as Hugging
    Face's Llama: dimension i pairs with i + D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if cos.dim() == 3:  # per sample (document positions): (B, T, D/2)
        cos, sin = cos[:, :x.shape[1], None, :], sin[:, :x.shape[1], None, :]
    else:
        cos, sin = cos[:x.shape[1], None, :], sin[:x.shape[1], None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_at_rank(cos: torch.Tensor, sin: torch.Tensor, local_len: int,
                   cp: ContextParallel) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables at a context-parallel rank's positions: its
    ``local_len`` tokens are its chunks of a sequence ``cp.size`` times
    longer.

    Raises:
        ValueError: the whole sequence is longer than the tables
            (``model.max_seq_len``) or not a multiple of ``2 * cp``.
    """
    whole_len = local_len * cp.size
    if whole_len > cos.shape[0]:
        raise ValueError(f'sequence length {whole_len} exceeds '
                         f'model.max_seq_len={cos.shape[0]}')
    positions = cp.positions(local_len, device=cos.device)
    return cos[positions], sin[positions]


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped-query heads.

    Args:
        dim: model width.
        num_heads: query heads.
        num_kv_heads: key/value heads; must divide ``num_heads``.
        head_dim: width of one head.

    ``context_parallel`` (set by
    :func:`~mmpar.parallelize.context.apply_context_parallel`): ``x`` holds
    this rank's chunks of the sequence, rotated at their positions
    (:func:`rotary_at_rank`), and attention spans the cp group. The
    positions are taken here, where ``x`` is the rank's whole part of the
    sequence: between blocks a sequence-parallel tensor-parallel plan keeps
    only a tp shard of it.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int,
                 head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.context_parallel: Optional[ContextParallel] = None
        self.wq = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1, not a stored head count: under tensor parallelism each rank's
        # wq/wk/wv produce only its own heads (a column shard of the weight).
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim)
                   for proj in (self.wq, self.wk, self.wv))
        if doc_ids is not None:  # positions restart at each document
            cos, sin = document_rotary(cos, sin, doc_ids, seq,
                                       self.context_parallel)
        elif self.context_parallel is not None:
            cos, sin = rotary_at_rank(cos, sin, seq, self.context_parallel)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.context_parallel is not None:
            out = context_parallel_attention(q, k, v, self.context_parallel,
                                             doc_ids=doc_ids)
        else:
            out = causal_attention(q, k, v, doc_ids)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def moe_loss_terms(layers: List[MoE]) -> Dict[str, torch.Tensor]:
    """The loss dict's MoE terms: the auxiliary loss summed over layers
    (``moe_aux_loss``, trained as a loss term) and the tokens each expert
    got, summed over layers (``moe_tokens_e<i>``, logged)."""
    terms = {}
    aux = [m.aux_loss for m in layers if m.aux_loss is not None]
    if aux:
        terms['moe_aux_loss'] = torch.stack(aux).sum()
    counts = [m.tokens_per_expert for m in layers
              if m.tokens_per_expert is not None]
    if counts:
        total = torch.stack(counts).sum(0).float()
        terms.update({f'moe_tokens_e{i}': c for i, c in enumerate(total)})
    return terms


class LlamaBlock(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each with a residual connection.

    The natural unit for FSDP wrapping (``module_classes=['LlamaBlock']``),
    activation checkpointing and per-block ``torch.compile``.
    """

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, hidden_dim: int, norm_eps: float,
                 moe: Optional[MoEConfig] = None):
        super().__init__()
        self.attn_norm = RMSNorm(dim, norm_eps)
        self.attn = Attention(dim, num_heads, num_kv_heads, head_dim)
        self.mlp_norm = RMSNorm(dim, norm_eps)
        # With model.moe the MLP is a mixture of experts (mmpar.models.moe).
        self.mlp = FeedForward(dim, hidden_dim) if moe is None else MoE(
            dim, moe.hidden_dim or hidden_dim, moe, FeedForward)

    def forward(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # doc_ids by keyword: TP plans lay out the positional (x, cos, sin).
        x = x + self.attn(self.attn_norm(x), cos, sin, doc_ids=doc_ids)
        return x + self.mlp(self.mlp_norm(x))


def _check_sizes(dim: int, num_heads: int, num_kv_heads: int) -> None:
    if dim % num_heads:
        raise ValueError(f'model.num_heads={num_heads} must divide '
                         f'model.dim={dim}')
    if num_heads % num_kv_heads:
        raise ValueError(f'model.num_kv_heads={num_kv_heads} must divide '
                         f'model.num_heads={num_heads} (grouped-query '
                         'attention shares each key/value head by a whole '
                         'number of query heads)')


@MODELS.register_module()
class Llama(LMPipelineOutputs, BaseModel):
    """Llama-style causal LM over token ids.

    Args:
        vocab_size: number of token ids (256 for bytes).
        dim: model width.
        num_layers: number of :class:`LlamaBlock`.
        num_heads: query heads per block.
        num_kv_heads: key/value heads (``None``: as ``num_heads``; fewer is
            grouped-query attention).
        hidden_dim: SwiGLU hidden width (``None``: 8/3 x dim rounded up to
            ``multiple_of``).
        multiple_of: rounding of the default ``hidden_dim``.
        max_seq_len: longest sequence the rotary tables cover.
        rope_theta: rotary base.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the input embedding with the output head
            (refused under ``parallel.tp > 1`` or ``parallel.pp > 1``).
        init_std: standard deviation of the weight initialisation.
        moe: None (dense SwiGLU MLPs) or a dict of
            :class:`~mmpar.models.moe.MoEConfig` keys (``num_experts``,
            ``top_k``, ``score_func``, ``shared_expert``, ``balance``, ...):
            every block's MLP is a mixture of experts
            (docs/expert_parallel.md); the loss dict then also holds
            ``moe_aux_loss`` (``balance='aux_loss'``) and the per-expert
            token counts ``moe_tokens_e<i>``.
        data_preprocessor: MMEngine data preprocessor config.

    ``forward(inputs, data_samples, mode)`` with ``inputs`` and
    ``data_samples`` token ids ``(B, T)`` (targets: inputs shifted by one;
    ``-100`` marks a target that is not counted; ``doc_ids`` ``(B, T)``,
    optional, limits attention to each token's document, see
    :meth:`logits`): ``'loss'`` returns
    ``dict(loss=mean cross-entropy over the counted targets, num_tokens)``;
    ``'predict'`` a list of ``dict(loss_sum, num_tokens)``, one per sample,
    for :class:`mmpar.evaluation.LanguageModelMetric`; ``'tensor'`` the
    logits ``(B, T, vocab_size)`` (see
    :func:`mmpar.models.lm_loss.lm_outputs`).
    """

    @classmethod
    def check_expert_parallel(cls, model_cfg: dict, ep: int,
                              pp: Optional[int] = None) -> None:
        """At start-up (:func:`mmpar.parallel.experts.check_expert_model`):
        ``parallel.ep=ep`` (> 1) needs ``model.moe``, whose experts ``ep``
        divides; under ``parallel.pp=pp`` > 1 (with any ep) the experts
        are not balanced.

        Raises:
            ValueError: naming the key, the value and what is allowed.
        """
        if model_cfg.get('moe') is None:
            if ep > 1:
                raise no_experts_error(ep, model_cfg.get('type'))
            return
        moe = MoEConfig.from_cfg(model_cfg['moe'])
        if pp is not None and pp > 1 and moe.balance is not None:
            with_ep = f' and parallel.ep={ep}' if ep > 1 else ''
            raise ValueError(
                f'model.moe.balance={moe.balance!r} is not allowed; with '
                f'parallel.pp={pp}{with_ep} a pipeline stage '
                "runs its blocks without the model's forward, which adds "
                'the auxiliary loss and moves the balancing bias; allowed: '
                'None (or parallel.pp=1)')
        if moe.num_experts % ep:
            raise ValueError(
                f'model.moe.num_experts={moe.num_experts!r} is not allowed; '
                f"parallel.ep={ep} splits each layer's experts evenly over "
                f'its ranks; allowed: a multiple of {ep} (or another '
                'parallel.ep)')

    @classmethod
    def tied_weights_key(cls, model_cfg: dict) -> Optional[str]:
        """At start-up (:func:`mmpar.parallel.tied.check_tied_model`, under
        tp or pp): ``'model.tie_embeddings'`` when it ties the head to the
        embedding, else None."""
        return 'model.tie_embeddings' if model_cfg.get('tie_embeddings') \
            else None

    def __init__(self,
                 vocab_size: int = 256,
                 dim: int = 128,
                 num_layers: int = 4,
                 num_heads: int = 4,
                 num_kv_heads: Optional[int] = None,
                 hidden_dim: Optional[int] = None,
                 multiple_of: int = 32,
                 max_seq_len: int = 256,
                 rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5,
                 tie_embeddings: bool = False,
                 init_std: float = 0.02,
                 moe: Optional[dict] = None,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        num_kv_heads = num_kv_heads or num_heads
        self.moe = None if moe is None else MoEConfig.from_cfg(moe)
        _check_sizes(dim, num_heads, num_kv_heads)
        if hidden_dim is None:
            hidden_dim = multiple_of * math.ceil(8 * dim / 3 / multiple_of)
        # The architecture, resolved (a pipeline stage keeps it whole).
        self.arch = dict(
            vocab_size=vocab_size, dim=dim, num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=num_kv_heads,
            hidden_dim=hidden_dim, max_seq_len=max_seq_len,
            rope_theta=rope_theta, norm_eps=norm_eps,
            tie_embeddings=tie_embeddings)
        self.num_layers, self.num_heads = num_layers, num_heads
        self.head_dim = dim // num_heads
        self.max_seq_len, self.rope_theta = max_seq_len, rope_theta
        self.init_std = init_std
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        forced = () if self.moe is None or isinstance(
            self.moe.force_balanced, bool) else self.moe.force_balanced
        if any(i >= num_layers for i in forced):
            raise ValueError(f'model.moe.force_balanced={list(forced)} is not '
                             'allowed; allowed: block indices below '
                             f'model.num_layers={num_layers}')
        self.layers = nn.ModuleDict({
            str(i): LlamaBlock(dim, num_heads, num_kv_heads, self.head_dim,
                               hidden_dim, norm_eps,
                               None if self.moe is None else
                               self.moe.at_layer(i))
            for i in range(num_layers)
        })
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        if tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Derived, not learnt: kept out of the state dict.
        self.register_buffer('rope_cos', torch.empty(0), persistent=False)
        self.register_buffer('rope_sin', torch.empty(0), persistent=False)
        self.context_parallel: Optional[ContextParallel] = None
        if self.moe is not None:
            # The MoE layers' auxiliary loss spans whole sequences: they
            # take the cp setting too.
            self.context_parallel_modules = ('layers.*.attn', 'layers.*.mlp')
        self.reset_parameters()
        # Counted now: a sharding wrapper (FSDP1 flat parameters) hides the
        # real sizes later, and FLOPs are those of the whole model.
        self._matmul_params = self.num_params() - self._inactive_params()

    def reset_parameters(self) -> None:
        """Initialise every weight (also after building on the meta device).

        Normal(0, init_std) for embeddings and projections; the projections
        that write into the residual stream (``wo``, ``w2``) are scaled by
        ``1/sqrt(2 * num_layers)`` (GPT-2) so the residual grows slowly.
        """
        cos, sin = rotary_tables(self.head_dim, self.max_seq_len,
                                 self.rope_theta)
        device = self.tok_embeddings.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        residual_std = self.init_std / math.sqrt(2 * self.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(
                    ('.wo', '.w2')) else self.init_std
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, GroupedExperts):
                module.reset_parameters(self.init_std, residual_std)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()

    # The registered tensor-parallel plan that splits this model (what
    # tools/plan.py --search tries for tp > 1 when the config names none).
    default_tp_plan = 'llama'

    # -- the pipeline protocol (docs/pipeline_parallel.md) ------------------
    pipeline_layers = 'layers'
    pipeline_pre = ('tok_embeddings', )
    pipeline_post = ('norm', 'output')
    # Packed windows with document attention: every stage masks by them.
    pipeline_kwargs = ('doc_ids', )

    def pipeline_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(tokens)

    def pipeline_layer(self, layer: nn.Module, hidden: torch.Tensor,
                       doc_ids: Optional[torch.Tensor] = None
                       ) -> torch.Tensor:
        # Blocks take the rotary tables, which every stage keeps (buffers).
        return layer(hidden, *self.rotary(hidden.shape[1]), doc_ids=doc_ids)

    def pipeline_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(hidden))

    def logits(self, tokens: torch.Tensor,
               doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token ids ``(B, T)`` to logits ``(B, T, V)``; with ``doc_ids``
        (the whole sequence's, ``(B, T x cp)``) each token attends within
        its document, positions restarting at its first token
        (:mod:`mmpar.parallelize.documents`).

        Modules set to ``None`` (on another pipeline stage) are skipped: a
        middle stage maps hidden states to hidden states.
        """
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        cos, sin = self.rotary(h.shape[1])
        for layer in self.layers.values():
            h = layer(h, cos, sin, doc_ids=doc_ids)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor',
                doc_ids: Optional[torch.Tensor] = None
                ) -> Union[Dict, List, torch.Tensor]:
        moe_layers = self.moe_layers() if mode == 'loss' else []
        for moe in moe_layers:
            moe.update_bias()  # from the last training forward's loads
        outputs = lm_outputs(self.logits(inputs, doc_ids), data_samples,
                             mode, self.context_parallel)
        if moe_layers and self.training:
            outputs.update(moe_loss_terms(moe_layers))
        return outputs

    def moe_layers(self) -> List[MoE]:
        """This model's (or pipeline stage's) mixture-of-experts MLPs."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def _inactive_params(self) -> int:
        # Experts a token does not visit do no matmul for it.
        if self.moe is None:
            return 0
        unused = 1 - self.moe.top_k / self.moe.num_experts
        return int(sum(p.numel() for m in self.modules()
                       if isinstance(m, GroupedExperts)
                       for p in m.parameters()) * unused)

    # -- the context-parallel protocol (mmpar/parallelize/context.py) -------
    context_parallel_modules = ('layers.*.attn', )
    context_parallel_sharded = ('inputs', 'data_samples')

    def rotary(self, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables (positions ``0 .. max_seq_len-1``); each block
        uses their first ``seq_len`` rows, or under context parallelism
        its rank's positions (:class:`Attention`, which also checks the
        whole length then).

        Raises:
            ValueError: ``seq_len`` (without cp) exceeds ``max_seq_len``.
        """
        if self.context_parallel is None and \
                seq_len > self.rope_cos.shape[0]:
            raise ValueError(f'sequence length {seq_len} exceeds '
                             f'model.max_seq_len={self.max_seq_len}')
        return self.rope_cos, self.rope_sin

    def num_params(self, exclude_embedding: bool = True) -> int:
        """Parameters counted once (tied weights once); by default without
        the input embedding, which is a lookup, not a matmul."""
        params = {id(p): p.numel() for p in self.parameters()}
        if exclude_embedding and self.tok_embeddings is not None:
            params.pop(id(self.tok_embeddings.weight), None)
            if self.output is not None and \
                    self.output.weight is self.tok_embeddings.weight:
                # Tied: the head is a matmul and still counts.
                params[id(self.output.weight)] = self.output.weight.numel()
        return sum(params.values())

    # -- Hugging Face weights (mmpar/models/hf_weights.py) ----------------------
    @property
    def hf_config(self):
        """The ``LlamaConfig`` of the same model (``LlamaForCausalLM``
        computes the same logits from the same weights)."""
        return llama_hf.hf_config(self.arch)

    @staticmethod
    def hf_to_plain_name(hf_name: str) -> str:
        """This model's key of a ``LlamaForCausalLM`` key."""
        return llama_hf.plain_name(hf_name)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (see
        :func:`~mmpar.models.lm_loss.transformer_flops_per_token`); N is the
        whole model's, counted at construction."""
        return transformer_flops_per_token(self._matmul_params,
                                           self.num_layers, self.num_heads,
                                           self.head_dim, seq_len)
