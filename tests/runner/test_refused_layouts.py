"""Issue 11's silent divergence, now refused through the real launcher:
default DDP with parallel.model_parallelism=2 at 4 ranks used to end with
two different models (checksums 599.3655 vs 599.5245) and no warning."""
from tests.e2e import DEFAULT_CONFIG, run_tool


def test_dist_train_refuses_model_parallelism_without_a_plan(tmp_path):
    proc = run_tool(['bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 4,
                     '--work-dir', tmp_path, '--cfg-options',
                     'parallel.model_parallelism=2'],
                    timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert 'parallel.model_parallelism=2 asks for tensor parallelism' in \
        output, output[-3000:]
    assert 'parallel.tp_plan is not set' in output
    assert 'Epoch(train)' not in output
    assert not list(tmp_path.glob('*.pth'))
