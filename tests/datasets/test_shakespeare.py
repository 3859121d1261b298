"""The shipped corpus, the byte tokenizer and the window dataset."""
import hashlib

import pytest
import torch

from mmpar.datasets import ByteTokenizer, ShakespeareDataset, load_text
from mmpar.registry import DATASETS

SHA256 = '86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed'


def test_shipped_corpus_matches_its_provenance():
    text = load_text()
    assert hashlib.sha256(text.encode('utf-8')).hexdigest() == SHA256
    assert text.startswith('First Citizen:')


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode('ROMEO: é')
    assert max(ids) < tok.vocab_size and len(ids) == 9
    assert tok.decode(ids) == 'ROMEO: é'
    assert tok.decode([0xC3]) == '\ufffd'  # a cut multi-byte character


def test_split_is_disjoint_and_complete():
    n = len(load_text().encode('utf-8'))
    train = ShakespeareDataset('train', context_length=64)
    val = ShakespeareDataset('val', context_length=64)
    assert len(train.tokens) + len(val.tokens) == n
    assert len(train.tokens) == int(0.9 * n)
    assert len(val) == (len(val.tokens) - 65) // 64 + 1


def test_windows_are_shifted_targets():
    ds = DATASETS.build(dict(type='ShakespeareDataset', split='val',
                             context_length=32))
    item = ds[3]
    assert item['inputs'].dtype == torch.int64
    assert item['inputs'].shape == item['data_samples'].shape == (32, )
    torch.testing.assert_close(item['inputs'][1:], item['data_samples'][:-1])
    text = ByteTokenizer().decode(item['inputs'].tolist())
    assert text == load_text()[:][int(0.9 * 1115394) + 96:][:32]


def test_deterministic_random_windows():
    a = ShakespeareDataset(context_length=16, num_windows=50,
                           random_starts=True, seed=3)
    b = ShakespeareDataset(context_length=16, num_windows=50,
                           random_starts=True, seed=3)
    c = ShakespeareDataset(context_length=16, num_windows=50,
                           random_starts=True, seed=4)
    assert len(a) == 50
    assert torch.equal(a.starts, b.starts)
    assert not torch.equal(a.starts, c.starts)
    assert int(a.starts.max()) <= len(a.tokens) - 17


def test_num_windows_wraps_consecutive_windows():
    ds = ShakespeareDataset('val', context_length=64, num_windows=10000)
    assert len(ds) == 10000
    assert torch.equal(ds[0]['inputs'], ds[len(ShakespeareDataset(
        'val', context_length=64))]['inputs'])


@pytest.mark.parametrize('kwargs,match', [
    (dict(split='test'), "split='test'"),
    (dict(context_length=0), 'context_length=0'),
    (dict(split='val', context_length=10**7), 'context_length=10000000'),
    (dict(num_windows=0), 'num_windows=0'),
])
def test_bad_arguments_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShakespeareDataset(**kwargs)
