"""Run one-process tools (``python tools/X.py ...``) without paying their
imports each time.

Starting ``tools/train.py`` costs seconds before it reads its config:
importing torch, MMEngine and mmpar. This server (a subprocess the test
session starts once, see :func:`tests.e2e.run_tool`) imports them once,
then forks one child per request. Each child is its own process, as when a
user runs the tool: it gets the request's argv, environment and working
directory, its own stdout and stderr, runs the tool file as ``__main__``
and exits with the tool's status (an uncaught exception: traceback, 1;
``sys.exit('text')``: the text, 1), so exit codes and output are checked as
before; what it shares with the server is only modules imported before any
config was read.

Protocol: one JSON object per line on stdin (``args``, ``env``, ``cwd``,
``timeout``), one per line on stdout (``returncode``, ``stdout``,
``stderr``).
"""
import json
import os
import signal
import sys
import tempfile
import time
import traceback


def _run_child(request: dict, out_path: str, err_path: str) -> None:
    """In the forked child: become the tool's process and never return."""
    code = 1
    try:
        os.setsid()  # its own group: a timeout kills what it started too
        os.chdir(request['cwd'])
        os.environ.clear()
        os.environ.update(request['env'])
        with open(out_path, 'wb') as out, open(err_path, 'wb') as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        # The interpreter's own streams, now on the files (the server
        # points sys.stdout elsewhere to keep its reply stream clean).
        sys.stdin, sys.stdout, sys.stderr = (
            open(os.devnull), sys.__stdout__, sys.__stderr__)
        tool, *argv = request['args']
        sys.argv = [tool, *argv]
        sys.path.insert(0, os.path.dirname(os.path.abspath(tool)))
        import runpy
        try:
            runpy.run_path(tool, run_name='__main__')
            code = 0
        except SystemExit as exit_:
            if exit_.code is None or isinstance(exit_.code, int):
                code = exit_.code or 0
            else:
                print(exit_.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: B902 - what the interpreter would do
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _serve_one(request: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix='mmpar_tool_') as tmp:
        out_path, err_path = (os.path.join(tmp, n) for n in ('out', 'err'))
        for stream in (sys.stdout, sys.stderr, sys.__stdout__):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(request, out_path, err_path)
        deadline = time.monotonic() + request.get('timeout', 600)
        timed_out = False
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        returncode = os.waitstatus_to_exitcode(status)
        with open(out_path, errors='replace') as out, \
                open(err_path, errors='replace') as err:
            reply = dict(returncode=returncode, stdout=out.read(),
                         stderr=err.read(), timed_out=timed_out)
    return reply


def main() -> None:
    # What every tool imports before reading its config: paid once here.
    import torch  # noqa: F401
    import mmengine.runner  # noqa: F401
    import mmpar.cli  # noqa: F401
    import mmpar.runner  # noqa: F401
    replies = sys.stdout
    sys.stdout = sys.stderr  # nothing but replies on the reply stream
    print('ready', file=replies, flush=True)
    for line in sys.stdin:
        reply = _serve_one(json.loads(line))
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == '__main__':
    main()
