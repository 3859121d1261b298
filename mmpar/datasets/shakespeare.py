"""Tiny Shakespeare as (input, target) token windows, shipped with mmpar."""
import functools
from pathlib import Path
from typing import Dict, Optional, Union

import torch
from torch.utils.data import Dataset

from mmpar.datasets.text_files import read_text
from mmpar.datasets.tokenizer import (Tokenizer, build_tokenizer,
                                      lm_metainfo)
from mmpar.registry import DATASETS

DATA_FILE = Path(__file__).parent / 'data' / 'tinyshakespeare.txt.xz'
SPLITS = ('train', 'val', 'all')
TRAIN_FRACTION = 0.9


@functools.lru_cache(maxsize=2)
def load_text(data_file: str = str(DATA_FILE)) -> str:
    """The whole corpus as text (``.xz`` or plain), read once per process."""
    return read_text(Path(data_file))


_TOKEN_CACHE: Dict[tuple, torch.Tensor] = {}


def text_tokens(data_file: str, tokenizer: Tokenizer) -> torch.Tensor:
    """The corpus as token ids (uint8 for bytes), encoded once per process
    and tokenizer."""
    key = (data_file, tokenizer.name)
    if key not in _TOKEN_CACHE:
        text = load_text(data_file)
        if tokenizer.vocab_size <= 256:
            ids = bytearray(tokenizer.encode(text))
            tokens = torch.frombuffer(ids, dtype=torch.uint8)
        else:
            tokens = torch.tensor(tokenizer.encode(text), dtype=torch.int32)
        _TOKEN_CACHE[key] = tokens
    return _TOKEN_CACHE[key]


def split_tokens(tokens: torch.Tensor, split: str) -> torch.Tensor:
    """The first 90% of the tokens are ``'train'``, the rest ``'val'``."""
    if split not in SPLITS:
        raise ValueError(f'split={split!r} is not supported; allowed: '
                         f'{", ".join(SPLITS)}')
    cut = int(len(tokens) * TRAIN_FRACTION)
    return {'train': tokens[:cut], 'val': tokens[cut:], 'all': tokens}[split]


@DATASETS.register_module()
class ShakespeareDataset(Dataset):
    """Fixed-length windows of tokens; the target is the input shifted by
    one.

    Window ``i`` always starts at the same place, so the order of batches is
    decided by the sampler's seed alone and an iteration-based resume
    (``InfiniteSampler``) continues on exactly the batches it would have seen.

    Args:
        split: ``'train'`` (first 90% of the text), ``'val'`` (last 10%) or
            ``'all'``.
        context_length: tokens per window.
        num_windows: windows per epoch; ``None`` gives every non-overlapping
            window of the split.
        random_starts: start windows at positions drawn once from ``seed``
            (more variety than non-overlapping windows); otherwise windows
            are consecutive, ``context_length`` apart (wrapping around when
            ``num_windows`` asks for more than fit).
        seed: seed of the random starts.
        data_file: the corpus (``.xz`` or plain UTF-8 text).
        tokenizer: a :data:`~mmpar.registry.TOKENIZERS` config:
            ``dict(type='ByteTokenizer')`` (default, ``None``),
            ``dict(type='ShakespeareBPE')`` (shipped) or
            ``dict(type='HFTokenizer', path=DIR)``. The split is made on the
            token ids (first 90% train).

    ``metainfo`` holds ``vocab_size``, ``context_length`` and
    ``token_bytes`` (bytes of text per token id, for bits per byte).

    Each item is ``dict(inputs=int64 (context_length,),
    data_samples=int64 (context_length,))``, ready for ``default_collate``.
    """

    def __init__(self,
                 split: str = 'train',
                 context_length: int = 128,
                 num_windows: Optional[int] = None,
                 random_starts: bool = False,
                 seed: int = 0,
                 data_file: str = str(DATA_FILE),
                 tokenizer: Union[dict, Tokenizer, None] = None):
        self.tokenizer = build_tokenizer(tokenizer)
        self.tokens = split_tokens(text_tokens(data_file, self.tokenizer),
                                   split)
        # One window needs context_length + 1 tokens (input and target).
        last_start = len(self.tokens) - context_length - 1
        if context_length < 1 or last_start < 0:
            raise ValueError(
                f'context_length={context_length} does not fit the '
                f'{split!r} split ({len(self.tokens)} tokens); allowed: '
                f'1..{len(self.tokens) - 1}')
        if num_windows is not None and num_windows < 1:
            raise ValueError(f'num_windows={num_windows} must be >= 1 or '
                             'None')
        self.split, self.context_length = split, context_length
        if random_starts:
            generator = torch.Generator().manual_seed(seed)
            count = num_windows or last_start // context_length + 1
            self.starts = torch.randint(
                0, last_start + 1, (count, ), generator=generator)
        else:
            starts = torch.arange(0, last_start + 1, context_length)
            count = num_windows or len(starts)
            self.starts = starts.repeat(-(-count // len(starts)))[:count]

    @property
    def metainfo(self) -> dict:
        return lm_metainfo(self.tokenizer, self.context_length)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        start = int(self.starts[idx])
        window = self.tokens[start:start + self.context_length + 1].long()
        return dict(inputs=window[:-1], data_samples=window[1:])
