"""Checkpoints are plain data: weights_only=True loads, clear errors."""
import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub

from mmpar.runner.checkpoint import (CheckpointLoadError, from_plain,
                                     load_checkpoint_file, to_plain)


def _message_hub_state():
    hub = MessageHub(name='mmpar-test-hub')
    for value in (0.5, 0.25, 0.125):
        hub.update_scalar('train/loss', value)
    hub.update_info('epoch', 3)
    hub.update_info('dataset_meta', dict(classes=np.array(['a', 'b'])))
    return hub.state_dict()


def test_message_hub_round_trips_through_weights_only_load(tmp_path):
    state = _message_hub_state()
    path = tmp_path / 'ckpt.pth'
    torch.save(dict(message_hub=to_plain(state), w=torch.ones(2)), path)
    loaded = load_checkpoint_file(str(path))
    hub_state = from_plain(loaded['message_hub'])
    buffer = hub_state['log_scalars']['train/loss']
    assert isinstance(buffer, HistoryBuffer)
    np.testing.assert_allclose(buffer.data[0], [0.5, 0.25, 0.125])
    assert hub_state['runtime_info']['epoch'] == 3
    restored = MessageHub(name='mmpar-test-hub-2')
    restored.load_state_dict(hub_state)
    assert restored.get_scalar('train/loss').current() == 0.125


def test_mmengine_state_needs_the_conversion(tmp_path):
    path = tmp_path / 'raw.pth'
    torch.save(dict(message_hub=_message_hub_state()), path)
    with pytest.raises(CheckpointLoadError, match='raw.pth'):
        load_checkpoint_file(str(path))


def test_truncated_checkpoint_names_file_and_suggests_previous(tmp_path):
    path = tmp_path / 'epoch_3.pth'
    torch.save(dict(state_dict=dict(w=torch.randn(1000))), path)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(CheckpointLoadError) as info:
        load_checkpoint_file(str(path))
    assert 'epoch_3.pth' in str(info.value)
    assert 'earlier checkpoint' in str(info.value)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        load_checkpoint_file(str(tmp_path / 'nope.pth'))
