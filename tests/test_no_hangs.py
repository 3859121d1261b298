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
        'env_cfg = dict(dist_cfg=dict(timeout=2))')
    proc = dist_train(config, tmp_path / 'work')
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert 'rank 0 failed (a collective timed out after ' \
        'env_cfg.dist_cfg.timeout' in output, output[-4000:]
    assert 'Timed out waiting 2000ms' in output[output.index('Root Cause'):]


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


# -- the uneven-data matrix -------------------------------------------------
# Data set sizes that no number of ranks x batch divides (and smaller than
# the ranks), drop_last either way, epoch- and iteration-based training with
# validation and test, under replicas (DDP, bucketed) and a sharded model
# (FSDP2), on the 2-rank pool. Each case ends, within CASE_TIMEOUT_S (far
# below the pool's 120 s collective timeout, so a hang fails fast), either
# trained with every evaluated sample counted once, or refused at start-up
# naming the key (mmpar/runner/even_data.py).
CASE_TIMEOUT_S = 60
BUCKETED = dict(type='MMBucketDataParallel')
UNEVEN_CASES = {
    # id: (wrapper, by_epoch, train size, eval size, drop_last,
    #      train round_up, eval round_up, refused key or None)
    'ddp-epoch-odd-sizes': ('ddp', True, 7, 5, False, True, True, None),
    'fsdp2-epoch-drop-last': ('fsdp2', True, 7, 5, True, True, True, None),
    'bucketed-iter-smaller-than-ranks': ('bucketed', False, 1, 1, False,
                                         True, True, None),
    'fsdp2-iter-drop-last': ('fsdp2', False, 3, 3, True, True, True, None),
    'ddp-eval-uneven-split': ('ddp', True, 8, 5, False, True, False, None),
    'ddp-epoch-uneven-train': ('ddp', True, 5, 5, False, False, True,
                               'train_dataloader'),
    'fsdp2-eval-uneven-split': ('fsdp2', True, 8, 5, False, True, False,
                                'val_dataloader'),
    'ddp-iter-rank-without-data': ('ddp', False, 1, 3, False, False, True,
                                   'train_dataloader'),
}
EVAL_BATCH = TRAIN_BATCH = 2


def _uneven_cfg(work_dir, name, wrapper, by_epoch, train_size, eval_size,
                drop_last, train_round_up, eval_round_up):
    from mmengine.config import Config

    from tests.e2e import VIT_FSDP2
    from tests.trained import SMALL_MODEL
    cfg = Config.fromfile(str(ROOT / DEFAULT_CONFIG))
    cfg.model.update(SMALL_MODEL)
    if wrapper != 'ddp':
        cfg.model_wrapper_cfg = VIT_FSDP2 if wrapper == 'fsdp2' else BUCKETED
    cfg.custom_imports = dict(imports=['tests.sample_recording'],
                              allow_failed_imports=False)
    if by_epoch or not train_round_up:
        sampler = dict(type='DefaultSampler', shuffle=True,
                       round_up=train_round_up)
    else:
        sampler = dict(type='InfiniteSampler', shuffle=True)
    cfg.train_dataloader.update(
        batch_size=TRAIN_BATCH, drop_last=drop_last, sampler=sampler,
        dataset=dict(type='RecordedDigits', num_samples=train_size))
    cfg.train_cfg = (dict(by_epoch=True, max_epochs=1, val_interval=1)
                     if by_epoch else
                     dict(by_epoch=False, max_iters=2, val_interval=2))
    cfg.val_dataloader = dict(
        cfg.val_dataloader, batch_size=EVAL_BATCH, drop_last=drop_last,
        sampler=dict(type='DefaultSampler', shuffle=False,
                     round_up=eval_round_up),
        dataset=dict(type='RecordedDigits', split='val',
                     num_samples=eval_size))
    cfg.test_dataloader = cfg.val_dataloader
    cfg.val_evaluator = cfg.test_evaluator = dict(type='CountSamples')
    cfg.default_hooks.checkpoint = None
    cfg.log_processor = dict(by_epoch=by_epoch)
    cfg.update(launcher='pytorch', work_dir=str(work_dir),
               experiment_name=name)
    return cfg


def _ready():
    return True


