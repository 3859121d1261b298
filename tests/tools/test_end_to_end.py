"""The README's workflow on CPU: dist_train on 2 processes, dist_test,
resume, and bit-exact resume.

Every test reads the session's shared run (``default_two_rank_run``: 3
epochs of the default example by ``tools/dist_train.sh``, read-only) and
writes only into its own ``tmp_path``, so the tests pass in any order.
"""
import re

from tests.e2e import (DEFAULT_CONFIG, assert_same_training_state, load_ckpt,
                       run_tool)

EPOCHS = 'train_cfg.max_epochs={}'


def test_dist_train_writes_checkpoints_and_logs(default_two_rank_run):
    work_dir = default_two_rank_run
    for epoch in (1, 2, 3):
        assert (work_dir / f'epoch_{epoch}.pth').is_file()
    assert (work_dir / 'last_checkpoint').read_text().strip().endswith(
        'epoch_3.pth')
    ckpt = load_ckpt(work_dir / 'epoch_3.pth')
    # The plain model's keys: no 'module.' prefix from the DDP wrapper.
    assert all(not k.startswith('module.') for k in ckpt['state_dict'])
    logs = list(work_dir.glob('*/*.log'))
    assert len(logs) == 1  # one run wrote here: nothing else did
    assert 'accuracy/top1' in logs[0].read_text()
    assert 'eta:' in logs[0].read_text()


def test_dist_test_evaluates_checkpoint(default_two_rank_run, tmp_path):
    proc = run_tool([
        'bash', 'tools/dist_test.sh', DEFAULT_CONFIG,
        default_two_rank_run / 'epoch_2.pth', 2, '--work-dir',
        tmp_path / 'test'
    ])
    match = re.search(r'accuracy/top1: ([\d.]+)', proc.stdout + proc.stderr)
    assert match, proc.stdout[-2000:]
    # The same weights on the same 2-rank split: the accuracy validation
    # logged for epoch 2 during training, and above chance (10%).
    train_log = next(default_two_rank_run.glob('2*/*.log')).read_text()
    logged = re.search(r'Epoch\(val\) \[2\].*accuracy/top1: ([\d.]+)',
                       train_log)
    assert float(match.group(1)) == float(logged.group(1))
    assert float(match.group(1)) > 15


def test_resume_on_two_ranks_is_bit_exact(default_two_rank_run, tmp_path):
    """``--resume`` from the straight run's epoch 2 to epoch 3 on 2 ranks:
    the straight run's epoch 3, bit for bit."""
    resumed = tmp_path / 'resumed'
    proc = run_tool([
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 2, '--work-dir',
        resumed, '--resume', default_two_rank_run / 'epoch_2.pth',
        '--cfg-options', EPOCHS.format(3)
    ])
    assert 'resumed epoch: 2' in proc.stdout + proc.stderr
    assert not (resumed / 'epoch_2.pth').exists()  # not trained again
    assert_same_training_state(
        load_ckpt(resumed / 'epoch_3.pth'),
        load_ckpt(default_two_rank_run / 'epoch_3.pth'))

# `python tools/train.py CONFIG --resume` on one process is exercised by
# tests/checkpoint/test_atomic_checkpoint.py::test_kill_during_save_then_resume;
# `--resume` without a path (the newest checkpoint of the work dir) by
# tests/runner/test_plain_configs.py and tests/parallelize/test_pp_end_to_end.py.


def test_resume_two_rank_checkpoint_on_one_process(default_two_rank_run,
                                                   tmp_path):
    saved = load_ckpt(default_two_rank_run / 'epoch_2.pth')
    steps_at_save = [s['step'].item() for s in saved['optimizer']['state']
                     .values()]
    # A new interpreter, as a user's shell starts it (the other one-process
    # tool runs of the suite fork from tests/fork_server.py).
    run_tool([
        'python', 'tools/train.py', DEFAULT_CONFIG, '--work-dir', tmp_path,
        '--resume', default_two_rank_run / 'epoch_2.pth', '--cfg-options',
        EPOCHS.format(3)
    ], fresh=True)
    resumed = load_ckpt(tmp_path / 'epoch_3.pth')
    # One process sees the whole epoch: 1,437 images / 32 = 45 steps, on top
    # of the optimizer's state from the 2-rank run (not a fresh optimizer).
    steps = [s['step'].item() for s in resumed['optimizer']['state'].values()]
    assert steps == [s + 45 for s in steps_at_save]
    assert resumed['meta']['iter'] == saved['meta']['iter'] + 45
