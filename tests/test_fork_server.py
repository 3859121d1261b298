"""tests/fork_server.py starts a tool process that behaves like ``python
TOOL ARGS`` started by a shell or by torchrun: argv, environment, working
directory, separate stdout and stderr, exit status and signals; and it
really forks (the tool finds torch imported), also for each rank torchrun
starts."""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e import ROOT, fork_server, run_tool, tool_env

TOOL = '''import os, sys, weakref
served = 'torch' in sys.modules  # before this tool imports anything
# A finalizer of the tool's own runs at its exit (the server's do not).
weakref.finalize(sys, print, 'finalized', flush=True)
with open(os.environ['MMPAR_PROBE_PID'] + os.environ.get('RANK', ''),
          'w') as f:
    f.write(f'{os.getpid()} {served}')
print('out', sys.argv[1:], os.getcwd(), os.environ.get('MMPAR_PROBE'),
      os.environ.get('RANK'), flush=True)
print('err', file=sys.stderr)
what = sys.argv[1]
if what == 'raise':
    raise KeyError('boom')
if what == 'message':
    sys.exit('stopping: bad value')
if what == 'hang':
    import time
    time.sleep(60)
sys.exit(int(what))
'''


@pytest.fixture(scope='module')
def tool(tmp_path_factory):
    path = tmp_path_factory.mktemp('tool') / 'probe.py'
    path.write_text(TOOL)
    return path


def _env(tool, tmp_path):
    # The probe's directory counts as tools/ for the fork server.
    return tool_env(MMPAR_PROBE='seen', MMPAR_FORK_TOOLS=tool.parent,
                    MMPAR_PROBE_PID=tmp_path / 'pid')


def _probe(tmp_path, rank=''):
    pid, served = (tmp_path / f'pid{rank}').read_text().split()
    return int(pid), served == 'True'


def _both(tool, tmp_path, *args):
    """(served, fresh) results of ``python tool args``."""
    env = _env(tool, tmp_path)
    served = run_tool(['python', tool, *args], env=env, check=False,
                      timeout=60)
    assert _probe(tmp_path)[1], 'the served run did not fork'
    fresh = run_tool(['python', tool, *args], env=env, check=False,
                     timeout=60, fresh=True)
    assert not _probe(tmp_path)[1], 'the fresh run was forked'
    return served, fresh


@pytest.mark.parametrize('args', [('0', ), ('3', 'x'), ('raise', ),
                                  ('message', )])
def test_served_run_is_what_a_shell_run_gives(tool, tmp_path, args):
    served, fresh = _both(tool, tmp_path, *args)
    assert served.returncode == fresh.returncode
    assert served.stdout == fresh.stdout
    assert served.stdout.startswith(f"out {list(args)} {ROOT} seen None")
    assert served.stdout.endswith('finalized\n')
    # The traceback's frames differ (runpy); its first and last lines not.
    served_err, fresh_err = served.stderr.splitlines(), \
        fresh.stderr.splitlines()
    assert served_err[0] == fresh_err[0] == 'err'
    assert served_err[-1] == fresh_err[-1]


def _gone(pid, within=5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_signal_reaches_the_child_and_is_its_status(tool, tmp_path):
    proc = subprocess.Popen(
        [os.path.join(fork_server().bin, 'python'), tool, 'hang'],
        env=_env(tool, tmp_path), cwd=ROOT, stdout=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b'out')
    child, served = _probe(tmp_path)
    assert served and child != proc.pid
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM  # as a shell run's
    assert _gone(child)


def test_a_timed_out_run_takes_its_child_with_it(tool, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_tool(['python', tool, 'hang'], env=_env(tool, tmp_path),
                 timeout=3)
    child, served = _probe(tmp_path)
    assert served
    assert _gone(child)  # SIGKILL to the shim: the server ends the child
    # The server serves the next run.
    assert run_tool(['python', tool, '0'], env=_env(tool, tmp_path),
                    timeout=60).returncode == 0


def test_torchrun_and_each_rank_are_forked(tool, tmp_path):
    proc = run_tool(['bash', '-c', f'source tools/torchrun.sh && '
                     f'mmpar_torchrun 2 {tool} 0'],
                    env=_env(tool, tmp_path), timeout=120)
    for rank in ('0', '1'):
        assert f"out ['0'] {ROOT} seen {rank}" in proc.stdout
        assert _probe(tmp_path, rank)[1], f'rank {rank} was not forked'


def test_other_interpreter_uses_are_the_real_python(tmp_path):
    env = tool_env()
    out = subprocess.run(['python', '-c', 'import sys; print(sys.executable)'],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == sys.executable


# A CUDA machine as far as torch's Python side can tell (a CUDA build that
# NVML says has one GPU), where every call that would initialise CUDA in this
# process (the runtime's device count, which loads the driver; torch's lazy
# init) is recorded instead. These are torch's private seams for exactly
# those two steps; the CPU wheel has no CUDA to initialise otherwise.
CUDA_MACHINE = '''
import sys, torch
inits = []
torch._C._cuda_getDeviceCount = lambda: inits.append('device count') or 1
torch.cuda._lazy_init = lambda: inits.append('lazy init')
# Imported (not called) where torch's build has CUDA.
torch._C._cuda_getCurrentRawStream = lambda *a: inits.append('a stream')
nvml = []
torch.cuda._raw_device_count_nvml = lambda: nvml.append(1) or 1
sys.path.insert(0, 'tests')
import fork_server
fork_server.preload()
print('nvml asked', len(nvml), 'inits', inits, 'why not',
      fork_server.cuda_in_use())
'''


def test_on_a_cuda_machine_the_server_leaves_cuda_to_its_children():
    """The fork server serves CUDA machines too: its imports (MMEngine's
    and transformers' check whether CUDA is there) must not initialise CUDA
    in the server, or no child could use it. In the server's environment
    they ask NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``, tests/e2e.py)."""
    from tests.e2e import server_env
    proc = subprocess.run([sys.executable, '-c', CUDA_MACHINE], cwd=ROOT,
                          env=server_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = proc.stdout.strip().splitlines()[-1]
    asked = int(said.split()[2])
    assert asked > 0, said  # the imports did look for CUDA
    assert said.endswith(f'nvml asked {asked} inits [] why not'), said
