"""What the expert-parallel end-to-end tests read from a run: its logged
values and its optimizer's moments by parameter name, and how they compare
a run with one process's (and that one-process run)."""
import re

from tests.e2e import run_tool


def train_one_process(config, work_dir, options: list,
                      global_batch: int) -> tuple:
    """``tools/train.py CONFIG`` on one process with ``options`` and the
    layouts' ``global_batch``: (its work dir, its log)."""
    run = run_tool(['python', 'tools/train.py', config, '--work-dir',
                    work_dir, '--cfg-options', *options,
                    f'train_dataloader.batch_size={global_batch}'])
    return work_dir, run.stdout + run.stderr


def logged(output: str, key: str) -> list:
    """The values of ``key`` in the train iterations' log lines."""
    return [float(v) for v in re.findall(
        rf'Iter\(train\).*? {key}: ([\d.]+)', output)]


def optim_state(ckpt: dict) -> dict:
    """``{parameter name: its optimizer state}``: a sharded run's
    checkpoint keys it by name, one process's by index in parameter order
    (the state dict's order, less the MoE layers' ``expert_bias``
    buffers)."""
    state = ckpt['optimizer']['state']
    if all(isinstance(k, str) for k in state):
        return state
    names = [k for k in ckpt['state_dict'] if 'expert_bias' not in k]
    return {names[i]: value for i, value in state.items()}


def assert_close_moments(got: dict, want: dict) -> None:
    """Adam's moments of two checkpoints agree (relative 1e-3): the weights
    alone hide a gradient off by a constant factor (Adam's update is
    nearly scale-free)."""
    import torch
    got, want = optim_state(got), optim_state(want)
    assert got.keys() == want.keys()
    for name, state in want.items():
        for moment in ('exp_avg', 'exp_avg_sq'):
            torch.testing.assert_close(got[name][moment], state[moment],
                                       atol=1e-9, rtol=1e-3,
                                       msg=f'{name} {moment}')


def assert_matches_one_process(ep_log: str, ep_dir, one_log: str, one_dir,
                               keys, whole_experts: str,
                               clip_every_step: bool = False) -> None:
    """An expert-parallel run's logged ``keys`` (3 iterations), Adam's
    moments and final weights equal one process's: logged values within
    2e-4 (4 decimals), weights atol 1e-5 / rtol 1e-4; the clip at 0.5 bit
    (at some logged step, or at every one with ``clip_every_step``);
    ``whole_experts`` saved with all 4 experts."""
    import pytest
    import torch

    from tests.e2e import load_ckpt
    for key in keys:
        got, want = logged(ep_log, key), logged(one_log, key)
        assert len(got) == 3, key
        # Logged with 4 decimals; the experts' matmuls run over other row
        # blocks on several ranks (sums in another order).
        assert got == pytest.approx(want, abs=2e-4), key
    norms = logged(one_log, 'grad_norm')
    assert (min(norms) if clip_every_step else max(norms)) > 0.5
    got = load_ckpt(ep_dir / 'iter_3.pth')
    want = load_ckpt(one_dir / 'iter_3.pth')
    assert_close_moments(got, want)
    a, b = got['state_dict'], want['state_dict']
    assert a.keys() == b.keys()
    assert a[whole_experts].shape[0] == 4  # saved whole
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4,
                                   msg=key)
