"""Start the suite's Python tool processes without paying their imports.

Every ``python tools/X.py`` and ``python -m torch.distributed.run`` the
suite starts (directly, or through ``bash tools/dist_train.sh``, whose
torchrun starts ``python -u tools/train.py`` per rank) costs seconds of
imports before it reads its config: torch, MMEngine, mmpar. This server (a
subprocess the test session starts once, see :mod:`tests.e2e`) imports them
once, then forks one child per request. The request comes from
``tests/fork_python.py``, the ``python`` the suite's PATH finds first: it
sends its argv, environment, working directory and its own stdin, stdout
and stderr (the file descriptors themselves), then waits for the child's
exit status and exits with it. So each child is a process started the way
the shell or torchrun started it: its argv, environment and streams, its
exit status or signal; a signal sent to the shim reaches the child, and a
shim that dies takes its child with it. What the child shares with the
server is only modules: those imported before any config was read, and a
few that every run imports after, whatever its config (``main``).

Protocol, one Unix-socket connection per process: the shim sends one JSON
object (``argv``, ``env``, ``cwd``) with its fds 0, 1, 2; the server answers
``pid N`` once forked and ``exit STATUS`` (a wait status) when the child
ends.
"""
import gc
import io
import json
import os
import selectors
import signal
import socket
import sys
import traceback
import weakref


def _streams(unbuffered: bool) -> None:
    """Fresh sys.stdin/stdout/stderr on fds 0/1/2, buffered as python's."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, 'r', closefd=False))
    for fd, name in ((1, 'stdout'), (2, 'stderr')):
        raw = io.FileIO(fd, 'w', closefd=False)
        tty = raw.isatty()
        stream = io.TextIOWrapper(
            raw if unbuffered else io.BufferedWriter(raw),
            line_buffering=tty or name == 'stderr',
            write_through=unbuffered, errors='backslashreplace'
            if name == 'stderr' else 'strict')
        setattr(sys, name, stream)
        setattr(sys, f'__{name}__', stream)


def _run(request: dict, fds: list, shim: str) -> int:
    """In the forked child: become ``python ARGV`` and return its status."""
    os.setsid()  # its own group: the server can end what it started
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    # A tool that starts python (torchrun its ranks) starts the shim again.
    sys.executable = shim
    args = list(request['argv'])
    unbuffered = bool(os.environ.get('PYTHONUNBUFFERED'))
    if args and args[0] == '-u':
        unbuffered, args = True, args[1:]
    _streams(unbuffered)
    # As a new interpreter's: numpy's global generator is seeded from the OS
    # at import (MMEngine draws a run's seed from it when the config sets
    # none); a forked child would repeat the server's draws. Python's random
    # reseeds itself in a forked child.
    import numpy
    numpy.random.seed()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL
                      if sig != signal.SIGPIPE else signal.SIG_IGN)
    import runpy
    try:
        if args[0] == '-m':
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name='__main__', alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name='__main__')
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except BaseException:  # noqa: B902 - what the interpreter would do
        traceback.print_exc()
        code = 1
    return code


def _child(conn: socket.socket, request: dict, fds: list, shim: str,
           listener: socket.socket, others: list) -> None:
    """The forked child: never returns."""
    code = 1
    try:
        listener.close()
        for other in others:
            other.close()
        conn.close()
        code = _run(request, fds, shim)
        import atexit
        atexit._run_exitfuncs()
    except BaseException:  # noqa: B902
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _receive(conn: socket.socket):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while not data.endswith(b'\n'):
        more = conn.recv(1 << 20)
        if not more:
            raise ConnectionError('shim closed before its request ended')
        data += more
    return json.loads(data), fds


def serve(path: str, shim: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children = {}  # pid -> connection
    print('ready', flush=True)
    sys.stdout = sys.stderr  # nothing else on the ready line's stream
    while True:
        for key, _ in selector.select(timeout=0.02):
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    request, fds = _receive(conn)
                except (ConnectionError, ValueError, OSError):
                    conn.close()
                    continue
                for stream in (sys.stdout, sys.stderr, sys.__stdout__):
                    stream.flush()
                pid = os.fork()
                if pid == 0:
                    _child(conn, request, fds, shim, listener,
                           list(children.values()))
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                conn.sendall(f'pid {pid}\n'.encode())
                selector.register(conn, selectors.EVENT_READ, pid)
            elif not sock.recv(1):  # the shim died: so does its child
                try:
                    os.killpg(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                selector.unregister(sock)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            try:
                conn.sendall(f'exit {status}\n'.encode())
            except OSError:
                pass
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()


def _method_name(depth: int = 2) -> str:
    """torch's ``dynamic_rendezvous.get_method_name``: the name of the
    function ``depth`` frames up (0: this one), read from the frame."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return 'no_method_name'


