"""Run the real command-line tools in subprocesses, as a user would."""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = 'configs/vit_digits/vit_digits.py'
# FSDP2 and FSDP1 over the digits ViT's blocks, as the parity tests wrap it.
VIT_FSDP2 = dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
    type='module_class', module_classes=['TransformerBlock']))
VIT_FSDP1 = dict(VIT_FSDP2, type='MMFullyShardedDataParallel')


def tool_env(**extra) -> dict:
    env = dict(os.environ)
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env['OMP_NUM_THREADS'] = '1'
    if _served():
        env.update(fork_server().env)
        env['PATH'] = fork_server().bin + os.pathsep + env.get('PATH', '')
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _served() -> bool:
    """Tool processes fork from the fork server unless
    MMPAR_TEST_FRESH_TOOLS=1; on CPU and CUDA machines alike."""
    return os.environ.get('MMPAR_TEST_FRESH_TOOLS') != '1'


def tool_python(fresh: bool = False) -> str:
    """The ``python`` a tool process is started with: the fork server's
    shim where tools are served, else this interpreter."""
    if _served() and not fresh:
        return os.path.join(fork_server().bin, 'python')
    return sys.executable


def server_env() -> dict:
    """The fork server's own environment (what its imports see): the
    session's, without a test's rank (each request brings its own)."""
    env = {k: v for k, v in os.environ.items() if k not in (
        'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',
        'MASTER_ADDR', 'MASTER_PORT')}
    env['PYTHONPATH'] = str(ROOT) + os.pathsep + env.get('PYTHONPATH', '')
    env['OMP_NUM_THREADS'] = '1'
    # Its imports' CUDA availability checks ask NVML, which leaves CUDA
    # uninitialised for the children (tests/fork_server.py cuda_in_use); the
    # children get their request's environment, without it.
    env['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'
    return env


class _ForkServer:
    """tests/fork_server.py, and the ``python`` (tests/fork_python.py)
    that sends it the suite's tool processes."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix='mmpar_fork_')
        self.bin = os.path.join(self.dir, 'bin')
        os.mkdir(self.bin)
        shim = os.path.join(self.bin, 'python')
        body = (ROOT / 'tests' / 'fork_python.py').read_text()
        with open(shim, 'w') as f:
            f.write(f'#!{sys.executable} -SE\n{body}')
        os.chmod(shim, 0o755)
        socket_path = os.path.join(self.dir, 'socket')
        self.env = dict(MMPAR_FORK_SOCKET=socket_path,
                        MMPAR_REAL_PYTHON=sys.executable,
                        MMPAR_FORK_TOOLS=str(ROOT / 'tools'))
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / 'tests' / 'fork_server.py'),
             socket_path, shim],
            cwd=ROOT, env=server_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        said = self.proc.stdout.readline().strip()
        if said != 'ready':
            raise RuntimeError(
                f'tests/fork_server.py did not start ({said or "no answer"});'
                ' MMPAR_TEST_FRESH_TOOLS=1 runs the tools without it')
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


_server = None


def fork_server() -> _ForkServer:
    """The session's fork server (started on first use)."""
    global _server
    if _server is None:
        _server = _ForkServer()
    return _server


def run_tool(args, timeout=600, check=True, env=None, fresh=False):
    """Run ``args`` (a list; 'python' means this interpreter) in the repo.

    ``python tools/X.py ...`` and every tool python that a script such as
    ``bash tools/dist_train.sh`` starts (torchrun, each rank) fork from the
    fork server (tests/fork_server.py: the same tool file as ``__main__``,
    its own argv, environment, streams and exit status; the imports paid
    once per session); ``fresh=True`` starts new interpreters throughout,
    as a user's shell does.
    """
    env = dict(env or tool_env())
    if fresh:
        env['MMPAR_TEST_FRESH_TOOLS'] = '1'
    python = tool_python(fresh)
    args = [python if a == 'python' else str(a) for a in args]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f'{" ".join(args)} exited {proc.returncode}\n'
            f'--- stdout (tail)\n{proc.stdout[-3000:]}\n'
            f'--- stderr (tail)\n{proc.stderr[-6000:]}')
    return proc


def run_nodes(node_args, nnodes=2, timeout=400) -> list:
    """Launch ``nnodes`` "nodes" on the loopback, as a user starts one
    ``tools/dist_train.sh`` per machine (``NNODES``, ``NODE_RANK``, one
    ``PORT``): ``node_args(node_rank)`` is each node's command. Waits for
    all; fails with the tail of a node that exited non-zero; returns each
    node's output (stdout and stderr together)."""
    from mmpar.dist import free_port
    env = tool_env(NNODES=nnodes, MASTER_ADDR='127.0.0.1', PORT=free_port())
    nodes = [subprocess.Popen(
        [str(a) for a in node_args(rank)], cwd=ROOT,
        env=dict(env, NODE_RANK=str(rank)), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in range(nnodes)]
    outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    for rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f'node {rank}:\n{output[-4000:]}'
    return outputs


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
