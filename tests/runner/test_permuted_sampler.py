"""PermutedInfiniteSampler (mmpar/runner/permuted_sampler.py): each epoch a
seeded permutation computed per index (no list), data ranks interleaved as
InfiniteSampler's, a skip (resume) at the exact sample on another number of
data ranks, and constant memory on a billion indices."""
import itertools
import tracemalloc

from mmpar.registry import DATA_SAMPLERS
from mmpar.runner.data_axis import shard_sampler
from mmpar.runner.permuted_sampler import FeistelPermutation


def _sampler(size, rank=0, world_size=1, skip=0, seed=3):
    sampler = DATA_SAMPLERS.build(
        dict(type='PermutedInfiniteSampler', dataset=range(size), seed=seed))
    shard_sampler(sampler, rank, world_size)  # as mmpar does per data rank
    if skip:
        sampler.skip(skip)
    return sampler


def _take(sampler, count):
    return list(itertools.islice(iter(sampler), count))


def test_every_epoch_is_a_permutation_of_its_own():
    for size in (1, 2, 7, 100, 4097):
        order = [FeistelPermutation(size, 5)(i) for i in range(size)]
        assert sorted(order) == list(range(size))
    assert [FeistelPermutation(100, k)(0) for k in range(10)] != [
        FeistelPermutation(100, 0)(0)] * 10
    # Two data ranks interleave one global stream: epoch after epoch, each
    # a permutation of 10, no two the same.
    ranks = [_take(_sampler(10, r, 2), 15) for r in range(2)]
    stream = [i for pair in zip(*ranks) for i in pair]
    epochs = [stream[e * 10:(e + 1) * 10] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3
    assert stream == _take(_sampler(10), 30)  # the layout's stream
    assert _take(_sampler(10, seed=4), 10) != epochs[0]


def test_skip_resumes_at_the_sample_on_another_layout():
    straight = _take(_sampler(10), 40)
    # 3 data ranks that read 7 samples each (21 global) go on as 1 rank.
    assert _take(_sampler(10, skip=21), 19) == straight[21:]
    # 1 rank that read 14 goes on as 2 ranks of 7 each.
    ranks = [_take(_sampler(10, r, 2, skip=7), 8) for r in range(2)]
    assert [i for pair in zip(*ranks) for i in pair] == straight[14:30]


def test_a_billion_indices_cost_no_memory():
    tracemalloc.start()
    sampler = _sampler(10**9, 1, 4, skip=123_456_789)
    drawn = _take(sampler, 1000)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert len(set(drawn)) == 1000 and max(drawn) < 10**9
