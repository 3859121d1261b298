"""Tokenizers for the text datasets, chosen in the config.

- :class:`ByteTokenizer` (the default): every UTF-8 byte is one token
  (vocabulary 256); nothing to download or train.
- :class:`HFTokenizer`: a Hugging Face tokenizer from a local directory
  (``AutoTokenizer.from_pretrained``, no download).
- ``ShakespeareBPE``: the byte-level BPE tokenizer (vocabulary 512) shipped
  in ``mmpar/datasets/data/shakespeare_bpe``, trained on the shipped Tiny
  Shakespeare text by :func:`train_shakespeare_bpe` (deterministic; a test
  retrains it and compares).

Every tokenizer gives ``token_bytes()``: the UTF-8 bytes of text each token
id stands for, so the metric reports bits per *byte* whatever the tokenizer
(:class:`mmpar.evaluation.LanguageModelMetric`), and ``digest``: a hash of
what defines its ids (the token cache's key and the shard header record it,
so tokens of another tokenizer are never reused).
"""
import hashlib
import os.path as osp
from pathlib import Path
from typing import Iterable, List, Optional, Union

from mmpar.failures import ConfigError
from mmpar.registry import TOKENIZERS

SHAKESPEARE_BPE_DIR = Path(__file__).parent / 'data' / 'shakespeare_bpe'
SHAKESPEARE_BPE_VOCAB = 512
# The files of a Hugging Face tokenizer directory that define its ids (not
# the model's weights or config, which may sit in the same directory).
HF_TOKENIZER_FILES = ('tokenizer*', 'vocab*', 'merges*', '*.model',
                      'special_tokens_map.json', 'added_tokens.json')
# Bumped when ByteTokenizer's ids change (its digest).
BYTE_TOKENIZER_VERSION = 1


def short_digest(data: bytes) -> str:
    """The first 16 hex digits of ``data``'s SHA-256."""
    return hashlib.sha256(data).hexdigest()[:16]


def tokenizer_files_digest(path: str) -> str:
    """A digest of the names and bytes of the files in directory ``path``
    that define a Hugging Face tokenizer (:data:`HF_TOKENIZER_FILES`)."""
    found = sorted({p for pattern in HF_TOKENIZER_FILES
                    for p in Path(path).glob(pattern) if p.is_file()})
    hasher = hashlib.sha256()
    for file in found:
        hasher.update(file.name.encode() + b'\0')
        hasher.update(hashlib.sha256(file.read_bytes()).digest())
    return hasher.hexdigest()[:16]


@TOKENIZERS.register_module()
class ByteTokenizer:
    """Text <-> UTF-8 byte ids."""

    vocab_size = 256
    name = 'bytes'
    digest = short_digest(f'ByteTokenizer {BYTE_TOKENIZER_VERSION}'.encode())

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return list(text.encode('utf-8'))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; byte runs that are not valid UTF-8 (a model can
        emit them) become U+FFFD instead of raising."""
        return bytes(int(i) for i in ids).decode('utf-8', errors='replace')

    def token_bytes(self) -> List[int]:
        """Bytes of text per token id: one each."""
        return [1] * self.vocab_size


@TOKENIZERS.register_module()
class HFTokenizer:
    """A Hugging Face tokenizer from a local directory.

    Args:
        path: a directory ``save_pretrained`` wrote (``tokenizer.json`` and
            ``tokenizer_config.json``, or a slow tokenizer's files).

    Raises:
        FileNotFoundError: ``path`` is not a directory (nothing is
            downloaded).
    """

    def __init__(self, path: str):
        from mmpar.models.hf import import_transformers
        if not osp.isdir(path):
            raise FileNotFoundError(
                f'HFTokenizer path={path!r} is not a directory; allowed: a '
                'local directory with tokenizer.json (save_pretrained); '
                'nothing is downloaded')
        self.path = str(path)
        self.name = osp.abspath(path)
        self.digest = tokenizer_files_digest(path)
        self.tokenizer = import_transformers().AutoTokenizer.from_pretrained(
            self.path, local_files_only=True)
        self.vocab_size = len(self.tokenizer)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self.tokenizer.decode([int(i) for i in ids])

    def token_bytes(self) -> List[int]:
        """Bytes of text per token id: exact for byte-level BPE (each
        character of a token's string is one byte), otherwise the UTF-8
        length of the id decoded alone; special tokens are 0."""
        special = set(self.tokenizer.all_special_ids)
        backend = getattr(self.tokenizer, 'backend_tokenizer', None)
        byte_level = backend is not None and \
            type(backend.decoder).__name__ == 'ByteLevel'
        tokens = self.tokenizer.convert_ids_to_tokens(
            list(range(self.vocab_size)))
        return [
            0 if i in special else len(token) if byte_level else len(
                self.decode([i]).encode('utf-8'))
            for i, token in enumerate(tokens)
        ]

    def save_pretrained(self, out_dir: str) -> None:
        """Write the tokenizer files into ``out_dir``."""
        self.tokenizer.save_pretrained(out_dir)


@TOKENIZERS.register_module(name='ShakespeareBPE')
def shakespeare_bpe() -> HFTokenizer:
    """The shipped byte-level BPE tokenizer of Tiny Shakespeare (512 ids)."""
    return HFTokenizer(str(SHAKESPEARE_BPE_DIR))


def train_shakespeare_bpe(text: str,
                          vocab_size: int = SHAKESPEARE_BPE_VOCAB):
    """How the shipped ``ShakespeareBPE`` was made: byte-level BPE (GPT-2's
    pre-tokenizer, every byte in the base alphabet, so any text encodes)
    trained on ``text``; deterministic. Returns a transformers fast
    tokenizer (``save_pretrained`` writes the shipped files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from mmpar.models.hf import import_transformers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer=trainer)
    return import_transformers().PreTrainedTokenizerFast(
        tokenizer_object=tokenizer)


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def build_tokenizer(cfg: Optional[Union[dict, Tokenizer]]) -> Tokenizer:
    """A tokenizer from its config (``None``: bytes); an object is kept.

    Raises:
        KeyError: an unknown ``type`` (MMEngine's registry names it).
    """
    if cfg is None:
        return ByteTokenizer()
    if isinstance(cfg, dict):
        return TOKENIZERS.build(cfg)
    return cfg


def lm_metainfo(tokenizer: Tokenizer, context_length: int) -> dict:
    """A language-model dataset's ``metainfo``: what the model and
    :class:`~mmpar.evaluation.LanguageModelMetric` read."""
    return dict(vocab_size=tokenizer.vocab_size,
                context_length=context_length,
                token_bytes=tokenizer.token_bytes())


def check_model_vocabulary(dataset, model, key: str) -> None:
    """The token ids a language-model ``dataset`` gives (its ``metainfo``'s
    ``vocab_size``) fit ``model``'s vocabulary (its ``hf_config``: Llama,
    HFCausalLM); anything else passes.

    Raises:
        ConfigError: naming ``key``, both sizes and what is allowed (an id
            past the embedding failed at the first batch, deep in torch).
    """
    ids = (getattr(dataset, 'metainfo', None) or {}).get('vocab_size')
    size = getattr(getattr(model, 'hf_config', None), 'vocab_size', None)
    if isinstance(ids, int) and isinstance(size, int) and ids > size:
        raise ConfigError(
            f'{key}.dataset: its tokenizer gives ids 0 to {ids - 1}, but the '
            f'model has vocab_size={size}; allowed: a model vocab_size of '
            f'at least {ids} (model.vocab_size, or model.config.vocab_size '
            'for a Hugging Face model), or a tokenizer of at most '
            f'{size} ids')
