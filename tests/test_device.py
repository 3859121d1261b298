"""The one device seam (:mod:`mmpar.device`, issue 34).

No other module of mmpar names ``torch.cuda``; on this CPU machine the
module answers for the CPU (gloo, RSS), and with a CUDA accelerator faked
it picks nccl and the accelerator's device.
"""
from pathlib import Path

import torch

from mmpar import device

ROOT = Path(__file__).resolve().parents[1]


def test_only_the_device_module_names_torch_cuda():
    hits = [f'{path.relative_to(ROOT)}:{number}'
            for path in sorted((ROOT / 'mmpar').rglob('*.py'))
            if path.name != 'device.py' or path.parent.name != 'mmpar'
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if 'torch.cuda' in line]
    assert hits == []


def test_cpu_answers():
    assert device.accelerator_type() is None
    assert not device.uses_accelerator()
    assert device.default_backend() == 'gloo'
    assert device.local_device(3) == torch.device('cpu')
    assert device.current_device() == torch.device('cpu')
    assert device.rng_states() == {}
    device.synchronize()  # nothing to wait for
    device.set_rng_states({'cuda': [torch.zeros(3)]})  # another kind: ignored


def test_a_faked_cuda_accelerator_picks_nccl_and_its_device(monkeypatch):
    monkeypatch.setattr(torch.accelerator, 'is_available', lambda: True)
    monkeypatch.setattr(torch.accelerator, 'current_accelerator',
                        lambda: torch.device('cuda'))
    assert device.accelerator_type() == 'cuda'
    assert device.default_backend() == 'nccl'
    assert device.backend_for('xpu') == 'xccl'
    monkeypatch.setenv('LOCAL_RANK', '3')
    assert device.local_device() == torch.device('cuda', 3)


def test_peak_rss_resets_and_follows_a_large_tensor():
    device.release_memory()
    device.reset_peak_memory()
    before = device.peak_memory()['peak']
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = device.peak_memory()['peak']
    assert grown - before > 48 * 2**20
    del big
    device.release_memory()
    device.reset_peak_memory()
    assert device.peak_memory()['peak'] < grown - 32 * 2**20