def _cheap_rendezvous_method_names() -> None:
    """torchrun's rendezvous names each event it records after the method
    that records it, with ``inspect.stack()`` (twice a call, 9 calls a
    launch): that reads every frame's source line, and finding each
    frame's module walks ``sys.modules``, here the server's ~5,000 (a
    fresh torchrun has far fewer). It cost every served torchrun ~1 s of
    CPU, about as much as one of its ranks' whole run. The same name from
    the frame itself (``inspect.stack()[depth].function`` is that frame's
    ``f_code.co_name``); left alone if torch's function changed."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    original = getattr(dynamic_rendezvous, 'get_method_name', None)
    if original is not None and 'stack' in original.__code__.co_names:
        dynamic_rendezvous.get_method_name = _method_name


def _no_first_round_jitter() -> None:
    """torchrun's rendezvous sleeps a random 0-0.3 s before a node's first
    join (``_delay(seconds=(0, 0.3))`` in ``next_rendezvous``), to skew the
    joins of many nodes on one store; here every launch is one or two
    loopback "nodes" and the sleep, 0.15 s on average, was a third of a
    served ``dist_train.sh --help``, paid by every torchrun the suite starts
    (~90). Only that random delay goes: a fixed one (the 1 s between polls
    while a node waits for the others) is kept. Left alone if torch's
    module changed."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    original = getattr(dynamic_rendezvous, '_delay', None)
    if original is None or original.__code__.co_varnames[:1] != ('seconds',):
        return

    def _delay(seconds) -> None:
        if not isinstance(seconds, tuple):
            original(seconds)

    dynamic_rendezvous._delay = _delay


def cuda_in_use() -> str:
    """Why a child forked from here could not use CUDA, or ''.

    A forked child can initialise CUDA itself only if this process never
    did: torch refuses once its lazy init ran here ("Cannot re-initialize
    CUDA in forked subprocess"), and the driver is not fork-safe once loaded
    (``torch.cuda.is_available()`` without NVML's check, a device count or
    any kernel loads it). ``tests/e2e.py`` starts the server with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, so the availability checks that
    MMEngine's and transformers' imports make ask NVML instead (torch's
    "does not poison fork" route) and children find CUDA untouched, as a new
    interpreter does."""
    import torch
    if torch.cuda.is_initialized():
        return 'torch.cuda is initialized in the fork server'
    try:
        with open('/proc/self/maps') as maps:
            if 'libcuda.so' in maps.read():
                return 'the CUDA driver (libcuda.so) is loaded in the server'
    except OSError:  # not Linux: torch's own check above stands alone
        pass
    return ''


def preload() -> None:
    """Import what the tools import, and cheapen torchrun's rendezvous."""
    # What every tool imports before reading its config: paid once here.
    # Not torch.distributed.run itself: a child runs it as __main__.
    import torch  # noqa: F401
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa
    import torch.distributed.launcher.api  # noqa: F401
    import mmengine.runner  # noqa: F401
    import mmpar.cli  # noqa: F401
    import mmpar.runner  # noqa: F401
    # Imported by every training run after its config is read, whatever the
    # config says (~0.8 s a process): the parallel section's check imports
    # the pipeline schedules (torch._dynamo), and MMEngine's Visualizer, when
    # built, matplotlib's Figure and Agg canvas (matplotlib reads its
    # settings, matplotlibrc and MPL* variables, at import: the suite sets
    # none).
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import mmpar.parallelize.pipeline  # noqa: F401
    # And every Runner's start-up log: MMEngine's collect_env imports
    # distutils.ccompiler (setuptools' copy) on first use; 0.07 s of a
    # process's first collect_env, 0.005 s with it imported here.
    import distutils.ccompiler  # noqa: F401
    _cheap_rendezvous_method_names()
    _no_first_round_jitter()
    # And every Hugging Face model's run (mmpar.models.hf, hf_moe, llama_hf:
    # the fine-tuning, HF Llama and MoE configs) imports transformers'
    # modeling_utils and its model's modeling file: 0.9 s a process, on
    # every rank of every such launch (the Mixtral MoE file alone starts
    # ~20 of them); ~0.01 s each with these here.
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401


def main() -> None:
    path, shim = sys.argv[1:3]
    preload()
    # The same server on a CUDA machine: what it imported must leave CUDA to
    # the children, or it does not start (tests/e2e.py says how to run the
    # suite without it).
    why_not = cuda_in_use()
    if why_not:
        print(f'not fork-safe: {why_not}', flush=True)
        raise SystemExit(1)
    # The finalizers those imports registered (~180, nearly all torch.library
    # operator registrations) are not a child's: its exit (atexit handlers,
    # as mmpar.failures.exit_process runs them) would unregister each
    # operator in a process about to end, 0.03-0.1 CPU-s a process (8 % of a
    # served rank's CPU in test_documented_options). What a child registers
    # itself still runs at its exit.
    for obj in gc.get_objects():
        if isinstance(obj, weakref.finalize):
            obj.atexit = False
    # Out of the collector's sight (Python's advice for a process that
    # forks: https://docs.python.org/3/library/gc.html#gc.freeze): a child's
    # collection then walks only its own objects, not the ~400,000 imported
    # here, whose headers it would write and so copy every page of them. A
    # tool's exit (mmpar.failures.exit_process runs gc.collect) took a
    # served ``tools/train.py --help`` 0.5 s, 0.1 s frozen; dist_train.sh
    # --help on 2 ranks 1.7 s, 0.8 s. The frozen objects are the server's
    # imports; what a child opens or builds is its own.
    gc.freeze()
    serve(path, shim)


if __name__ == '__main__':
    main()
