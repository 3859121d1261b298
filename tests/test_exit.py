"""How a tool's process ends: ``mmpar.failures.run_and_exit`` gives the run's
status and does, before ``os._exit``, what the interpreter's teardown would
have done that a run's output needs (the teardown itself can abort a finished
distributed run; ``benchmarks/bench_clean_exits.py --starve-gloo`` reproduces
that, through the real tools).

Each case is a fresh interpreter (``os._exit`` would end pytest), importing
only ``mmpar.failures``: a fraction of a second each.
"""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TOOL = '''
import atexit, sys, threading, time
from mmpar.failures import run_and_exit

prefix, outcome = sys.argv[1], sys.argv[2]
left_open = open(prefix + '.file', 'w')  # never flushed nor closed
left_open.write('written')
atexit.register(lambda: open(prefix + '.atexit', 'w').write('ran'))


def finish_later():
    time.sleep(0.3)
    with open(prefix + '.thread', 'w') as f:
        f.write('joined')


threading.Thread(target=finish_later).start()


def main():
    print('main ran')
    if outcome == 'ok':
        return
    if outcome == 'raise':
        raise ValueError('the failure')
    raise SystemExit(int(outcome) if outcome.isdigit() else outcome)


run_and_exit(main)
'''


def run_tool(tmp_path: Path, outcome: str) -> subprocess.CompletedProcess:
    script = tmp_path / 'tool.py'
    script.write_text(TOOL)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / 'out'), outcome],
        cwd=ROOT, env={'PYTHONPATH': str(ROOT), 'PATH': '/usr/bin:/bin'},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        timeout=60)


@pytest.mark.parametrize('outcome, code', [('ok', 0), ('0', 0), ('3', 3),
                                           ('raise', 1),
                                           ('a message', 1)])
def test_status_and_what_teardown_would_have_done(tmp_path, outcome, code):
    proc = run_tool(tmp_path, outcome)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == 'main ran\n'  # stdout flushed
    out = tmp_path / 'out'
    # Python's non-daemon threads joined, atexit handlers run, open files
    # flushed: as a normal exit would.
    assert Path(f'{out}.thread').read_text() == 'joined'
    assert Path(f'{out}.atexit').read_text() == 'ran'
    assert Path(f'{out}.file').read_text() == 'written'
    if outcome == 'raise':
        assert 'ValueError: the failure' in proc.stderr
    if outcome == 'a message':
        assert proc.stderr == 'a message\n'
