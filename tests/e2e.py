"""Run the real command-line tools in subprocesses, as a user would."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from mmpar.dist import free_port

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = 'configs/vit_digits/vit_digits.py'


def tool_env(**extra) -> dict:
    env = dict(os.environ)
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env['PORT'] = str(free_port())
    env['OMP_NUM_THREADS'] = '1'
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_tool(args, timeout=600, check=True, env=None):
    """Run ``args`` (a list; 'python' means this interpreter) in the repo."""
    args = [sys.executable if a == 'python' else str(a) for a in args]
    proc = subprocess.run(
        args,
        cwd=ROOT,
        env=env or tool_env(),
        capture_output=True,
        text=True,
        timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f'{" ".join(args)} exited {proc.returncode}\n'
            f'--- stdout (tail)\n{proc.stdout[-3000:]}\n'
            f'--- stderr (tail)\n{proc.stderr[-6000:]}')
    return proc


def load_ckpt(path) -> dict:
    return torch.load(path, map_location='cpu', weights_only=True)


def assert_same_training_state(a: dict, b: dict) -> None:
    """Bit-identical weights and optimizer state, same position."""
    assert a['meta']['epoch'] == b['meta']['epoch']
    assert a['meta']['iter'] == b['meta']['iter']
    assert a['state_dict'].keys() == b['state_dict'].keys()
    for key, value in a['state_dict'].items():
        assert torch.equal(value, b['state_dict'][key]), key
    opt_a, opt_b = a['optimizer']['state'], b['optimizer']['state']
    assert opt_a.keys() == opt_b.keys()
    for idx in opt_a:
        for name, value in opt_a[idx].items():
            assert torch.equal(value, opt_b[idx][name]), (idx, name)
    assert a['param_schedulers'] == b['param_schedulers']
