"""Tokens of one tokenizer are never read as another's: the token cache's
key and the shard header hold the tokenizer's digest
(mmpar/datasets/tokenizer.py, token_shards.py, text_files.py)."""
import shutil

import pytest

from mmpar.datasets import HFTokenizer, PackedTokenDataset, write_token_shard
from mmpar.datasets.shakespeare import load_text
from mmpar.datasets.text_files import write_documents
from mmpar.datasets.tokenizer import train_shakespeare_bpe
from mmpar.failures import ConfigError


def _train(directory, text):
    train_shakespeare_bpe(text).save_pretrained(str(directory))
    return str(directory)


def test_a_tokenizer_retrained_into_its_directory_tokenizes_again(tmp_path):
    text = load_text()[:200000]
    doc = tmp_path / 'doc.txt'
    doc.write_text(text[:2000])
    directory = _train(tmp_path / 'tok', text)
    sources = [dict(files=str(doc))]
    cfg = dict(type='HFTokenizer', path=directory)
    first = PackedTokenDataset(sources, context_length=16, tokenizer=cfg,
                               cache_dir=str(tmp_path / 'cache'))
    assert first[0]['inputs'].tolist() == \
        HFTokenizer(directory).encode(text[:2000])[:16]
    shutil.rmtree(directory)
    _train(directory, text[::-1])  # same directory and vocabulary size
    again = PackedTokenDataset(sources, context_length=16, tokenizer=cfg,
                               cache_dir=str(tmp_path / 'cache'))
    retrained = HFTokenizer(directory)
    assert retrained.vocab_size == first.tokenizer.vocab_size
    assert again[0]['inputs'].tolist() == \
        retrained.encode(text[:2000])[:16]


def test_a_shard_of_another_tokenizer_is_refused(tmp_path):
    text = load_text()[:200000]
    mine = HFTokenizer(_train(tmp_path / 'mine', text[::-1]))
    (tmp_path / 'doc.txt').write_text(text[:2000])
    prefix = str(tmp_path / 'shard')
    write_documents(prefix, [tmp_path / 'doc.txt'], mine)
    # Same vocabulary size (512) as the shipped ShakespeareBPE.
    with pytest.raises(ConfigError, match="tokenizer: token shard .* "
                       "written by tokenizer '.*mine' .*the config's "
                       "tokenizer is '.*shakespeare_bpe'"):
        PackedTokenDataset([prefix], context_length=16,
                           tokenizer=dict(type='ShakespeareBPE'))
    loaded = PackedTokenDataset([prefix], context_length=16, tokenizer=mine)
    assert mine.decode(loaded[0]['inputs'].tolist()) == \
        mine.decode(mine.encode(text[:2000])[:16])
    # The same files elsewhere are the same tokenizer (digest, not path).
    moved = HFTokenizer(shutil.copytree(mine.path, tmp_path / 'moved'))
    PackedTokenDataset([prefix], context_length=16, tokenizer=moved)


def test_shards_without_a_digest_load_as_before(tmp_path):
    """A shard written before the digest was recorded is not checked: its
    tokenizer name is an absolute path, which a moved checkout changes."""
    docs = [list(range(40))]
    for name in ('bytes', None, '/some/moved/tokenizer'):
        old = str(tmp_path / f'old{len(name or "")}')
        write_token_shard(old, docs, 256, *([name] if name else []))
        PackedTokenDataset([old], context_length=8)


class _UsersTokenizer:
    """A tokenizer of a user's, written before ``digest`` existed."""
    name, vocab_size = 'users', 256

    def encode(self, text):
        return list(text.encode())


def test_a_users_tokenizer_without_a_digest_still_works(tmp_path):
    from mmpar.datasets.token_shards import check_shard_tokenizer, open_shards
    from mmpar.datasets.text_files import cache_key
    prefix = str(tmp_path / 'shard')
    write_token_shard(prefix, [list(range(40))], 256, 'x',
                      tokenizer_digest='abc')
    check_shard_tokenizer(open_shards([prefix])[0], _UsersTokenizer())
    assert cache_key([], _UsersTokenizer())
