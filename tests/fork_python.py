"""``python`` as the suite's tools see it (see tests/fork_server.py).

tests/e2e.py installs this file as ``python`` in a directory it puts first
on the tools' PATH, with a first line naming the real interpreter (run
with ``-S -E``: it starts in milliseconds). ``python tools/X.py ...``,
``python -u tools/X.py ...`` (how torchrun starts a rank) and ``python -m
torch.distributed.run ...`` (how tools/dist_train.sh starts torchrun) and
``python -m tests.dist_harness ...`` (a test pool's worker) and ``python -m
pytest ...`` (tests/gpu/test_marker.py's collection run) are forked from
the fork server; anything else, or any run while
``MMPAR_TEST_FRESH_TOOLS=1``, is the real interpreter (``exec``).

Served, this process stays as the child's stand-in: signals sent to it go
to the child's process group, and it exits with the child's status (or
dies of the child's signal).
"""
import json
import os
import signal
import socket
import sys

REAL = os.environ.get('MMPAR_REAL_PYTHON', '')
SOCKET = os.environ.get('MMPAR_FORK_SOCKET', '')
TOOLS = os.environ.get('MMPAR_FORK_TOOLS', '')  # the tools/ directory


def servable(args: list) -> bool:
    if os.environ.get('MMPAR_TEST_FRESH_TOOLS') == '1' or not SOCKET:
        return False
    if args[:2] in (['-m', 'torch.distributed.run'],
                    ['-m', 'tests.dist_harness'],  # a test pool's worker
                    ['-m', 'pytest']):  # a nested collection run
        return True
    if args[:1] == ['-u']:
        args = args[1:]
    return bool(args) and args[0].endswith('.py') and os.path.dirname(
        os.path.abspath(args[0])) == TOOLS


def main() -> None:
    args = sys.argv[1:]
    if not servable(args):
        os.execv(REAL, [REAL, *args])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(SOCKET)
    except OSError:  # no server (any more): a plain interpreter
        os.execv(REAL, [REAL, *args])
    request = json.dumps(dict(argv=args, env=dict(os.environ),
                              cwd=os.getcwd())).encode() + b'\n'
    socket.send_fds(conn, [request], [0, 1, 2])
    replies = conn.makefile('r')
    pid = int(replies.readline().split()[1])

    def forward(sig, _frame):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    line = replies.readline()
    if not line:  # the server died
        sys.exit(1)
    status = int(line.split()[1])
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == '__main__':
    main()
