"""Pre-tokenized token shards: documents as memory-mapped token arrays.

One shard is three files sharing a prefix (docs/data.md has the format):

* ``PREFIX.bin``: every document's token ids, one after the other, as
  little-endian ``uint16`` (a vocabulary of at most 65,536 ids) or
  ``uint32``; no separators.
* ``PREFIX.idx``: ``num_documents + 1`` little-endian ``int64`` offsets into
  ``.bin`` (in tokens): document ``i`` is ``tokens[idx[i]:idx[i + 1]]``;
  ``idx[0] == 0`` and ``idx[-1] == num_tokens``.
* ``PREFIX.json``: the header: ``format`` (``'mmpar-tokens'``), ``version``
  (1), ``dtype``, ``num_tokens``, ``num_documents``, ``vocab_size``,
  ``tokenizer`` (the tokenizer's name), ``tokenizer_digest`` (its
  ``digest``; absent in shards written before it was recorded) and
  ``sources`` (what was read).

The layout of Megatron's indexed datasets and nanoGPT's ``.bin`` files: a
reader maps both arrays (``np.memmap``) and touches only the pages of the
windows it reads, so a shard far larger than memory costs a rank no private
memory. A writer writes under temporary names and renames the files into
place on success, the header last: a reader never sees a half-written shard,
and ranks writing the same shard at once each write whole files.
"""
import json
import os
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np

from mmpar.failures import ConfigError

FORMAT, VERSION = 'mmpar-tokens', 1
SUFFIXES = ('.bin', '.idx', '.json')
OFFSET_DTYPE = np.dtype('<i8')


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest token dtype for ``vocab_size`` ids: ``uint16`` up to
    65,536 ids, else ``uint32``.

    Raises:
        ValueError: ``vocab_size`` below 1 or above 2**32.
    """
    if not 1 <= vocab_size <= 2**32:
        raise ValueError(f'vocab_size={vocab_size} is not supported; '
                         'allowed: 1 .. 2**32')
    return np.dtype('<u2') if vocab_size <= 2**16 else np.dtype('<u4')


def shard_files(prefix: Union[str, Path]) -> List[Path]:
    """The ``.bin``, ``.idx`` and ``.json`` paths of a shard."""
    prefix = str(prefix)
    return [Path(prefix + suffix) for suffix in SUFFIXES]


class TokenShardWriter:
    """Write one shard a document at a time (the corpus never held whole).

    Use as a context manager. The files are written under a temporary
    prefix and renamed into place on a clean exit, the header last; on an
    error the temporary files are removed and an earlier shard at
    ``prefix`` is left as it was.

    Args:
        prefix: the shard's path without a suffix.
        vocab_size: ids are below it (picks the dtype; checked per
            document).
        tokenizer: the tokenizer's name, recorded in the header.
        sources: what the documents were read from, recorded.
        tokenizer_digest: the tokenizer's ``digest``, recorded.
    """

    def __init__(self, prefix: Union[str, Path], vocab_size: int,
                 tokenizer: str = '', sources: Sequence[str] = (),
                 tokenizer_digest: str = ''):
        self.paths = shard_files(prefix)
        self.bin_path, self.idx_path, self.json_path = shard_files(
            f'{prefix}.tmp{os.getpid()}')
        self.vocab_size, self.dtype = vocab_size, token_dtype(vocab_size)
        self.header = dict(format=FORMAT, version=VERSION,
                           dtype=self.dtype.name, vocab_size=vocab_size,
                           tokenizer=tokenizer,
                           tokenizer_digest=tokenizer_digest,
                           sources=list(sources))
        self.offsets = [0]
        self._bin = self._idx = None

    def __enter__(self) -> 'TokenShardWriter':
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.bin_path, 'wb')
        return self

    def add(self, ids: Sequence[int]) -> None:
        """Append one document's token ids.

        Raises:
            ValueError: an id outside ``0 .. vocab_size - 1``.
        """
        array = np.asarray(ids, dtype=np.int64)
        if array.size and (array.min() < 0
                           or array.max() >= self.vocab_size):
            raise ValueError(
                f'document {len(self.offsets) - 1} has token ids '
                f'{array.min()}..{array.max()}; allowed: 0 .. '
                f'{self.vocab_size - 1} (vocab_size={self.vocab_size})')
        self._bin.write(array.astype(self.dtype).tobytes())
        self.offsets.append(self.offsets[-1] + array.size)

    def __exit__(self, exc_type, *_) -> None:
        self._bin.close()
        tmp_paths = (self.bin_path, self.idx_path, self.json_path)
        if exc_type is not None:
            for path in tmp_paths:
                path.unlink(missing_ok=True)
            return
        np.asarray(self.offsets, OFFSET_DTYPE).tofile(self.idx_path)
        header = dict(self.header, num_tokens=self.offsets[-1],
                      num_documents=len(self.offsets) - 1)
        self.json_path.write_text(json.dumps(header, indent=1) + '\n')
        for src, dst in zip(tmp_paths, self.paths):
            os.replace(src, dst)


def write_token_shard(prefix: Union[str, Path],
                      documents: Iterable[Sequence[int]], vocab_size: int,
                      tokenizer: str = '',
                      sources: Sequence[str] = (),
                      tokenizer_digest: str = '') -> dict:
    """Write ``documents`` (token id sequences) as one shard
    (:class:`TokenShardWriter` has the arguments).

    Returns:
        The header written.
    """
    with TokenShardWriter(prefix, vocab_size, tokenizer, sources,
                          tokenizer_digest) as writer:
        for ids in documents:
            writer.add(ids)
    return read_header(prefix)


def read_header(prefix: Union[str, Path]) -> dict:
    """A shard's header, checked against its files.

    Raises:
        FileNotFoundError: a file of the shard is missing (the header is
            written last: none means the writer did not finish).
        ValueError: not this format or version, or file sizes that do not
            match the header.
    """
    bin_path, idx_path, json_path = shard_files(prefix)
    for path in (json_path, bin_path, idx_path):
        if not path.is_file():
            raise FileNotFoundError(
                f'token shard {str(prefix)!r}: {path} is missing; a shard is '
                f'{", ".join(p.name for p in shard_files(prefix))} '
                '(tools/prepare_data.py writes them)')
    header = json.loads(json_path.read_text())
    if header.get('format') != FORMAT or header.get('version') != VERSION:
        raise ValueError(
            f'{json_path}: format={header.get("format")!r} '
            f'version={header.get("version")!r}; allowed: {FORMAT!r} '
            f'version {VERSION}')
    itemsize = np.dtype(header['dtype']).itemsize
    expected = {bin_path: header['num_tokens'] * itemsize,
                idx_path: (header['num_documents'] + 1) * 8}
    for path, size in expected.items():
        if path.stat().st_size != size:
            raise ValueError(f'{path} has {path.stat().st_size} bytes; its '
                             f'header says {size} (a truncated or foreign '
                             'file)')
    return header


class TokenShard:
    """A shard, read through memory maps (nothing is loaded up front).

    Args:
        prefix: the shard's path without a suffix.

    Attributes:
        header: the checked header.
        tokens: ``np.memmap`` of every token id.
        offsets: ``np.memmap`` of the document offsets.
    """

    def __init__(self, prefix: Union[str, Path]):
        self.prefix = str(prefix)
        self.header = read_header(prefix)
        bin_path, idx_path, _ = shard_files(prefix)
        # An empty file cannot be mapped; an empty shard has no tokens.
        self.tokens = np.memmap(bin_path, dtype=self.header['dtype'],
                                mode='r') if self.num_tokens else \
            np.zeros(0, self.header['dtype'])
        self.offsets = np.memmap(idx_path, dtype=OFFSET_DTYPE, mode='r')

    @property
    def num_tokens(self) -> int:
        return int(self.header['num_tokens'])

    @property
    def num_documents(self) -> int:
        return int(self.header['num_documents'])

    @property
    def vocab_size(self) -> int:
        return int(self.header['vocab_size'])

    def document(self, index: int) -> np.ndarray:
        """Token ids of document ``index`` (a view of the map)."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.tokens[start:end]

    def starts_between(self, start: int, end: int) -> np.ndarray:
        """Token positions in ``[start, end)`` where a document starts
        (an empty document's start repeats the next one's)."""
        starts = self.offsets[:-1]  # the last offset is the end
        lo, hi = np.searchsorted(starts, [start, end], side='left')
        return np.asarray(starts[lo:hi])


