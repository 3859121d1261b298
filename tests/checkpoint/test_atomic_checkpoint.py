"""Atomic checkpoint files and resuming from the newest complete one."""
import os

import pytest
import torch

from mmpar.checkpoint import (atomic_save,
                                     find_latest_complete_checkpoint,
                                     is_complete_checkpoint)
from tests.e2e import DEFAULT_CONFIG, load_ckpt, run_tool
from tests.trained import BATCH, SMALL_MODEL


def test_failed_save_leaves_previous_file_intact(tmp_path, monkeypatch):
    path = tmp_path / 'epoch_1.pth'
    atomic_save(dict(w=torch.ones(3)), str(path))

    def broken_save(obj, file, *args, **kwargs):
        file.write(b'PK partial')
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, 'save', broken_save)
    with pytest.raises(KeyboardInterrupt):
        atomic_save(dict(w=torch.zeros(3)), str(path))
    monkeypatch.undo()
    assert torch.equal(load_ckpt(path)['w'], torch.ones(3))
    assert os.listdir(tmp_path) == ['epoch_1.pth']


def test_latest_complete_skips_truncated_pointer_target(tmp_path):
    first, second = tmp_path / 'epoch_1.pth', tmp_path / 'epoch_2.pth'
    atomic_save(dict(w=torch.ones(3)), str(first))
    atomic_save(dict(w=torch.ones(3)), str(second))
    assert find_latest_complete_checkpoint(str(tmp_path)) == str(second)
    second.write_bytes(second.read_bytes()[:100])
    (tmp_path / 'last_checkpoint').write_text(str(second))
    assert not is_complete_checkpoint(str(second))
    assert find_latest_complete_checkpoint(str(tmp_path)) == str(first)
    assert find_latest_complete_checkpoint(str(tmp_path / 'empty')) is None


# The small ViT in batches of 256 (6 steps an epoch): what is tested is the
# save, not the training.
SMALL = [f'model.{k}={v}' for k, v in SMALL_MODEL.items()] + [
    f'train_dataloader.batch_size={BATCH}', 'train_cfg.max_epochs=3']


def test_kill_during_save_then_resume(tmp_path):
    killed = run_tool([
        'python', 'tools/train.py', 'tests/data/kill_during_save_cfg.py',
        '--work-dir', tmp_path, '--cfg-options', *SMALL
    ],
                      check=False)
    assert killed.returncode != 0
    assert not (tmp_path / 'epoch_2.pth').exists()
    assert (tmp_path / 'last_checkpoint').read_text().endswith('epoch_1.pth')
    assert is_complete_checkpoint(str(tmp_path / 'epoch_1.pth'))
    assert list(tmp_path.glob('epoch_2.pth.*.tmp'))  # the half-written file

    resumed = run_tool([
        'python', 'tools/train.py', DEFAULT_CONFIG, '--work-dir', tmp_path,
        '--resume', '--cfg-options', *SMALL
    ])
    assert 'resumed epoch: 1' in resumed.stdout + resumed.stderr
    assert load_ckpt(tmp_path / 'epoch_3.pth')['meta']['epoch'] == 3
