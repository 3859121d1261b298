"""Context parallelism: one sequence split over ranks, attention across them.

The all-gather scheme of the Llama 3 paper (section 3.3.2): each rank of the
context-parallel (cp) group holds a part of every sequence, runs everything
but attention on its own tokens, and for attention all-gathers the keys and
values of the whole sequence; its queries attend to them under the causal
mask of their true positions. In backward the gradient of the gathered keys/
values is reduce-scattered back to the ranks that own them.

Load balance: the sequence is cut into ``2 * cp`` chunks and cp rank ``r``
holds chunks ``r`` and ``2 * cp - 1 - r`` (an early and a late one). Under a
causal mask a chunk's queries attend to every earlier chunk, so with plain
contiguous halves the last rank would do ``2 * cp - 1`` times the first
rank's work; paired this way every rank attends to the same number of keys
(:func:`attention_work`). Each query chunk attends only to the keys up to
its own end, so the saving is real compute, not just masked-out scores.

torch's own ``context_parallel`` (ring attention) has no CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy in
torch 2.13); this path is plain ``scaled_dot_product_attention`` with an
explicit mask plus two collectives, so it runs on every backend, gloo
included.

The model protocol (how a model opts in)::

    class MyModel(BaseModel):
        # module-name patterns (per dot-separated part, as tensor-parallel
        # plans) of the attention modules; each has an attribute
        # `context_parallel` (None by default) and, when it is set, calls
        # context_parallel_attention(q, k, v, self.context_parallel).
        context_parallel_modules = ('layers.*.attn', )
        # forward arguments that are cut along the sequence (dim 1).
        context_parallel_sharded = ('inputs', 'data_samples')

        def __init__(self):
            ...
            self.context_parallel = None  # this rank's positions come from
                                          # it (rotary embeddings)

:func:`apply_context_parallel` sets ``context_parallel`` on the model and on
each attention module; :func:`shard_batch` cuts a batch's sequence-sharded
tensors for this rank. Positions are not a batch tensor: the model derives
them from its setting (:meth:`ContextParallel.positions`).
"""
from typing import List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

# The sequence layout lives in mmpar.parallel.sequence (the step body, a
# layer below, cuts batches with it); re-exported as this technique's API.
from mmpar.parallel.sequence import (ATTENTION_ATTR, SETTING_ATTR,  # noqa
                                     SHARDED_ATTR, ContextParallel,
                                     check_seq_len, chunk_ids, shard_batch,
                                     sequence_positions, shard_sequence,
                                     unshard_sequence)
from mmpar.parallelize.documents import (document_attention,
                                        document_chunk_mask)
from mmpar.parallelize.module_plan import match_modules

# torch 2.13 renamed these (the old names warn); mmpar supports torch >= 2.4,
# where gloo has both under the old names.
_all_gather_single = getattr(dist, 'all_gather_single', None) or \
    dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, 'reduce_scatter_single', None) or \
    dist.reduce_scatter_tensor


# -- the load balance ------------------------------------------------------
def causal_chunk_mask(chunk: int, chunk_len: int,
                      device=None) -> torch.Tensor:
    """Which keys the queries of chunk ``chunk`` see: ``(chunk_len, (chunk +
    1) * chunk_len)`` bool, True where the key's position is not after the
    query's (keys past the chunk's end are not computed at all)."""
    end = (chunk + 1) * chunk_len
    ones = torch.ones(chunk_len, end, dtype=torch.bool, device=device)
    return ones.tril(diagonal=chunk * chunk_len)


def attention_work(seq_len: int, rank: int, cp: int) -> Tuple[int, int]:
    """Attention work of one rank per (batch, head): ``(scores computed,
    (query, key) pairs unmasked)``, from the masks
    :func:`context_parallel_attention` uses. Equal on every rank."""
    chunk_len = check_seq_len(seq_len, cp)
    masks = [causal_chunk_mask(c, chunk_len) for c in chunk_ids(rank, cp)]
    return (sum(m.numel() for m in masks), sum(int(m.sum()) for m in masks))


