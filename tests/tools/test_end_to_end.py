"""The README's workflow on CPU: dist_train on 2 processes, dist_test,
resume, and bit-exact resume."""
import re

import pytest

from tests.e2e import (DEFAULT_CONFIG, assert_same_training_state, load_ckpt,
                       run_tool)

EPOCHS = 'train_cfg.max_epochs={}'


@pytest.fixture(scope='module')
def two_epochs_on_two_ranks(tmp_path_factory):
    work_dir = tmp_path_factory.mktemp('ddp_2ep')
    run_tool([
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 2, '--work-dir',
        work_dir, '--cfg-options',
        EPOCHS.format(2)
    ])
    return work_dir


def test_dist_train_writes_checkpoints_and_logs(two_epochs_on_two_ranks):
    work_dir = two_epochs_on_two_ranks
    assert (work_dir / 'epoch_2.pth').is_file()
    assert (work_dir / 'last_checkpoint').read_text().strip().endswith(
        'epoch_2.pth')
    ckpt = load_ckpt(work_dir / 'epoch_2.pth')
    # The plain model's keys: no 'module.' prefix from the DDP wrapper.
    assert all(not k.startswith('module.') for k in ckpt['state_dict'])
    logs = list(work_dir.glob('*/*.log'))
    assert logs and 'accuracy/top1' in logs[0].read_text()
    assert 'eta:' in logs[0].read_text()


def test_dist_test_evaluates_checkpoint(two_epochs_on_two_ranks):
    proc = run_tool([
        'bash', 'tools/dist_test.sh', DEFAULT_CONFIG,
        two_epochs_on_two_ranks / 'epoch_2.pth', 2, '--work-dir',
        two_epochs_on_two_ranks / 'test'
    ])
    match = re.search(r'accuracy/top1: ([\d.]+)', proc.stdout + proc.stderr)
    assert match, proc.stdout[-2000:]
    # The same weights on the same 2-rank split: the accuracy validation
    # logged for epoch 2 during training, and above chance (10%).
    train_log = next(two_epochs_on_two_ranks.glob('2*/*.log')).read_text()
    logged = re.search(r'Epoch\(val\) \[2\].*accuracy/top1: ([\d.]+)',
                       train_log)
    assert float(match.group(1)) == float(logged.group(1))
    assert float(match.group(1)) > 15


def test_resume_on_two_ranks_is_bit_exact(two_epochs_on_two_ranks,
                                          tmp_path):
    straight = tmp_path / 'straight'
    run_tool([
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 2, '--work-dir',
        straight, '--cfg-options',
        EPOCHS.format(3)
    ])
    resumed = two_epochs_on_two_ranks
    run_tool([
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 2, '--work-dir',
        resumed, '--resume', '--cfg-options',
        EPOCHS.format(3)
    ])
    assert_same_training_state(
        load_ckpt(resumed / 'epoch_3.pth'), load_ckpt(straight / 'epoch_3.pth'))

# `python tools/train.py CONFIG --resume` on one process is exercised by
# tests/checkpoint/test_atomic_checkpoint.py::test_kill_during_save_then_resume.


def test_resume_two_rank_checkpoint_on_one_process(two_epochs_on_two_ranks,
                                                   tmp_path):
    saved = load_ckpt(two_epochs_on_two_ranks / 'epoch_2.pth')
    steps_at_save = [s['step'].item() for s in saved['optimizer']['state']
                     .values()]
    run_tool([
        'python', 'tools/train.py', DEFAULT_CONFIG, '--work-dir', tmp_path,
        '--resume', two_epochs_on_two_ranks / 'epoch_2.pth', '--cfg-options',
        EPOCHS.format(3)
    ])
    resumed = load_ckpt(tmp_path / 'epoch_3.pth')
    # One process sees the whole epoch: 1,437 images / 32 = 45 steps, on top
    # of the optimizer's state from the 2-rank run (not a fresh optimizer).
    steps = [s['step'].item() for s in resumed['optimizer']['state'].values()]
    assert steps == [s + 45 for s in steps_at_save]
    assert resumed['meta']['iter'] == saved['meta']['iter'] + 45
