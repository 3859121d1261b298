"""Iteration-based resume: restore the sampler position, never replay."""
import itertools

import pytest

from mmpar.runner.loops import SkippableInfiniteSampler
from tests.e2e import assert_same_training_state, load_ckpt, run_tool

ITER_CONFIG = 'configs/vit_digits/vit_digits_iter.py'


class _Sized:

    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size


@pytest.mark.parametrize('shuffle', [True, False])
@pytest.mark.parametrize('skip', [0, 1, 6, 7, 13, 40])
def test_skipped_stream_continues_the_unskipped_one(shuffle, skip,
                                                   monkeypatch):
    from mmengine.dataset import sampler as mmengine_sampler
    for rank in range(2):
        monkeypatch.setattr(mmengine_sampler, 'get_dist_info',
                            lambda rank=rank: (rank, 2))
        kwargs = dict(dataset=_Sized(13), shuffle=shuffle, seed=3)
        full = SkippableInfiniteSampler(**kwargs)
        skipped = SkippableInfiniteSampler(**kwargs)
        assert (skipped.rank, skipped.world_size) == (rank, 2)
        skipped.skip(skip)
        expected = list(itertools.islice(iter(full), skip, skip + 30))
        assert list(itertools.islice(iter(skipped), 30)) == expected


def test_iter_based_resume_is_bit_exact_without_replay(tmp_path):
    """60 iterations straight (checkpoints at 20, 40, 60); resumed from its
    iteration-40 checkpoint in another work dir: the same iteration 60."""
    opts = ['train_cfg.max_iters=60', 'train_cfg.val_interval=30',
            'default_hooks.checkpoint.interval=20']
    straight = tmp_path / 'straight'
    run_tool(['python', 'tools/train.py', ITER_CONFIG, '--work-dir', straight,
              '--cfg-options'] + opts)
    resumed = tmp_path / 'resumed'
    proc = run_tool(['python', 'tools/train.py', ITER_CONFIG, '--work-dir',
                     resumed, '--resume', straight / 'iter_40.pth',
                     '--cfg-options'] + opts)
    log = proc.stdout + proc.stderr
    assert 'resumed epoch: 0, iter: 40' in log
    assert not (resumed / 'iter_40.pth').exists()  # not trained again
    assert 'replayed' not in log and 'Advance dataloader' in log
    assert_same_training_state(
        load_ckpt(resumed / 'iter_60.pth'), load_ckpt(straight / 'iter_60.pth'))
