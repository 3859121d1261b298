"""Packed windows of token shards: several sources blended by weight, the
loss never predicting across a document boundary.

Each source is a stream of documents (the concatenation of its shards, or
of its text files tokenized once and cached). Window ``k`` of a source is
its tokens ``[k L, k L + L + 1)`` (``L = context_length``): the inputs are
the first ``L``, the targets the last ``L``, so a window is packed across
documents, and the target of the last token of a document (the first token
of the next one) is ``-100``, not counted by the loss. With
``document_attention`` the item also carries ``doc_ids``: the document of
each input token, numbered from 0 within the window, from which the model
restarts positions and limits attention to the document
(:mod:`mmpar.parallelize.documents`).

Sample ``i`` is a fixed function of ``i`` (which source, which window),
so the order is the sampler's (its seed), every data rank reads its own
samples, and a resumed run continues at the sample
(mmpar's ``InfiniteSampler`` resume). Nothing is loaded up front: windows
are read from the shards' memory maps.
"""
import math
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from mmpar.datasets.text_files import tokenize_files
from mmpar.datasets.token_shards import TokenShard, open_shards
from mmpar.datasets.tokenizer import (Tokenizer, build_tokenizer,
                                      lm_metainfo)
from mmpar.registry import DATASETS

# The target the loss does not count: torch's cross_entropy default, as
# mmpar.models.lm_loss (not imported: mmpar.models pulls in transformers,
# seconds that tools/prepare_data.py need not pay).
IGNORE_INDEX = -100
SPLITS = ('train', 'val', 'all')
# Blending repeats the same interleaved pattern of sources every BLEND_BLOCK
# samples.
BLEND_BLOCK = 1000


class TokenStream:
    """A source: its shards' tokens as one stream, cut to a split.

    Args:
        shards: the opened shards, in order.
        split: ``'train'`` (before the cut), ``'val'`` (from it) or
            ``'all'``; the cut is the first document start at or after
            ``train_fraction`` of the tokens.
        train_fraction: where the split falls.
    """

    def __init__(self, shards: Sequence[TokenShard], split: str = 'all',
                 train_fraction: float = 0.9):
        self.shards = list(shards)
        sizes = [s.num_tokens for s in self.shards]
        self.bases = np.cumsum([0] + sizes)
        total = int(self.bases[-1])
        cut = self._document_start_from(int(total * train_fraction))
        self.begin, self.end = dict(train=(0, cut), val=(cut, total),
                                    all=(0, total))[split]

    def _document_start_from(self, position: int) -> int:
        """The first document start at or after ``position`` (the end of
        the stream when none)."""
        for index, shard in enumerate(self.shards):
            base = int(self.bases[index])
            starts = shard.offsets[:-1]
            at = int(np.searchsorted(starts, position - base, side='left'))
            if at < len(starts):
                return base + int(starts[at])
        return int(self.bases[-1])

    def __len__(self) -> int:
        return self.end - self.begin

    def read(self, start: int, length: int) -> np.ndarray:
        """``length`` tokens from ``start`` (relative to the split), as
        int64."""
        start += self.begin
        out, end = [], start + length
        first = int(np.searchsorted(self.bases, start, side='right')) - 1
        for index in range(first, len(self.shards)):
            base = int(self.bases[index])
            if base >= end:
                break
            lo, hi = max(start - base, 0), min(end - base,
                                               self.shards[index].num_tokens)
            out.append(np.asarray(self.shards[index].tokens[lo:hi]))
        return np.concatenate(out).astype(np.int64)

    def starts_between(self, start: int, end: int) -> np.ndarray:
        """Absolute positions in ``[start, end)`` where documents start."""
        found = []
        for index, shard in enumerate(self.shards):
            base = int(self.bases[index])
            if base < end and base + shard.num_tokens > start:
                found.append(shard.starts_between(start - base, end - base)
                             + base)
        return np.concatenate(found) if found else np.zeros(0, np.int64)


def check_count(key: str, value, optional: bool = False) -> None:
    """Raises ValueError unless ``value`` is an int >= 1 (or None when
    ``optional``), naming ``key``."""
    if not (value is None and optional or
            isinstance(value, int) and value >= 1):
        raise ValueError(f'{key}={value!r} must be an int >= 1' +
                         (' or None' if optional else ''))


