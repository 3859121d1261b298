"""Attention within documents of a packed sequence.

A packed sequence holds several documents one after the other; its
``doc_ids`` ``(B, T)`` number each token's document (non-decreasing along
the sequence, as :class:`mmpar.datasets.PackedTokenDataset` gives them).
Here a token attends only to the earlier tokens of its own document (a
block-diagonal causal mask) and its rotary position counts from its
document's first token, so each document gets the logits it gets alone
(the loss side, the target ``-100`` at each boundary, is the data set's).

Under context parallelism every cp rank keeps the whole ``doc_ids`` (a
small integer tensor; the model does not list it among its sequence-sharded
inputs) and takes the rows of its own positions, so the chunks of a packed
sequence keep their document masks (:func:`document_chunk_mask`, used by
:func:`mmpar.parallelize.context.context_parallel_attention`).

The mask is a dense boolean ``(B, 1, T_q, T_k)`` for
``scaled_dot_product_attention``, which runs on CPU and GPU alike; it costs
``B x T^2`` bytes, as the causal chunk masks of context parallelism do.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from mmpar.parallel.sequence import ContextParallel


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, ``(B, T)`` int64: 0 at
    every token whose document differs from the previous token's."""
    index = torch.arange(doc_ids.shape[-1], device=doc_ids.device)
    index = index.expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index))
    return index - first.cummax(dim=-1).values


def document_mask(doc_ids: torch.Tensor, query_positions: torch.Tensor,
                  num_keys: int) -> torch.Tensor:
    """``(B, 1, len(query_positions), num_keys)`` bool: True where the key
    (positions ``0 .. num_keys - 1``) is not after the query and in its
    document."""
    keys = torch.arange(num_keys, device=doc_ids.device)
    causal = query_positions[:, None] >= keys[None, :]
    same = doc_ids[:, query_positions, None] == \
        doc_ids[:, None, :num_keys]
    return (causal[None] & same)[:, None]


def document_chunk_mask(doc_ids: torch.Tensor, chunk: int,
                        chunk_len: int) -> torch.Tensor:
    """The mask of context-parallel chunk ``chunk``'s queries over the keys
    up to its end (the document form of
    :func:`mmpar.parallelize.context.causal_chunk_mask`)."""
    queries = torch.arange(chunk * chunk_len, (chunk + 1) * chunk_len,
                           device=doc_ids.device)
    return document_mask(doc_ids, queries, (chunk + 1) * chunk_len)


def document_rotary(cos: torch.Tensor, sin: torch.Tensor,
                    doc_ids: torch.Tensor, local_len: int,
                    cp: Optional[ContextParallel]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``(B, local_len, D/2)`` at each token's position
    in its document (under cp, at this rank's tokens).

    Raises:
        ValueError: ``doc_ids`` not as long as the whole sequence, or a
            document longer than the tables.
    """
    whole = local_len * (cp.size if cp is not None else 1)
    if doc_ids.dim() != 2 or doc_ids.shape[1] != whole:
        raise ValueError(
            f'doc_ids of shape {tuple(doc_ids.shape)} must be (batch, '
            f'{whole}): the whole sequence, on every context-parallel rank')
    positions = document_positions(doc_ids)
    if cp is not None:
        positions = positions[:, cp.positions(local_len, doc_ids.device)]
    if int(positions.max()) >= cos.shape[0]:
        raise ValueError(f'a document of {int(positions.max()) + 1} tokens '
                         f'exceeds model.max_seq_len={cos.shape[0]}')
    return cos[positions], sin[positions]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       doc_ids: torch.Tensor) -> torch.Tensor:
    """One-process attention within documents: ``q`` ``(B, H, T, D)`` and
    ``k``/``v`` with as many heads (repeated for grouped queries)."""
    seq = q.shape[2]
    mask = document_mask(doc_ids, torch.arange(seq, device=q.device), seq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
