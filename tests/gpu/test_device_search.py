"""The device seam and the layout search on CUDA (``pytest -m gpu``;
skipped without CUDA like every test here)."""
import json

import pytest
import torch

from mmpar import device
from tests.e2e import run_tool

pytestmark = pytest.mark.gpu


def test_device_module_answers_for_cuda():
    assert device.accelerator_type() == 'cuda'
    assert device.default_backend() == 'nccl'
    assert device.local_device(0) == torch.device('cuda', 0)
    device.release_memory()
    device.reset_peak_memory()
    big = torch.ones(64 * 2**20 // 4, device='cuda')  # 64 MiB
    device.synchronize()
    assert device.peak_memory()['allocated'] >= 64 * 2**20
    del big
    device.release_memory()
    device.reset_peak_memory()
    assert device.peak_memory()['allocated'] < 64 * 2**20


def test_search_at_world_size_1_measures_device_memory(tmp_path):
    out = tmp_path / 'search'
    proc = run_tool(['bash', 'tools/dist_train.sh',
                     'tests/data/search_llama.py', 1, '--search', '--search-only', '--trial-steps', 2,
                     '--warmup-steps', 1, '--checkpointing', 'none', '--out',
                     out, '--work-dir', tmp_path / 'job'])
    assert 'measured in this job, cuda' in proc.stderr
    assert 'backend nccl, 1 ranks' in proc.stderr
    result = json.loads((out / 'search.json').read_text())
    assert result['exit_status'] == 0
    best = result['rows'][0]
    # Device memory of a 2-layer, dim-32 Llama: far below a process's RSS.
    assert 0 < best['measured_peak'] < 200 * 2**20
