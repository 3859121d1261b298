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
