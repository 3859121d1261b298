"""tests/tool_server.py runs a tool in a forked process that behaves like
``python TOOL ARGS`` started by a shell: argv, environment, working
directory, separate stdout and stderr, and the exit status."""
import subprocess
import sys

import pytest

from tests.e2e import ROOT, tool_env, tool_server

TOOL = '''import os, sys
print('out', sys.argv[1:], os.getcwd(), os.environ.get('MMPAR_PROBE'))
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
    return str(path)


def _both(tool, *args):
    """(served, fresh) results of ``python tool args``."""
    env = tool_env(MMPAR_PROBE='seen')
    served = tool_server().run([tool, *args], env, timeout=60)
    fresh = subprocess.run([sys.executable, tool, *args], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=60)
    return served, fresh


@pytest.mark.parametrize('args', [('0', ), ('3', 'x'), ('raise', ),
                                  ('message', )])
def test_served_run_is_what_a_shell_run_gives(tool, args):
    served, fresh = _both(tool, *args)
    assert served.returncode == fresh.returncode
    assert served.stdout == fresh.stdout
    assert served.stdout.startswith(f"out {list(args)} {ROOT} seen")
    # The traceback's frames differ (runpy); its first and last lines not.
    served_err, fresh_err = served.stderr.splitlines(), \
        fresh.stderr.splitlines()
    assert served_err[0] == fresh_err[0] == 'err'
    assert served_err[-1] == fresh_err[-1]


def test_a_hung_run_is_killed_at_the_timeout(tool):
    with pytest.raises(subprocess.TimeoutExpired):
        tool_server().run([tool, 'hang'], tool_env(), timeout=1)
    # The server serves the next run.
    assert tool_server().run([tool, '0'], tool_env(),
                             timeout=60).returncode == 0
