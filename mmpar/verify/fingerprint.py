"""Cheap fingerprints of tensors that still catch a difference.

A fingerprint is a short float64 vector: the sum and the sum of squares of
the tensor, and of ``NUM_PROJECTIONS`` fixed random projections of its last
dimension. A module's output is seen as rows (every dimension but the last
flattened): a forward output's fingerprint is a sum over rows, so the parts
of one batch that data-parallel ranks, context-parallel ranks or pipeline
micro-batches hold add up to the whole batch's fingerprint, in any order.
A gradient is one whole tensor: its fingerprint also weighs the rows by a
fixed random vector, so rows that trade places differ.
"""
from typing import Dict, Tuple

import torch

NUM_PROJECTIONS = 4
_SEED = 20240601
_projections: Dict[Tuple[str, int], torch.Tensor] = {}


def _fixed_random(kind: str, size: int, width: int) -> torch.Tensor:
    """The same random ``(size, width)`` float64 matrix in every process."""
    key = (kind, size)
    if key not in _projections:
        gen = torch.Generator().manual_seed(_SEED + size + len(kind))
        _projections[key] = torch.randn(size, width, generator=gen,
                                        dtype=torch.float64)
    return _projections[key]


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float64 rows of its last dimension (a 1-D tensor: one
    value a row)."""
    flat = tensor.detach().to('cpu', torch.float64)
    if flat.dim() <= 1:
        return flat.reshape(-1, 1)
    return flat.reshape(-1, flat.shape[-1])


def row_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """Sums over the rows of ``tensor``: ``[sum, sum of squares, sums of
    NUM_PROJECTIONS projections, sums of their squares]``; additive over a
    split of the rows."""
    rows = as_rows(tensor)
    proj = rows @ _fixed_random('col', rows.shape[1], NUM_PROJECTIONS)
    return torch.cat([
        torch.stack([rows.sum(), rows.square().sum()]),
        proj.sum(0), proj.square().sum(0)
    ])


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`row_fingerprint` of a whole tensor, and its projections
    weighed row by row (order-sensitive)."""
    rows = as_rows(tensor)
    proj = rows @ _fixed_random('col', rows.shape[1], NUM_PROJECTIONS)
    weights = _fixed_random('row', rows.shape[0], 1)[:, 0]
    return torch.cat([row_fingerprint(tensor), weights @ proj])


def scales(fp: torch.Tensor, num_elements: int,
           num_rows: int) -> torch.Tensor:
    """The size each fingerprint entry is measured against: a sum of
    squares is its own size; a sum is bounded by ``sqrt(n x sum of
    squares)`` (Cauchy-Schwarz), so a difference in a sum of values that
    cancel is not magnified."""
    k = NUM_PROJECTIONS
    out = fp.abs().clone()
    out[0] = (num_elements * fp[1].abs()).sqrt()
    squares = fp[2 + k:2 + 2 * k].abs()
    out[2:2 + k] = (num_rows * squares).sqrt()
    if fp.numel() > 2 + 2 * k:  # row-weighted projections (gradients)
        out[2 + 2 * k:] = (num_rows * squares).sqrt() * 3.0
    return out
