"""``max_keep_ckpts`` removes the oldest checkpoint only once the new one is
complete and ``last_checkpoint`` names it: while the new one is written, the
previous one is still there (a kill then resumes from it), sync and async."""
import os.path as osp

import pytest

from tests.checkpoint.test_async_checkpoint import tiny_cfg


@pytest.mark.parametrize('async_save', [False, True])
def test_previous_checkpoint_survives_until_the_new_one_is_published(
        tmp_path, monkeypatch, async_save):
    import mmpar.runner.runner as runner_module
    from mmpar.runner import Runner
    original = runner_module.ckpt.atomic_save
    seen = {}

    def watched_write(checkpoint, path):
        # What a kill during this write would leave behind.
        pointer = tmp_path / 'last_checkpoint'
        seen[osp.basename(path)] = (
            sorted(p.name for p in tmp_path.glob('iter_*.pth')),
            pointer.read_text() if pointer.exists() else None)
        original(checkpoint, path)

    monkeypatch.setattr(runner_module.ckpt, 'atomic_save', watched_write)
    cfg = tiny_cfg(tmp_path, f'keep1_{async_save}', 'full', launcher='none',
                   iters=3, max_keep_ckpts=1, async_save=async_save)
    runner = Runner.from_cfg(cfg)
    runner.train()
    for step in (2, 3):
        assert seen[f'iter_{step}.pth'] == (
            [f'iter_{step - 1}.pth'], str(tmp_path / f'iter_{step - 1}.pth'))
    # MMEngine's bookkeeping: only the newest is kept, and named.
    assert sorted(p.name for p in tmp_path.glob('iter_*.pth')) == \
        ['iter_3.pth']
    assert (tmp_path / 'last_checkpoint').read_text() == \
        str(tmp_path / 'iter_3.pth')
    assert list(runner.message_hub.get_info('keep_ckpt_ids')) == [3]
