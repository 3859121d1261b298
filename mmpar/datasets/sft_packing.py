"""Several supervised fine-tuning records packed into one window.

A record of ``n + 1`` tokens (cut to ``context_length + 1``) is the
sample it is alone without its padding: ``n`` inputs (its tokens but the
last) and ``n`` targets (its tokens but the first, ``-100`` off the
answers). Records are laid one after another into windows of
``context_length`` inputs, in order, a new window starting when the next
record does not fit (next-fit: deterministic, and each window a fixed
function of its index, so samplers, data ranks and resume treat windows as
they treat records). A record's targets are its own next tokens, so no
target predicts across records; the window's ``doc_ids`` (the record of
each input, from 0; the padding one more) let the model restart positions
and attend within a record (:mod:`mmpar.parallelize.documents`, as
:class:`~mmpar.datasets.PackedTokenDataset` hands them over), so each
record gets the logits and loss it gets alone.
"""
from typing import Dict, List, Sequence, Tuple

import numpy as np

from mmpar.datasets.packed import IGNORE_INDEX


# How SFTDataset cuts a record longer than context_length + 1 tokens.
TRUNCATIONS = ('right', 'left')


def record_sample(ids: np.ndarray, answer: np.ndarray, context_length: int,
                  truncate: str = 'right') -> Tuple[np.ndarray, np.ndarray]:
    """A record's unpadded ``(inputs, targets)``, cut to ``context_length``
    inputs: ``truncate='right'`` keeps its first ``context_length + 1``
    tokens, ``'left'`` its last (the final answer stays)."""
    keep = slice(None, context_length + 1) if truncate == 'right' else \
        slice(max(len(ids) - context_length - 1, 0), None)
    ids, answer = ids[keep], answer[keep]
    return ids[:-1], np.where(answer[1:], ids[1:], IGNORE_INDEX)


def pack_records(lengths: Sequence[int],
                 context_length: int) -> List[List[int]]:
    """The records (indices) of each window, next-fit in order; records of
    no input (one token) are left out."""
    windows, current, used = [], [], 0
    for index, length in enumerate(lengths):
        if length < 1:
            continue
        if used + length > context_length:
            windows.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    return windows + [current] if current else windows


def packed_window(samples: Sequence[Tuple[np.ndarray, np.ndarray]],
                  context_length: int,
                  pad_id: int) -> Dict[str, np.ndarray]:
    """``inputs``, ``data_samples`` and ``doc_ids`` of a window holding
    the unpadded ``samples`` (:func:`record_sample`) in order."""
    pad = context_length - sum(len(inputs) for inputs, _ in samples)
    inputs = [i for i, _ in samples] + [np.full(pad, pad_id)]
    targets = [t for _, t in samples] + [np.full(pad, IGNORE_INDEX)]
    doc_ids = [np.full(len(i), d) for d, i in enumerate(inputs)]
    return dict(inputs=np.concatenate(inputs),
                data_samples=np.concatenate(targets),
                doc_ids=np.concatenate(doc_ids))
