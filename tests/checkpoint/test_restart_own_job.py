"""A restarted torchrun attempt resumes only a checkpoint its own job wrote:
not a finished earlier run's in the same work dir, nor the newer one a
``--resume PATH`` rolled back from; without one it starts as the first
attempt did."""
import pytest

from tests.checkpoint.test_async_checkpoint import tiny_cfg


@pytest.mark.parametrize('rollback', [False, True])
def test_restart_ignores_checkpoints_older_than_its_job(
        tmp_path, monkeypatch, rollback):
    from mmpar.runner import Runner
    monkeypatch.delenv('TORCHELASTIC_RESTART_COUNT', raising=False)
    monkeypatch.delenv('TORCHELASTIC_RUN_ID', raising=False)
    Runner.from_cfg(tiny_cfg(tmp_path, 'old_run', 'full',
                             launcher='none')).train()  # iter_1, iter_2

    def new_job(name):
        # Killed before its first save: it saves nothing.
        cfg = tiny_cfg(tmp_path, name, 'full', launcher='none',
                       interval=100, save_last=False)
        if rollback:
            cfg.resume, cfg.load_from = True, str(tmp_path / 'iter_1.pth')
        return Runner.from_cfg(cfg)

    resumed = []
    original = Runner.resume

    def recorded(self, filename, *args, **kwargs):
        resumed.append(filename)
        return original(self, filename, *args, **kwargs)

    monkeypatch.setattr(Runner, 'resume', recorded)
    new_job('first_attempt').train()
    first = list(resumed)
    resumed.clear()
    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '1')
    new_job('restart').train()
    assert resumed == first  # what the first attempt did
    assert first == ([str(tmp_path / 'iter_1.pth')] if rollback else [])
