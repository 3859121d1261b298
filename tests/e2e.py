"""Run the real command-line tools in subprocesses, as a user would."""
import atexit
import json
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


class _ToolServer:
    """tests/tool_server.py: forks one process per one-process tool run
    from an interpreter that imported torch, MMEngine and mmpar once."""

    def __init__(self):
        # Each request brings its own environment; the server's own (what
        # the imports see) is the session's, without a test's rank.
        env = {k: v for k, v in tool_env().items() if k not in (
            'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',
            'MASTER_ADDR', 'MASTER_PORT')}
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / 'tests' / 'tool_server.py')],
            cwd=ROOT, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if self.proc.stdout.readline().strip() != 'ready':
            raise RuntimeError('tests/tool_server.py did not start')
        atexit.register(self.close)

    def run(self, args, env, timeout) -> subprocess.CompletedProcess:
        self.proc.stdin.write(json.dumps(dict(
            args=args, env=env, cwd=str(ROOT), timeout=timeout)) + '\n')
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError('tests/tool_server.py died')
        reply = json.loads(line)
        if reply['timed_out']:
            raise subprocess.TimeoutExpired(args, timeout, reply['stdout'],
                                            reply['stderr'])
        return subprocess.CompletedProcess(args, reply['returncode'],
                                           reply['stdout'], reply['stderr'])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)


_server = None


def _served(args, fresh: bool) -> bool:
    """One-process ``python tools/X.py`` runs go to the tool server unless
    asked ``fresh`` (or MMPAR_TEST_FRESH_TOOLS=1, or on CUDA machines, where
    the GPU checks run every tool exactly as a user does)."""
    return (not fresh and len(args) > 1 and args[0] == 'python'
            and Path(str(args[1])).parent == Path('tools')
            and os.environ.get('MMPAR_TEST_FRESH_TOOLS') != '1'
            and not torch.cuda.is_available())


def tool_server() -> _ToolServer:
    """The session's tool server (started on first use)."""
    global _server
    if _server is None:
        _server = _ToolServer()
    return _server


def run_tool(args, timeout=600, check=True, env=None, fresh=False):
    """Run ``args`` (a list; 'python' means this interpreter) in the repo.

    ``python tools/X.py ...`` runs in a process forked from the tool server
    (tests/tool_server.py: the same tool file as ``__main__``, its own
    argv, environment, output and exit status; the imports paid once per
    session); ``fresh=True`` starts a new interpreter as a user's shell
    does, as every other command (``bash tools/dist_train.sh``) does.
    """
    if _served(args, fresh):
        proc = tool_server().run([str(a) for a in args[1:]],
                                 env or tool_env(), timeout)
        args = [sys.executable] + [str(a) for a in args[1:]]
    else:
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
