"""A byte-level tokenizer: every UTF-8 byte is one token (vocabulary 256).

Nothing to download or train, and bits per byte equal bits per token.
"""
from typing import Iterable, List


class ByteTokenizer:
    """Text <-> UTF-8 byte ids."""

    vocab_size = 256

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return list(text.encode('utf-8'))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; byte runs that are not valid UTF-8 (a model can
        emit them) become U+FFFD instead of raising."""
        return bytes(int(i) for i in ids).decode('utf-8', errors='replace')
