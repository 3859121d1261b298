"""A wrong config or command line fails at once, naming what is allowed."""
import pytest

from tests.e2e import DEFAULT_CONFIG, run_tool

# (An unknown wrapper type: tests/test_bad_input_cli.py launches the same
# command and asserts the same lines, and more.)
CASES = {
    'unknown sync strategy':
    (['--cfg-options', 'model_wrapper_cfg.sync_strategy=sometimes'],
     ["sync_strategy='sometimes'", 'single_auto_sync, multi_auto_sync, '
      'forced_sync']),
    'unknown launcher': (['--launcher', 'kubernetes'],
                         ["'kubernetes'", 'none', 'pytorch', 'slurm', 'mpi']),
    'missing resume checkpoint': (['--resume', 'no/such.pth'],
                                  ['no/such.pth', 'does not exist']),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_train_rejects_bad_input(case, tmp_path):
    args, expected = CASES[case]
    proc = run_tool(
        ['python', 'tools/train.py', DEFAULT_CONFIG, '--work-dir', tmp_path] +
        args,
        timeout=60,
        check=False)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    for text in expected:
        assert text in output, output[-2000:]
    # Failed before training started.
    assert 'Epoch(train)' not in output