def blend_counts(weights: Sequence[float], block: int) -> List[int]:
    """Samples per source in each block of ``block``: proportional to
    ``weights`` (largest remainder; ties to the earlier source).

    Raises:
        ValueError: a negative weight, or none positive.
    """
    if any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ValueError(f'source weights {list(weights)} must be >= 0 with '
                         'a positive sum')
    shares = [block * w / sum(weights) for w in weights]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(shares)),
                          key=lambda i: (counts[i] - shares[i], i))
    for i in by_remainder[:block - sum(counts)]:
        counts[i] += 1
    return counts


def interleave(counts: Sequence[int]) -> tuple:
    """The block's layout for per-source ``counts``: ``(sources, slots)``,
    the source of each offset and which of that source's slots it is.

    Slot ``k`` of source ``s`` sits at ``(k + 0.5) / counts[s]`` of the
    block, so every prefix of the block holds each source's share of it to
    within one sample (an epoch shorter than a block, or the partial block
    at its end, keeps the weights' shares).
    """
    sources = np.repeat(np.arange(len(counts)), counts)
    slots = np.concatenate([np.arange(c) for c in counts])
    keys = (slots + 0.5) / np.asarray(counts)[sources]
    order = np.lexsort((sources, keys))  # by key, ties to the earlier source
    return sources[order], slots[order]


def window_targets(window: np.ndarray, starts: np.ndarray,
                   mask_boundaries: bool) -> np.ndarray:
    """The targets of a window of ``L + 1`` tokens whose document starts
    (relative to the window) are ``starts``: the window shifted by one,
    ``-100`` where the target begins another document."""
    targets = window[1:].copy()
    if mask_boundaries:
        targets[starts[starts >= 1] - 1] = IGNORE_INDEX
    return targets


def window_doc_ids(length: int, starts: np.ndarray) -> np.ndarray:
    """The document (0, 1, ...) of each of a window's ``length`` inputs."""
    marks = np.zeros(length, np.int64)
    marks[starts[(starts >= 1) & (starts < length)]] = 1
    return np.cumsum(marks)


