"""Several nodes, slurm and elastic restarts on torch.distributed's launcher.

One reference run (one node, 2 processes: the session's shared
``default_two_rank_run``, read-only) is compared with: two "nodes" of one
process each over loopback (epoch 1), and a run whose rank 1 is killed at
the start of epoch 2 and that torchrun restarts from the epoch-1 checkpoint
(epoch 2). Both must match the reference bit for bit: the same ranks see the
same data and gloo reduces in the same order.
"""
import os

import pytest

from mmpar.dist import free_port
from tests.e2e import (DEFAULT_CONFIG, ROOT, assert_same_training_state,
                       load_ckpt, run_nodes, run_tool, tool_env)
from tests.test_no_hangs import write_config

JOB_TIMEOUT_S = 400


def epochs(n):
    return ['--cfg-options', f'train_cfg.max_epochs={n}']


@pytest.fixture
def reference(default_two_rank_run):
    """One node, 2 processes: the run every other is compared to."""
    return default_two_rank_run


def test_two_nodes_match_one_node(reference, tmp_path):
    # Each "node" keeps its own work dir, as on separate machines.
    outputs = run_nodes(lambda node_rank: [
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, '1', '--work-dir',
        tmp_path / f'node{node_rank}'] + epochs(1), timeout=JOB_TIMEOUT_S)
    assert 'GPU number: 2' in outputs[0]  # MMEngine's name for world size
    # Rank 0 (on node 0) writes the checkpoint.
    assert_same_training_state(
        load_ckpt(tmp_path / 'node0' / 'epoch_1.pth'),
        load_ckpt(reference / 'epoch_1.pth'))
    assert not (tmp_path / 'node1' / 'epoch_1.pth').exists()


@pytest.mark.parametrize('resume', [['--resume'], []],
                         ids=['resume', 'no_flag'])
def test_elastic_restart_resumes_from_last_checkpoint(reference, tmp_path,
                                                      resume):
    """With or without ``--resume``: a restarted attempt resumes by itself
    (mmpar.Runner.load_or_resume)."""
    config = write_config(
        tmp_path / 'cfg.py',
        "custom_hooks = [dict(type='ExitOnFirstAttempt', rank=1, "
        'at_epoch=2)]')
    work_dir = tmp_path / 'work'
    proc = run_tool(
        ['bash', 'tools/dist_train.sh', config, 2, '--work-dir', work_dir] +
        resume + epochs(2),
        timeout=JOB_TIMEOUT_S,
        env=tool_env(MAX_RESTARTS=1))
    output = proc.stdout + proc.stderr
    # Two attempts (each writes a timestamped log dir); the second resumed
    # from the epoch-1 checkpoint.
    assert len([p for p in work_dir.iterdir() if p.is_dir()]) == 2
    assert 'resumed epoch: 1' in output, output[-4000:]
    assert_same_training_state(
        load_ckpt(work_dir / 'epoch_2.pth'), load_ckpt(reference / 'epoch_2.pth'))


def test_slurm_train_sh_runs_one_task(tmp_path):
    """tools/slurm_train.sh through a stand-in srun that sets SLURM_* for one
    task: rank, world size and master address come from those variables."""
    env = tool_env(GPUS=1, GPUS_PER_NODE=1, CPUS_PER_TASK=1)
    env['PATH'] = f'{ROOT / "tests" / "fake_slurm"}{os.pathsep}{env["PATH"]}'
    env['MASTER_PORT'] = str(free_port())
    env.pop('MASTER_ADDR', None)
    proc = run_tool(['bash', 'tools/slurm_train.sh', 'cpu', 'mmpar-test',
                     DEFAULT_CONFIG, tmp_path] + epochs(1),
                    timeout=JOB_TIMEOUT_S, env=env)
    output = proc.stdout + proc.stderr
    assert 'Distributed launcher: slurm' in output, output[-3000:]
    assert load_ckpt(tmp_path / 'epoch_1.pth')['meta']['epoch'] == 1