def _uneven_case(work_dir, name, *case):
    """Train (with validation) and test; returns (iterations, val metrics,
    test metrics), or the refusal's message."""
    from mmpar.failures import ConfigError
    from mmpar.runner import Runner
    try:
        runner = Runner.from_cfg(_uneven_cfg(work_dir, name, *case))
        runner.train()
        val = {key: runner.message_hub.get_scalar(f'val/{key}').current()
               for key in ('count', 'labels')}
        return runner.iter, val, runner.test()
    except ConfigError as err:
        return str(err)


def _expected_count(size, drop_last, round_up, num_ranks=2):
    """Samples evaluated: each rank's share (padded by round_up), less
    drop_last's partial batch, the padding dropped again."""
    shares = ([-(-size // num_ranks)] * num_ranks if round_up else
              [len(range(r, size, num_ranks)) for r in range(num_ranks)])
    if drop_last:
        shares = [n - n % EVAL_BATCH for n in shares]
    return min(size, sum(shares))


@pytest.mark.parametrize('case', sorted(UNEVEN_CASES))
def test_uneven_data_ends_without_a_hang(case, run_dist, tmp_path):
    from mmpar.datasets import DigitsDataset
    *config, refused = UNEVEN_CASES[case]
    run_dist(_ready)  # the pool started (not counted in the case's time)
    results = run_dist(_uneven_case, tmp_path, f'{case}-{id(tmp_path)}',
                       *config, timeout=CASE_TIMEOUT_S)
    if refused:
        for message in results:
            assert isinstance(message, str), message
            assert message.startswith(f'{refused}: '), message
            assert 'Allowed:' in message
        return
    _, by_epoch, train_size, eval_size, drop_last, _, round_up = config
    labels = DigitsDataset('val').labels
    expected = _expected_count(eval_size, drop_last, round_up)
    per_rank = -(-train_size // 2)  # round_up's share
    iters = (2 if not by_epoch else per_rank // TRAIN_BATCH if drop_last
             else -(-per_rank // TRAIN_BATCH))
    for trained, val, test in results:
        assert trained == iters
        assert val['count'] == test['count'] == expected
        if expected == eval_size:  # every sample once, none twice
            assert val['labels'] == test['labels'] == \
                int(labels[:eval_size].sum())


def test_odd_sizes_under_fsdp2_end_through_the_tool(tmp_path):
    """The launcher's path: FSDP2 on 2 processes, 7 training samples in
    batches of 2 with drop_last, 5 validation samples: ends, every
    validation sample counted once."""
    from tests.e2e import VIT_FSDP2
    config = write_config(
        tmp_path / 'cfg.py',
        "custom_imports = dict(imports=['tests.sample_recording'], "
        'allow_failed_imports=False)',
        f'model_wrapper_cfg = {VIT_FSDP2}',
        'model = dict(embed_dim=16, depth=2, num_heads=2)',
        'train_dataloader = dict(batch_size=2, drop_last=True, '
        "dataset=dict(type='RecordedDigits', num_samples=7))",
        'val_dataloader = dict(batch_size=2, '
        "dataset=dict(type='RecordedDigits', split='val', num_samples=5))",
        "val_evaluator = dict(type='CountSamples')")
    proc = dist_train(config, tmp_path / 'work')
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    # 3 samples a rank (one repeat), 2 batches; the repeat dropped.
    assert 'Epoch(val) [1][2/2]    count: 5 ' in output, output[-3000:]


EXIT_WITH_OPEN_FILES = '''
import io, sys
from mmpar.failures import exit_process
kept = open(sys.argv[1], 'w')  # reachable, never closed
kept.write('kept')
text = open(sys.argv[2], 'w', buffering=1 << 16)  # a large buffer
text.write('text' * 1000)
class Mine(io.BufferedWriter):  # a subclass: found by its base
    pass
mine = Mine(io.FileIO(sys.argv[3], 'w'))
mine.write(b'mine')
exit_process(3)
'''


def test_exit_process_keeps_what_open_files_hold(tmp_path):
    """A tool ends without the interpreter's teardown
    (failures.exit_process) with the status it was given, and files a
    user's code left open, of io's types or a subclass,
    hold what was written to them. (One only reachable from a reference
    cycle loses its buffer in the interpreter's own teardown too: gc may
    close its raw file first.)"""
    import sys
    paths = [tmp_path / name for name in ('kept', 'text', 'mine')]
    proc = subprocess.run(
        [sys.executable, '-c', EXIT_WITH_OPEN_FILES, *map(str, paths)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert [p.read_text() for p in paths] == ['kept', 'text' * 1000, 'mine']
