"""A checkpoint of MMEngine's own Runner (it pickles the message hub's
``HistoryBuffer``) is named as such, not as corrupt, with the conversion a
user who trusts it runs once (docs/mmengine_users.md); the converted copy
loads as plain data."""
import datetime
import os
import re
import subprocess

import pytest
import torch
from mmengine.logging import HistoryBuffer

from mmpar.checkpoint import (CheckpointLoadError, from_plain,
                              load_checkpoint_file)
from tests.e2e import ROOT


def _mmengine_checkpoint(path) -> dict:
    """What MMEngine's ``Runner.save_checkpoint`` writes, in small."""
    checkpoint = dict(
        meta=dict(epoch=1, iter=4, mmengine_version='0.10.7'),
        state_dict=dict(weight=torch.arange(6.).reshape(2, 3)),
        message_hub=dict(
            log_scalars={'train/loss': HistoryBuffer([0.5, 0.25], [1, 1])},
            runtime_info=dict(epoch=1), resumed_keys=dict(epoch=True)))
    torch.save(checkpoint, path)
    return checkpoint


def test_mmengine_checkpoint_is_named_and_converts(tmp_path):
    written = _mmengine_checkpoint(tmp_path / 'epoch_1.pth')
    with pytest.raises(CheckpointLoadError) as info:
        load_checkpoint_file(str(tmp_path / 'epoch_1.pth'))
    message = str(info.value)
    assert "written by MMEngine's Runner" in message
    assert 'mmengine.logging.history_buffer.HistoryBuffer' in message
    assert 'corrupt' not in message and 'earlier checkpoint' not in message
    # The command the docs give (the message: for this path), run as a
    # user would.
    command, = re.findall(r'^python -c ".*to_plain.*"$', (
        ROOT / 'docs/mmengine_users.md').read_text(), re.MULTILINE)
    assert command.replace("'epoch_1", f"'{tmp_path}/epoch_1") in message
    subprocess.run(command, shell=True, cwd=tmp_path, check=True,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    plain = load_checkpoint_file(str(tmp_path / 'epoch_1_plain.pth'))
    torch.testing.assert_close(plain['state_dict']['weight'],
                               written['state_dict']['weight'])
    assert plain['meta'] == written['meta']
    buffer = from_plain(plain['message_hub'])['log_scalars']['train/loss']
    assert isinstance(buffer, HistoryBuffer)
    assert buffer.data[0].tolist() == [0.5, 0.25]


def test_other_refused_objects_keep_the_plain_data_message(tmp_path):
    path = tmp_path / 'epoch_2.pth'
    torch.save(dict(meta=dict(time=datetime.date(2024, 1, 1))), path)
    with pytest.raises(CheckpointLoadError) as info:
        load_checkpoint_file(str(path))
    assert 'not a plain-data checkpoint' in str(info.value)
    assert 'MMEngine' not in str(info.value)
