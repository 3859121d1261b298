"""Run the real command-line tools in subprocesses, as a user would."""
import os
import subprocess
import sys
import tempfile
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


def read_dcp_checkpoint(path) -> dict:
    """A sharded checkpoint directory read by torch alone, as the oracle.

    The tensors come from torch's own DCP reader (``dcp_to_torch_save``,
    no mmpar code), the rest from the plain-data file the format documents
    (docs/checkpoints.md: ``mmpar_state.pth``, loaded ``weights_only``).
    Returns the keys :func:`assert_same_training_state` compares:
    ``meta``, ``param_schedulers``, ``state_dict`` (the model's tensors) and
    ``optimizer`` (``state`` keyed by parameter names, ``param_groups``).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'full.pt')
        dcp_to_torch_save(str(path), out)
        tensors = torch.load(out, map_location='cpu', weights_only=True)
    plain = load_ckpt(os.path.join(str(path), 'mmpar_state.pth'))
    checkpoint = dict(meta=plain['meta'],
                      param_schedulers=plain.get('param_schedulers'),
                      state_dict=tensors['model'])
    if 'optimizer' in tensors:
        checkpoint['optimizer'] = dict(
            state=tensors['optimizer']['state'],
            param_groups=plain['optimizer']['param_groups'])
    return checkpoint


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