@DATASETS.register_module()
class PackedTokenDataset(Dataset):
    """Windows of ``context_length`` tokens packed across documents, from
    several sources blended by weight.

    Args:
        sources: one entry per source, each a dict with ``weight`` (default
            1.0) and either ``shards`` (a shard prefix or a list of them:
            ``tools/prepare_data.py``'s output) or ``files`` (text / JSONL
            / Parquet paths, globs or directories, tokenized by
            ``tokenizer`` into ``cache_dir`` on first use; also
            ``text_key`` and ``separator``, see
            :func:`mmpar.datasets.text_files.iter_documents`). A string is
            a shard prefix.
        context_length: tokens per window (inputs; targets the same
            shifted by one).
        num_windows: samples per epoch, blended by the sources' weights:
            every 1,000 samples (and every prefix of them) give each source
            its share; a source whose share asks for more than it holds
            repeats its windows. ``None``: each source's windows once, in
            order, source after source, without blending (weights unused;
            what validation needs).
        split: ``'train'`` (each source's first ``train_fraction`` of
            tokens, cut at a document start), ``'val'`` (the rest) or
            ``'all'``.
        train_fraction: where ``split`` cuts.
        mask_boundaries: the target of a document's last token (the next
            document's first) is ``-100``.
        document_attention: items carry ``doc_ids`` so that the model
            restarts positions at each document and attends within it
            (:class:`mmpar.models.Llama`; refused with ``parallel.pp > 1``).
        tokenizer: a ``TOKENIZERS`` config: encodes ``files`` sources and
            gives ``token_bytes`` for bits per byte (``None``: bytes).
        cache_dir: where ``files`` sources are cached (``None``:
            ``$MMPAR_CACHE/tokens`` or ``~/.cache/mmpar/tokens``).

    Each item is ``dict(inputs=int64 (L,), data_samples=int64 (L,))`` plus
    ``doc_ids=int64 (L,)`` with ``document_attention``.

    Raises:
        ValueError: a source with no whole window, shards of another
            vocabulary than ``tokenizer``, a bad split or weight.
        ConfigError: shards written by another tokenizer (by the digest
            the shards record; older shards are not checked).
    """

    def __init__(self,
                 sources: Sequence[Union[str, dict]],
                 context_length: int = 128,
                 num_windows: Optional[int] = None,
                 split: str = 'all',
                 train_fraction: float = 0.9,
                 mask_boundaries: bool = True,
                 document_attention: bool = False,
                 tokenizer: Union[dict, Tokenizer, None] = None,
                 cache_dir: Optional[str] = None):
        if split not in SPLITS:
            raise ValueError(f'split={split!r} is not supported; allowed: '
                             f'{", ".join(SPLITS)}')
        check_count('context_length', context_length)
        if isinstance(sources, (str, dict)) or not sources:
            raise ValueError(f'sources={sources!r} must be a non-empty list '
                             'of shard prefixes or source dicts')
        self.tokenizer = build_tokenizer(tokenizer)
        self.context_length = context_length
        self.mask_boundaries = mask_boundaries
        self.document_attention = document_attention
        self.streams, weights = [], []
        for index, source in enumerate(sources):
            source = dict(shards=source) if isinstance(source, str) \
                else dict(source)
            weights.append(float(source.pop('weight', 1.0)))
            self.streams.append(
                TokenStream(self._open(index, source, cache_dir), split,
                            train_fraction))
        self.source_windows = [(len(s) - 1) // context_length
                               for s in self.streams]
        for index, count in enumerate(self.source_windows):
            if count < 1:
                raise ValueError(
                    f'sources[{index}] has {len(self.streams[index])} tokens '
                    f'in split {split!r}: not one window of '
                    f'context_length={context_length} + 1')
        self.block = BLEND_BLOCK if len(self.streams) > 1 else 1
        self.counts = blend_counts(weights, self.block)
        self.block_sources, self.block_slots = interleave(self.counts)
        check_count('num_windows', num_windows, optional=True)
        self.blended = num_windows is not None
        self.cum_windows = np.cumsum([0] + self.source_windows)
        self.num_windows = num_windows or int(self.cum_windows[-1])

    def _open(self, index: int, source: dict,
              cache_dir: Optional[str]) -> List[TokenShard]:
        if ('shards' in source) == ('files' in source):
            raise ValueError(f'sources[{index}]={source!r} must name one of '
                             'shards, files')
        if 'files' in source:
            options = {k: source.pop(k) for k in ('text_key', 'separator')
                       if k in source}
            prefixes = [tokenize_files(source.pop('files'), self.tokenizer,
                                       cache_dir, **options)]
        else:
            shards = source.pop('shards')
            prefixes = [shards] if isinstance(shards, str) else list(shards)
        if source:
            raise ValueError(f'sources[{index}] has unknown keys '
                             f'{sorted(source)}; allowed: weight, shards, '
                             'files, text_key, separator')
        return open_shards(prefixes, self.tokenizer.vocab_size,
                           self.tokenizer)

    @property
    def metainfo(self) -> dict:
        return lm_metainfo(self.tokenizer, self.context_length)

    def __len__(self) -> int:
        return self.num_windows

    def locate(self, idx: int) -> tuple:
        """``(source, window)`` of sample ``idx``, a function of ``idx``
        alone (resume continues at the sample). Blended: every block
        repeats the interleaved per-source counts; a source's windows are
        taken in order and repeat when used up. Not blended
        (``num_windows=None``): the sources' windows one after another."""
        if not self.blended:
            source = int(np.searchsorted(self.cum_windows, idx,
                                         side='right')) - 1
            return source, idx - int(self.cum_windows[source])
        block, offset = divmod(idx, self.block)
        source = int(self.block_sources[offset])
        used = block * self.counts[source] + int(self.block_slots[offset])
        return source, used % self.source_windows[source]

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_windows:
            raise IndexError(f'index {idx} out of range 0..'
                             f'{self.num_windows - 1}')
        source, window = self.locate(idx)
        stream, length = self.streams[source], self.context_length
        start = window * length
        tokens = stream.read(start, length + 1)
        begin = stream.begin + start
        starts = stream.starts_between(begin, begin + length + 1) - begin
        item = dict(
            inputs=torch.from_numpy(tokens[:-1]),
            data_samples=torch.from_numpy(
                window_targets(tokens, starts, self.mask_boundaries)))
        if self.document_attention:
            item['doc_ids'] = torch.from_numpy(window_doc_ids(length, starts))
        return item
