"""A rank that raises or hangs ends the whole job, loudly and once.

Each test injects a fault on rank 1 of a 2-process ``tools/dist_train.sh``
run (tests/fault_injection.py, loaded through ``custom_imports``). A job that
hung would hit the subprocess timeout and fail the test.
"""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.e2e import DEFAULT_CONFIG, ROOT, tool_env

# Far above a healthy run (~10-30 s here); reaching it means the job hung.
JOB_TIMEOUT_S = 180
FAULTS = {
    # where: config lines that inject it
    'hook': "custom_hooks = [dict(type='RaiseInHook', rank=1, at_iter=3)]",
    'forward': "model = dict(type='FaultyViT', fault_rank=1, fault_at=3)",
    'data': ("train_dataloader = dict(dataset=dict(type='FaultyDigits', "
             'fault_rank=1, fault_at=70))'),
}


def write_config(path, *lines) -> str:
    """A config on top of the default example with the given lines."""
    path.write_text('\n'.join([
        f"_base_ = '{ROOT / DEFAULT_CONFIG}'",
        "custom_imports = dict(imports=['tests.fault_injection'], "
        'allow_failed_imports=False)',
        'train_cfg = dict(max_epochs=1)',
    ] + list(lines)) + '\n')
    return str(path)


def dist_train(config, work_dir) -> subprocess.CompletedProcess:
    """``dist_train.sh`` on 2 processes; a hung job fails the test and is
    killed with all its workers (its own session), leaving no orphans."""
    args = ['bash', 'tools/dist_train.sh', config, '2', '--work-dir',
            str(work_dir)]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f'the job hung: still running after {JOB_TIMEOUT_S} s\n'
                    f'{err[-3000:]}')
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.parametrize('where', sorted(FAULTS))
def test_raising_rank_ends_job_with_one_traceback(where, tmp_path):
    config = write_config(tmp_path / 'cfg.py', FAULTS[where])
    # Forked ranks (tests/fork_server.py) exit at once, without the ~1 s of
    # interpreter teardown a real rank has: what keeps the surviving rank's
    # failure out of the failing rank's second (torchrun names the earliest
    # whole second, the lower rank on a tie) is mmpar's own delay
    # (failures.PEER_FAILURE_EXIT_DELAY_S), tested below.
    proc = dist_train(config, tmp_path / 'work')
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    # The failing rank's traceback, once: its raising line appears once.
    assert output.count('raise InjectedFault') == 1, output[-6000:]
    assert 'rank 1 failed:' in output
    # torchrun's summary names the injected fault as the root cause.
    root_cause = output[output.index('Root Cause'):]
    assert 'rank      : 1' in root_cause
    assert f'InjectedFault: {where} fault on rank 1' in root_cause
    # No second traceback from the surviving rank (it prints one line, if
    # torchrun has not stopped it first): rank 1's and torchrun's own.
    assert output.count('Traceback (most recent call last)') == 2


def test_a_rank_stopped_by_a_peer_exits_later_and_records_nothing(
        tmp_path, monkeypatch):
    """The failing rank records its failure (with its second) for torchrun;
    a rank that only lost its peer records nothing and exits more than a
    second later, so torchrun cannot name it root cause on a tie."""
    from mmpar.failures import fail_fast
    error_file = tmp_path / 'error.json'
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(error_file))
    with pytest.raises(SystemExit):
        with fail_fast():
            raise ValueError('the injected failure')
    recorded = json.loads(error_file.read_text())['message']
    assert recorded['message'] == 'ValueError: the injected failure'
    failed_at = int(recorded['extraInfo']['timestamp'])
    error_file.unlink()
    with pytest.raises(SystemExit):
        with fail_fast():
            raise RuntimeError('[../gloo/transport/tcp/pair.cc:534] '
                               'Connection closed by peer [127.0.0.1]:4242')
    assert int(time.time()) > failed_at
    assert not error_file.exists()


def test_hanging_rank_ends_job_after_collective_timeout(tmp_path):
    config = write_config(
        tmp_path / 'cfg.py',
        "custom_hooks = [dict(type='HangInHook', rank=1, at_iter=3)]",
        'env_cfg = dict(dist_cfg=dict(timeout=5))')
    proc = dist_train(config, tmp_path / 'work')
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert 'rank 0 failed (a collective timed out after ' \
        'env_cfg.dist_cfg.timeout' in output, output[-4000:]
    assert 'Timed out waiting 5000ms' in output[output.index('Root Cause'):]


def _group_timeouts():
    import torch
    import torch.distributed as dist

    from mmpar.dist import collective_timeout
    from mmpar.parallel import init_parallelism, reset_parallelism
    reset_parallelism()
    topology = init_parallelism()
    cpu = torch.device('cpu')
    try:
        return collective_timeout(), [
            info.group._get_backend(cpu).options._timeout
            for info in (topology.mp, topology.pp, topology.dp)
        ], dist.group.WORLD._get_backend(cpu).options._timeout
    finally:
        reset_parallelism()


def test_topology_groups_keep_the_configured_timeout(run_dist):
    """Groups made after start-up use the default group's timeout (the
    harness's 120 s), not torch's 30-minute default for new groups."""
    for configured, group_timeouts, world in run_dist(_group_timeouts):
        assert configured == world
        assert configured.total_seconds() == 120
        assert group_timeouts == [world] * 3