# -- attention --------------------------------------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` in rank order; backward reduce-scatters.

    Every rank's attention read every rank's keys/values, so the gradient
    of one rank's keys/values is the sum over ranks of the gradient of its
    gathered copy: a reduce-scatter (an all-gather's adjoint).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int,
                group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        local = x.movedim(dim, 0).contiguous()
        size = dist.get_world_size(group)
        out = local.new_empty((size * local.shape[0], ) + local.shape[1:])
        _all_gather_single(out, local, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.movedim(ctx.dim, 0).contiguous()
        size = dist.get_world_size(ctx.group)
        out = whole.new_empty((whole.shape[0] // size, ) + whole.shape[1:])
        _reduce_scatter_single(out, whole, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def repeat_kv_heads(k: torch.Tensor, v: torch.Tensor,
                    num_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys/values ``(B, H_kv, T, D)`` repeated to
    ``num_heads`` heads (each shared by ``num_heads // H_kv`` query heads)."""
    groups = num_heads // k.shape[1]
    if groups == 1:
        return k, v
    return (k.repeat_interleave(groups, dim=1),
            v.repeat_interleave(groups, dim=1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One-process causal attention, ``q`` ``(B, H, T, D)``, ``k``/``v``
    ``(B, H_kv, T, D)``: what :func:`context_parallel_attention` replaces.
    With ``doc_ids`` ``(B, T)``, within documents
    (:mod:`mmpar.parallelize.documents`)."""
    k, v = repeat_kv_heads(k, v, q.shape[1])
    if doc_ids is not None:
        return document_attention(q, k, v, doc_ids)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gather_sequence(x: torch.Tensor, cp: ContextParallel,
                    dim: int) -> torch.Tensor:
    """The whole sequence along ``dim``, in sequence order, from every cp
    rank's part (differentiable: gradients go back to the owning rank)."""
    if cp.size == 1:
        return x
    gathered = _GatherSequence.apply(x, dim, cp.group)
    return unshard_sequence(gathered.chunk(cp.size, dim), dim)


def context_parallel_attention(q: torch.Tensor,
                               k: torch.Tensor,
                               v: torch.Tensor,
                               cp: ContextParallel,
                               scale: Optional[float] = None,
                               doc_ids: Optional[torch.Tensor] = None
                               ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence.

    What backward keeps is this rank's ``q``, ``k`` and ``v`` only: the
    whole sequence's keys/values and the chunk masks (a ``t x T`` matrix per
    chunk, which SDPA saves) are made again in backward, the keys/values
    gathered a second time, as ring attention sends them around again. So
    a rank's activations fall as ``1 / cp`` (benchmarks/
    bench_context_parallel.py measures it) for one more all-gather and
    attention forward per layer.

    Args:
        q: ``(B, H, t, D)`` queries of this rank's ``t`` tokens (its two
            chunks, in :func:`shard_sequence` order), rotary embeddings
            applied at their true positions.
        k: ``(B, H_kv, t, D)`` keys of the same tokens; ``H_kv`` divides
            ``H`` (grouped-query attention: gathered before the heads are
            repeated, so only ``H_kv`` heads travel).
        v: ``(B, H_kv, t, D)`` values.
        cp: the context-parallel setting.
        scale: the score scale (``None``: ``1 / sqrt(D)``).
        doc_ids: ``(B, T)`` the whole sequence's document ids (every cp
            rank holds them whole): attention within documents
            (:func:`~mmpar.parallelize.documents.document_chunk_mask`).

    Returns:
        ``(B, H, t, D)``: what one-process causal attention over the whole
        sequence gives at this rank's positions.

    Raises:
        ValueError: ``t`` odd (the whole sequence not cut in 2 x cp chunks).
    """
    check_seq_len(q.shape[2] * cp.size, cp.size)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # Every cp rank runs the recomputation in the same backward order,
        # so the all-gather in it pairs up like the forward's.
        return checkpoint(_attend, q, k, v, cp, scale, doc_ids,
                          use_reentrant=False, preserve_rng_state=False)
    return _attend(q, k, v, cp, scale, doc_ids)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            cp: ContextParallel, scale: Optional[float],
            doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    chunk_len = q.shape[2] // 2
    # One collective for keys and values together.
    k, v = gather_sequence(torch.stack((k, v)), cp, dim=3).unbind(0)
    k, v = repeat_kv_heads(k, v, q.shape[1])
    outs = []
    for q_chunk, chunk in zip(q.split(chunk_len, dim=2),
                              chunk_ids(cp.rank, cp.size)):
        mask = causal_chunk_mask(chunk, chunk_len, q.device) \
            if doc_ids is None else \
            document_chunk_mask(doc_ids, chunk, chunk_len)
        end = mask.shape[-1]
        outs.append(
            F.scaled_dot_product_attention(
                q_chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                scale=scale))
    return torch.cat(outs, dim=2)


# -- switching a model ------------------------------------------------------
def attention_modules(model: nn.Module) -> List[nn.Module]:
    """The modules ``model`` declares as attention (its
    ``context_parallel_attention`` patterns).

    Raises:
        ValueError: the model, or a matched module, lacks the protocol, or
            the patterns match nothing.
    """
    name = type(model).__name__
    missing = [a for a in (ATTENTION_ATTR, SHARDED_ATTR, SETTING_ATTR)
               if not hasattr(model, a)]
    if missing:
        raise ValueError(
            f'{name} cannot run context parallel (parallel.cp > 1): it has '
            f'no {", ".join(missing)}; see mmpar/parallelize/context.py for '
            'the protocol (attention modules that call '
            'context_parallel_attention, the sequence-sharded inputs, and '
            'a context_parallel setting for positions)')
    patterns = getattr(model, ATTENTION_ATTR)
    if isinstance(patterns, str):
        patterns = (patterns, )
    modules = []
    for pattern in patterns:
        for module_name in match_modules(model, pattern):
            module = model.get_submodule(module_name)
            if not hasattr(module, SETTING_ATTR):
                raise ValueError(
                    f'{name}.{ATTENTION_ATTR} matches {module_name!r}, a '
                    f'{type(module).__name__} with no {SETTING_ATTR} '
                    'attribute: it cannot switch to context-parallel '
                    'attention')
            modules.append(module)
    if not modules:
        raise ValueError(f'{name}.{ATTENTION_ATTR}={patterns!r} matches no '
                         'module')
    return modules


def apply_context_parallel(
    model: nn.Module, cp: Union[ContextParallel, ProcessGroup, DeviceMesh,
                                None]
) -> Optional[ContextParallel]:
    """Switch ``model`` into context-parallel mode over ``cp`` (``None``:
    back to ordinary attention). Parameters do not change: cp ranks hold the
    same weights, and their gradients are summed over the cp group like
    data-parallel ones.

    Args:
        model: a model with the protocol (see the module docstring).
        cp: the cp process group, a 1-D cp device mesh, or ``None``.

    Returns:
        The setting now on the model and its attention modules.

    Raises:
        ValueError: the model lacks the protocol, or ``cp`` is neither.
    """
    modules = attention_modules(model)
    setting = None if cp is None else ContextParallel.of(cp)
    for module in [model] + modules:
        setattr(module, SETTING_ATTR, setting)
    return setting
