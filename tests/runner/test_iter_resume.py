"""Iteration-based resume: restore the sampler position, never replay."""
import itertools

import pytest

from mmpar.runner.loops import SkippableInfiniteSampler
from tests.e2e import ROOT, assert_same_training_state, load_ckpt, run_tool

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
    iteration-40 checkpoint in another work dir: the same iteration 60. With
    dropout: the resumed run's random draws go on where the saved run's
    stood (making the data iterator again draws nothing)."""
    opts = ['train_cfg.max_iters=60', 'train_cfg.val_interval=30',
            'default_hooks.checkpoint.interval=20', 'model.dropout=0.1']
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


EPOCH_CONFIG = f'''_base_ = ['{ROOT / 'configs/vit_digits/vit_digits.py'}']
custom_imports = dict(imports=['tests.sample_recording'],
                      allow_failed_imports=False)
model = dict(dropout=0.1, depth=1, embed_dim=16, num_heads=2)
train_dataloader = dict(batch_size=8, dataset=dict(
    type='RecordedDigits', num_samples=48, split='train'))
train_cfg = dict(by_epoch=True, max_epochs=2, val_interval=1000)
val_dataloader = val_cfg = val_evaluator = None
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=3,
                                     max_keep_ckpts=-1))
'''


def test_mid_epoch_resume_with_dropout_is_bit_exact(tmp_path):
    """Two epochs of 6 iterations straight, checkpoints every 3; resumed
    from the one in the middle of epoch 1: the same iteration 12."""
    config = tmp_path / 'epochs.py'
    config.write_text(EPOCH_CONFIG)
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    run_tool(['python', 'tools/train.py', config, '--work-dir', straight])
    run_tool(['python', 'tools/train.py', config, '--work-dir', resumed,
              '--resume', straight / 'iter_3.pth'])
    assert_same_training_state(load_ckpt(resumed / 'iter_12.pth'),
                               load_ckpt(straight / 'iter_12.pth'))