def check_shard_tokenizer(shard: TokenShard, tokenizer) -> None:
    """Refuse a shard written by another tokenizer than ``tokenizer``, by
    the ``digest`` of what defines its ids. A shard written before the
    digest was recorded, or a tokenizer of the user's without a ``digest``,
    passes as before (the name alone, an absolute path, would refuse a moved
    checkout's shards).

    Raises:
        ConfigError: naming the key, both tokenizers and what is allowed.
    """
    written = shard.header.get('tokenizer_digest') or ''
    ours = getattr(tokenizer, 'digest', '') or ''
    if written and ours and written != ours:
        raise ConfigError(
            f'tokenizer: token shard {shard.prefix!r} was written by '
            f'tokenizer {shard.header.get("tokenizer")!r} (digest '
            f'{written}); the config\'s tokenizer is {tokenizer.name!r} '
            f'(digest {ours}); allowed: the tokenizer the shard was written '
            'with, or re-run tools/prepare_data.py with this one')


def open_shards(prefixes: Sequence[Union[str, Path]],
                vocab_size: Optional[int] = None,
                tokenizer=None) -> List[TokenShard]:
    """Open shards, all written for one vocabulary (``vocab_size`` when
    given) and by ``tokenizer`` when given
    (:func:`check_shard_tokenizer`).

    Raises:
        ValueError: shards of different vocabulary sizes.
        ConfigError: a shard written by another tokenizer.
    """
    shards = [TokenShard(p) for p in prefixes]
    if tokenizer is not None:
        for shard in shards:
            check_shard_tokenizer(shard, tokenizer)
    sizes = {s.vocab_size for s in shards} | (
        {vocab_size} if vocab_size else set())
    if len(sizes) > 1:
        raise ValueError(
            'token shards of different vocabularies: ' + ', '.join(
                f'{s.prefix} ({s.vocab_size})' for s in shards) +
            (f' (expected {vocab_size})' if vocab_size else '') +
            '; allowed: shards written with one tokenizer')
    return shards
