"""PackedTokenDataset (mmpar/datasets/packed.py): windows packed across
documents with the boundary targets masked, sources blended by weight, the
train/val cut, and each of 2 data ranks reading its own samples."""
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mmpar.datasets import PackedTokenDataset, write_token_shard
from mmpar.datasets.packed import blend_counts

DOCS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10, 11, 12]]


def _shard(tmp_path, name='s', docs=DOCS, vocab_size=256):
    write_token_shard(tmp_path / name, docs, vocab_size)
    return str(tmp_path / name)


def test_windows_pack_documents_and_mask_their_boundaries(tmp_path):
    data = PackedTokenDataset([_shard(tmp_path)], context_length=4,
                              document_attention=True)
    assert len(data) == 2  # (12 - 1) // 4 whole windows
    first, second = data[0], data[1]
    assert first['inputs'].tolist() == [1, 2, 3, 4]
    # 3 -> 4 crosses from document 0 to document 1: not counted.
    assert first['data_samples'].tolist() == [2, 3, -100, 5]
    assert first['doc_ids'].tolist() == [0, 0, 0, 1]
    assert second['inputs'].tolist() == [5, 6, 7, 8]
    assert second['data_samples'].tolist() == [-100, 7, 8, 9]
    assert second['doc_ids'].tolist() == [0, 1, 1, 1]
    assert all(v.dtype == torch.int64 for v in first.values())
    unmasked = PackedTokenDataset([_shard(tmp_path)], context_length=4,
                                  mask_boundaries=False)
    assert unmasked[0]['data_samples'].tolist() == [2, 3, 4, 5]
    assert 'doc_ids' not in unmasked[0]


def test_windows_span_shards_of_one_source(tmp_path):
    a = _shard(tmp_path, 'a', DOCS[:2])
    b = _shard(tmp_path, 'b', DOCS[2:])
    data = PackedTokenDataset([dict(shards=[a, b])], context_length=4)
    # The same stream as one shard: a shard's start is a document start.
    assert data[1]['inputs'].tolist() == [5, 6, 7, 8]
    assert data[1]['data_samples'].tolist() == [-100, 7, 8, 9]


def test_sources_blend_by_weight_deterministically(tmp_path):
    big = _shard(tmp_path, 'big', [[1] * 401])  # 100 windows of 4
    small = _shard(tmp_path, 'small', [[2] * 41])  # 10 windows
    sources = [dict(shards=big, weight=3), dict(shards=small, weight=1)]
    data = PackedTokenDataset(sources, context_length=4, num_windows=4000)
    firsts = [int(data[i]['inputs'][0]) for i in range(len(data))]
    assert Counter(firsts) == {1: 3000, 2: 1000}
    # The small source repeats its 10 windows; each is used as often.
    assert Counter(data.locate(i) for i in range(4000)
                   if data.locate(i)[0] == 1) == {
                       (1, w): 100 for w in range(10)}
    again = PackedTokenDataset(sources, context_length=4, num_windows=4000)
    assert all(data.locate(i) == again.locate(i) for i in range(4000))
    assert blend_counts([1, 1, 1], 1000) == [334, 333, 333]
    with pytest.raises(ValueError, match='must be >= 0'):
        blend_counts([1, -1], 10)


def test_every_prefix_of_a_blend_holds_the_weights_shares(tmp_path):
    big = _shard(tmp_path, 'big', [[1] * 401])  # 100 windows of 4
    small = _shard(tmp_path, 'small', [[2] * 41])  # 10 windows
    for weights in [(1, 1), (3, 1), (1, 3), (2, 5)]:
        sources = [dict(shards=big, weight=weights[0]),
                   dict(shards=small, weight=weights[1])]
        data = PackedTokenDataset(sources, context_length=4,
                                  num_windows=1500)
        share = weights[1] / sum(weights)
        small_so_far = 0
        for n in range(1, len(data) + 1):
            small_so_far += data.locate(n - 1)[0] == 1
            # Block-relative: the second block starts afresh.
            m = (n - 1) % 1000 + 1
            in_block = small_so_far - (n > 1000) * data.counts[1]
            assert abs(in_block - m * share) <= 1, (weights, n)


def test_unblended_val_reads_every_window_of_each_source_once(tmp_path):
    a = _shard(tmp_path, 'a', [[1] * 50] * 4)
    b = _shard(tmp_path, 'b', [[2] * 50] * 40)
    sources = [dict(shards=a, weight=3.0), dict(shards=b, weight=1.0)]
    val = PackedTokenDataset(sources, context_length=4, split='val',
                             train_fraction=0.5)
    assert len(val) == sum(val.source_windows)
    assert [val.locate(i) for i in range(len(val))] == [
        (s, w) for s, count in enumerate(val.source_windows)
        for w in range(count)]


def test_train_and_val_splits_cut_at_a_document_start(tmp_path):
    docs = [[d] * 10 for d in range(1, 11)]  # 100 tokens, 10 documents
    train = PackedTokenDataset([_shard(tmp_path, docs=docs)],
                               context_length=9, split='train')
    val = PackedTokenDataset([_shard(tmp_path, docs=docs)],
                             context_length=9, split='val')
    assert (train.streams[0].begin, train.streams[0].end) == (0, 90)
    assert (val.streams[0].begin, val.streams[0].end) == (90, 100)
    assert val[0]['inputs'].tolist() == [10] * 9
    assert {int(t) for i in range(len(train))
            for t in train[i]['inputs']} == set(range(1, 10))


def test_bad_options_name_themselves(tmp_path):
    shard = _shard(tmp_path)
    with pytest.raises(ValueError, match='not one window'):
        PackedTokenDataset([shard], context_length=12)
    with pytest.raises(ValueError, match='must name one of shards, files'):
        PackedTokenDataset([dict(weight=1)], context_length=4)
    with pytest.raises(ValueError, match="unknown keys \\['wieght'\\]"):
        PackedTokenDataset([dict(shards=shard, wieght=2)], context_length=4)
    with pytest.raises(ValueError, match='different vocabularies'):
        PackedTokenDataset([_shard(tmp_path, 'v', vocab_size=512)],
                           context_length=4)


def _samples_of_rank(prefix, count):
    from mmengine.dataset import InfiniteSampler
    data = PackedTokenDataset([prefix], context_length=8)
    sampler = iter(InfiniteSampler(data, shuffle=True, seed=3))
    indices = [next(sampler) for _ in range(count)]
    return dist.get_rank(), indices, [data[i]['inputs'].tolist()
                                      for i in indices]


def test_two_data_ranks_read_different_samples(run_dist, tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, n).tolist() for n in rng.integers(3, 40, 20)]
    prefix = _shard(tmp_path, docs=docs)
    data = PackedTokenDataset([prefix], context_length=8)
    results = run_dist(_samples_of_rank, prefix, len(data) // 2)
    seen = [i for _, indices, _ in results for i in indices]
    # Each window at most once over both ranks (an epoch's share each).
    assert len(set(seen)) == len(seen) == len(data) // 2 * 2
    for _, indices, inputs in results:
        # A rank reads what one process reads at those indices.
        assert inputs == [data[i]['inputs'].tolist() for i in indices]
