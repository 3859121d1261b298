"""A restarted torchrun attempt resumes by itself from the newest checkpoint
that loads, skipping a corrupt newest one, and ends bit-identical."""
import shutil
import zipfile

from mmpar.checkpoint.latest import complete_checkpoints, mark_job_start
from mmpar.dist import restart_attempt
from tests.checkpoint.test_async_checkpoint import tiny_cfg
from tests.e2e import assert_same_training_state, load_ckpt


def test_restart_attempt_reads_torchrun(monkeypatch):
    monkeypatch.delenv('TORCHELASTIC_RESTART_COUNT', raising=False)
    assert restart_attempt() == 0
    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '2')
    assert restart_attempt() == 2


def test_truncated_checkpoint_is_skipped_with_a_warning(tmp_path):
    good, cut = tmp_path / 'iter_1.pth', tmp_path / 'iter_2.pth'
    with zipfile.ZipFile(good, 'w') as archive:
        archive.writestr('iter_1/data.pkl', b'x')
    cut.write_bytes(good.read_bytes()[:20])
    warnings = []
    assert complete_checkpoints(str(tmp_path), warnings.append) == [str(good)]
    assert 'iter_2.pth' in warnings[0] and 'truncated' in warnings[0]


def test_restart_skips_corrupt_newest_and_ends_bit_identical(
        tmp_path, monkeypatch):
    from mmpar.runner import Runner
    monkeypatch.delenv('TORCHELASTIC_RESTART_COUNT', raising=False)
    first = tmp_path / 'first'
    Runner.from_cfg(tiny_cfg(first, 'restart_first', 'full',
                             launcher='none')).train()
    straight = load_ckpt(first / 'iter_2.pth')
    # The newest checkpoint: a whole zip archive whose pickle is garbage
    # (it passes the cheap completeness check, fails to load).
    work = tmp_path / 'work'
    work.mkdir()
    mark_job_start(str(work))  # the first attempt; its saves come after
    shutil.copy(first / 'iter_1.pth', work / 'iter_1.pth')
    with zipfile.ZipFile(work / 'iter_2.pth', 'w') as archive:
        archive.writestr('iter_2/data.pkl', b'not a pickle')
    (work / 'last_checkpoint').write_text(str(work / 'iter_2.pth'))

    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '1')  # no resume=True
    runner = Runner.from_cfg(tiny_cfg(work, 'restart_second', 'full',
                                      launcher='none'))
    runner.train()
    log = next(work.glob('*/*.log')).read_text()
    assert 'cannot load checkpoint' in log and 'iter_2.pth' in log
    assert f'Restart resumed from the latest checkpoint {work}/iter_1.pth' \
        in log
    assert_same_training_state(load_ckpt(work / 'iter_2.pth'), straight)
