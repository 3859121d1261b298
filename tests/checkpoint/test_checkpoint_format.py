"""Checkpoints are plain data: weights_only=True loads, clear errors."""
import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub

from mmpar.checkpoint import (CheckpointLoadError, from_plain,
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


def test_a_checkpoint_truncated_anywhere_is_named(tmp_path):
    # Cut early, the memory-mapped load failed with a bare OSError (Errno
    # 22) from deep in torch instead of naming the file.
    path = tmp_path / 'iter_12.pth'
    torch.save(dict(state_dict=dict(w=torch.randn(100000))), path)
    whole = path.read_bytes()
    for twentieths in range(1, 20):
        path.write_bytes(whole[:len(whole) * twentieths // 20])
        with pytest.raises(CheckpointLoadError, match='iter_12.pth'):
            load_checkpoint_file(str(path))


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        load_checkpoint_file(str(tmp_path / 'nope.pth'))


def _draws():
    import random
    return (random.random(), np.random.rand(), torch.rand(1).item())


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    from mmpar.checkpoint import all_rng_states, set_rng_state
    torch.manual_seed(3)
    np.random.seed(3)
    states = all_rng_states()
    expected = _draws()
    path = tmp_path / 'rng.pth'
    torch.save(to_plain(dict(rng_states=states)), path)
    _draws()  # move every generator on
    set_rng_state(load_checkpoint_file(str(path))['rng_states'][0])
    assert _draws() == expected


def _gathered_rng_states():
    import torch.distributed as dist

    from mmpar.checkpoint import all_rng_states
    torch.manual_seed(100 + dist.get_rank())
    states = all_rng_states()
    own = torch.get_rng_state()
    return [torch.equal(s['torch'], own) for s in states]


def test_every_rank_state_is_gathered(run_dist):
    # Rank r finds its own state at index r, and not the other rank's.
    assert run_dist(_gathered_rng_states) == [[True, False], [False, True]]
