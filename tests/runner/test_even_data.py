"""The start-up check that every data rank gets the same number of batches
(mmpar/runner/even_data.py), against real samplers and loaders; the matrix
of runs that end without a hang is in tests/test_no_hangs.py."""
import pytest
from torch.utils.data import DataLoader

from mmpar.failures import ConfigError
from mmpar.runner.even_data import batches_per_rank, check_even_work
from mmpar.runner.loops import (SkippableDefaultSampler,
                                SkippableInfiniteSampler)


class _Numbers:

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return index


def _loaders(size, world_size, batch_size, drop_last, monkeypatch,
             sampler_cls=SkippableDefaultSampler, **sampler_kwargs):
    from mmengine.dataset import sampler as mmengine_sampler
    loaders = []
    for rank in range(world_size):
        monkeypatch.setattr(mmengine_sampler, 'get_dist_info',
                            lambda rank=rank: (rank, world_size))
        sampler = sampler_cls(_Numbers(size), seed=0, **sampler_kwargs)
        loaders.append(DataLoader(_Numbers(size), batch_size=batch_size,
                                  sampler=sampler, drop_last=drop_last))
    return loaders


@pytest.mark.parametrize('size', [1, 3, 5, 8])
@pytest.mark.parametrize('round_up', [True, False])
@pytest.mark.parametrize('drop_last', [True, False])
@pytest.mark.parametrize('world_size', [2, 4])
def test_batches_per_rank_is_what_each_rank_iterates(size, round_up,
                                                    drop_last, world_size,
                                                    monkeypatch):
    loaders = _loaders(size, world_size, 2, drop_last, monkeypatch,
                       round_up=round_up)
    iterated = [len(list(loader)) for loader in loaders]
    for loader in loaders:
        assert batches_per_rank(loader) == iterated


def test_uneven_train_epoch_is_refused_naming_the_key(monkeypatch):
    loader = _loaders(5, 2, 2, False, monkeypatch, round_up=False)[0]
    check_even_work(loader, 'val_dataloader', every_rank_steps=False,
                    same_count=False)  # replicas evaluate any split
    with pytest.raises(ConfigError) as err:
        check_even_work(loader, 'train_dataloader', every_rank_steps=False,
                        same_count=True)
    assert str(err.value).startswith(
        'train_dataloader: 5 samples on 2 data ranks with '
        'train_dataloader.batch_size=2, drop_last=False, sampler '
        'round_up=False give the data ranks 2, 1 batches')
    assert 'Allowed: train_dataloader.sampler.round_up=True' in str(err.value)
    # round_up (the default) evens them out.
    check_even_work(_loaders(5, 2, 2, False, monkeypatch)[0],
                    'train_dataloader', every_rank_steps=True,
                    same_count=True)


def test_a_rank_without_a_batch_is_refused_for_iteration_training(
        monkeypatch):
    loader = _loaders(1, 2, 2, False, monkeypatch, round_up=False)[0]
    with pytest.raises(ConfigError, match='1, 0 batches: a rank without a '
                       'batch cannot train'):
        check_even_work(loader, 'train_dataloader', every_rank_steps=True,
                        same_count=False)
    infinite = _loaders(1, 2, 2, False, monkeypatch,
                        sampler_cls=SkippableInfiniteSampler)[0]
    check_even_work(infinite, 'train_dataloader', every_rank_steps=True,
                    same_count=False)
    empty = _loaders(0, 2, 2, False, monkeypatch,
                     sampler_cls=SkippableInfiniteSampler)[0]
    with pytest.raises(ConfigError, match='0, 0 batches'):
        check_even_work(empty, 'train_dataloader', every_rank_steps=True,
                        same_count=False)
