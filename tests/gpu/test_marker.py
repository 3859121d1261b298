"""``pytest -m gpu`` collects the GPU tests and, without CUDA, skips them
all cleanly (this test itself is not marked: it runs everywhere)."""
import subprocess

import pytest
import torch

from tests.e2e import ROOT, tool_env, tool_python


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason='with CUDA the gpu tests run instead of skipping')
def test_gpu_tests_are_collected_and_skipped_without_cuda():
    # Forked from the fork server where tools are (tests/e2e.py): the
    # collection, not torch's import, is what this checks (a new
    # interpreter cost ~4 s of the test's 5).
    proc = subprocess.run(
        [tool_python(), '-m', 'pytest', '-m', 'gpu', '--strict-markers',
         '-q', '-rs', 'tests/gpu'],
        cwd=ROOT, env=tool_env(), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    # 14 gpu tests, all skipped, none run; this file is deselected.
    assert summary.startswith('14 skipped, 1 deselected'), proc.stdout
    assert 'needs CUDA' in proc.stdout
