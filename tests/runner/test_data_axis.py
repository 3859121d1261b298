"""Data by data rank: with tp=2 at 4 gloo ranks (data axis [0, 2], [1, 3]),
MMEngine's samplers read by dp rank (tp peers get the same samples) and a
metric counts every sample once."""
import itertools

import pytest
from mmengine.evaluator import BaseMetric

from mmpar.failures import ConfigError
from mmpar.runner.data_axis import shard_sampler

DATASET_SIZE = 10


class _Sized:

    def __len__(self):
        return DATASET_SIZE


def _build_loader(sampler_type):
    from mmengine.runner import Runner as MMEngineRunner
    from torch.utils.data import Dataset

    from mmpar.parallel import init_parallelism
    from mmpar.runner.data_axis import shard_loader_by_data_rank

    class Numbers(Dataset):

        def __len__(self):
            return DATASET_SIZE

        def __getitem__(self, index):
            return index

    topology = init_parallelism(2)  # reset by the harness
    loader = MMEngineRunner.build_dataloader(
        dict(batch_size=2, num_workers=0, dataset=Numbers(),
             sampler=dict(type=sampler_type, shuffle=True)), seed=7)
    loader = shard_loader_by_data_rank(loader, topology)
    return topology, loader


def _samples_seen(sampler_type):
    topology, loader = _build_loader(sampler_type)
    if sampler_type == 'InfiniteSampler':
        indices = list(itertools.islice(iter(loader.sampler), 8))
    else:
        indices = list(loader.sampler)
    rank_kw = loader.worker_init_fn.keywords['rank']
    return topology.dp_rank, indices, rank_kw


@pytest.mark.parametrize('sampler_type', ['DefaultSampler', 'InfiniteSampler'])
def test_samplers_shard_by_data_rank(run_dist, sampler_type):
    results = run_dist(_samples_seen, sampler_type, world_size=4)
    # tp peers (0, 1) and (2, 3) read the same samples ...
    assert results[0][1] == results[1][1] and results[2][1] == results[3][1]
    # ... dp peers different ones, seeded by dp rank, not global rank.
    assert [r[0] for r in results] == [0, 0, 1, 1]
    assert [r[2] for r in results] == [0, 0, 1, 1]
    if sampler_type == 'DefaultSampler':
        # Together the two data ranks see the data set exactly once.
        assert sorted(results[0][1] + results[2][1]) == list(
            range(DATASET_SIZE))


class _CountMetric(BaseMetric):
    """Collects the sample ids it is shown; the metric is their number and
    sum."""

    def process(self, data_batch, data_samples):
        self.results.extend(data_samples)

    def compute_metrics(self, results):
        return dict(count=len(results), total=sum(results),
                    distinct=len(set(results)))


def _evaluate(use_data_axis):
    from mmengine.evaluator import Evaluator

    from mmpar.runner.data_axis import evaluate_metrics_on_data_axis
    topology, loader = _build_loader('DefaultSampler')
    evaluator = Evaluator(_CountMetric(prefix='ids'))
    if use_data_axis:
        evaluator = evaluate_metrics_on_data_axis(evaluator, topology)
    for batch in loader:
        ids = [int(i) for i in batch]
        evaluator.process(ids, ids)
    return evaluator.evaluate(DATASET_SIZE)


def test_metric_counts_every_sample_once(run_dist):
    expected = dict(count=DATASET_SIZE, total=sum(range(DATASET_SIZE)),
                    distinct=DATASET_SIZE)
    expected = {f'ids/{k}': v for k, v in expected.items()}
    for metrics in run_dist(_evaluate, True, world_size=4):
        assert metrics == expected
    # MMEngine's world-wide collection counts tp peers twice and truncates,
    # losing real samples: the bug this avoids.
    plain = run_dist(_evaluate, False, world_size=4)[0]
    assert plain['ids/distinct'] < DATASET_SIZE


def test_unknown_sampler_is_refused():
    from torch.utils.data import SequentialSampler
    with pytest.raises(ConfigError, match="type='SequentialSampler'"):
        shard_sampler(SequentialSampler(range(4)), 0, 2)


def test_default_sampler_arithmetic_matches_mmengine(monkeypatch):
    from mmengine.dataset import DefaultSampler
    from mmengine.dataset import sampler as mmengine_sampler
    for round_up in (True, False):
        for rank in range(3):
            monkeypatch.setattr(mmengine_sampler, 'get_dist_info',
                                lambda rank=rank: (rank, 3))
            built = DefaultSampler(_Sized(), seed=1, round_up=round_up)
            monkeypatch.setattr(mmengine_sampler, 'get_dist_info',
                                lambda: (0, 6))
            moved = DefaultSampler(_Sized(), seed=1, round_up=round_up)
            shard_sampler(moved, rank, 3)
            assert (moved.num_samples, moved.total_size, list(moved)) == \
                (built.num_samples, built.total_size, list(built))
