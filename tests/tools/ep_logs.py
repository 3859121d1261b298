"""What the expert-parallel end-to-end tests read from a run: its logged
values and its optimizer's moments by parameter name."""
import re


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
