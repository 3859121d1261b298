"""The tensor-parallel dry run's thread on CUDA (``pytest -m gpu``).

The dry run (:mod:`mmpar.parallelize.tp_check`) calls the meta replica in a
thread of its own, outside the caller's dispatch modes; the current CUDA
device is per thread too, so the thread takes the caller's.
"""
import pytest
import torch

from mmpar.parallelize.tp_check import _outside_modes

pytestmark = pytest.mark.gpu


class _Probe(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.devices = []

    def forward(self, x):
        self.devices.append(torch.accelerator.current_device_index())
        return x


def test_the_dry_run_thread_runs_on_the_callers_device():
    before = torch.accelerator.current_device_index()
    last = torch.cuda.device_count() - 1  # not the default where there are 2+
    torch.accelerator.set_device_index(last)
    try:
        probe = _Probe()
        assert _outside_modes(probe, (torch.zeros(2, device='meta'), ),
                              {}) is None
        assert probe.devices == [last]
    finally:
        torch.accelerator.set_device_index(before)
