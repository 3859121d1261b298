"""End a distributed job fast and loudly when one rank fails.

torchrun already stops the other ranks when one exits non-zero (SIGTERM, then
SIGKILL), and gloo raises on the survivors as soon as the failed rank's
sockets close; a rank that hangs instead is ended by the collective timeout
(``env_cfg.dist_cfg.timeout``). What is left for mmpar is to make the output
say what happened, once:

* the rank that raised logs its traceback, with its rank, through the run's
  logger (console and the work-dir log file), and records a one-line summary
  in torchrun's error file so the launcher's "Root Cause" names it;
* a rank that only failed because a peer went away prints one line instead
  of a second, misleading traceback ("Connection closed by peer"), and waits
  a moment before it exits, so that torchrun (which names as root cause the
  failure with the smallest timestamp in whole seconds, the lower rank on a
  tie) sees the failed rank's exit first and stops this one;
* every rank tears its process group down, and the process exits non-zero.

A tool's process then ends through :func:`exit_process`, whether it failed
or not, without the interpreter's teardown, which can abort a finished run
(see there).
"""
import atexit
import contextlib
import gc
import io
import itertools
import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Iterator, NoReturn, Union

# Messages gloo (and nccl) raise on a rank whose peer died or hung.
PEER_FAILURE_MARKERS = (
    'Connection closed by peer',
    'Connection reset by peer',
    'Broken pipe',
    'NCCL communicator was aborted',
)
TIMEOUT_MARKERS = ('Timed out', 'timed out', 'Watchdog caught collective')
# How long a rank stopped by a peer's failure waits before exiting: more than
# one whole second after the peer recorded its failure (it records before its
# sockets close, which is what this rank noticed), and far above torchrun's
# monitor interval (0.1 s).
PEER_FAILURE_EXIT_DELAY_S = 1.5


class ConfigError(ValueError):
    """A config or command-line value that is not allowed.

    Raised before any process-group work; the message names the key, the bad
    value and what is allowed, so no traceback is printed for it.
    """


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` only says that another rank went away."""
    text = str(err)
    return any(marker in text for marker in PEER_FAILURE_MARKERS)


def _rank() -> int:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get('RANK', os.environ.get('SLURM_PROCID', 0)))


def _log_error(text: str) -> None:
    """Log through the run's MMLogger if one exists, else to stderr."""
    from mmengine.logging import MMLogger
    # Whether any run logger exists (private; get_current_instance would
    # create one).
    if MMLogger._instance_dict:
        MMLogger.get_current_instance().error(text)
    else:
        print(text, file=sys.stderr, flush=True)


def _record_for_torchrun(err: BaseException) -> None:
    """Write torchrun's error file (``TORCHELASTIC_ERROR_FILE``).

    torchrun's failure summary then shows this one line as the root cause
    (and picks the earliest recorded failure as the root cause) instead of
    "To enable traceback see ...". The full traceback is not repeated there:
    it is already in the log.
    """
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return
    message = f'{type(err).__name__}: {err}'.strip()
    data = {
        'message': {
            'message': message,
            'extraInfo': {
                'timestamp': str(int(time.time()))
            }
        }
    }
    try:
        with open(path, 'w') as file:
            json.dump(data, file)
    except OSError:
        pass


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def destroy_process_group() -> None:
    """Destroy the default process group if there is one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """Run a tool's body; on an exception, report it once and exit 1.

    The process group is destroyed in every case. ``SystemExit`` and
    ``KeyboardInterrupt`` pass through unchanged.

    Raises:
        SystemExit: with code 1 when the body raised.
    """
    try:
        yield
    except (SystemExit, KeyboardInterrupt):
        raise
    except ConfigError as err:
        _log_error(f'mmpar: config error: {err}')
        _record_for_torchrun(err)
        raise SystemExit(1) from None
    except BaseException as err:  # noqa: B902 - any failure ends the job
        rank = _rank()
        if is_peer_failure(err):
            first_line = str(err).strip().splitlines()[0]
            _log_error(f'rank {rank}: stopping because another rank failed '
                       f'({first_line}); its traceback is above or in its '
                       'log')
            time.sleep(PEER_FAILURE_EXIT_DELAY_S)
        else:
            hint = ''
            if any(marker in str(err) for marker in TIMEOUT_MARKERS):
                hint = (' (a collective timed out after '
                        'env_cfg.dist_cfg.timeout: another rank hung or is '
                        'stuck elsewhere)')
            _log_error(f'rank {rank} failed{hint}:\n'
                       f'{traceback.format_exc()}')
            _record_for_torchrun(err)
        raise SystemExit(1) from None
    else:
        # Leave together: no rank closes its sockets while a peer is still
        # in the last collective. Only on success: after a failure a barrier
        # would wait for the dead. (The aborts at exit once blamed on this
        # come from the interpreter's teardown: see exit_process.)
        _barrier()
    finally:
        destroy_process_group()


def exit_code(code: Union[int, str, None]) -> int:
    """The status Python exits with for ``SystemExit(code)``: None is 0, a
    non-integer is printed to stderr and is 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def run_and_exit(main: Callable[[], object]) -> NoReturn:
    """Run a tool's ``main()``, then end the process with its status
    through :func:`exit_process` (``SystemExit(code)`` gives ``code``, an
    exception its traceback and 1). ``KeyboardInterrupt`` passes through."""
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_code(exit_.code)
    except KeyboardInterrupt:
        raise
    except BaseException:  # noqa: B902 - what the interpreter would do
        traceback.print_exc()
        code = 1
    exit_process(code)


def exit_process(code: int = 0) -> NoReturn:
    """End the process with ``code``, without the interpreter's teardown.

    Why: torch's gloo worker threads (``pt_gloo_runloop``) outlive
    ``destroy_process_group``: it stops none of them, and a group's backend,
    which joins them when it is freed, stays alive while anything references
    the group (after an FSDP2 run, two of its three gloo backends outlive
    the Runner, ``destroy_process_group`` and ``gc.collect()``).
    Such a thread drops its reference to a finished collective's work some
    time after the caller's ``wait()`` returned, and a barrier's work keeps
    earlier works, and their tensors, until then. Freeing a tensor whose
    Python object the C++ side owns takes the GIL; once the main thread is in
    ``Py_FinalizeEx``, CPython ends a thread that asks for the GIL with
    ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls
    ``std::terminate``: "terminate called without an active exception",
    SIGABRT, and torchrun reports the finished job failed (exit 1). A loaded
    machine, which delays the gloo thread past the main thread's exit, makes
    it likely (benchmarks/bench_clean_exits.py --starve-gloo forces it).
    torch tracks it as https://github.com/pytorch/pytorch/issues/190489
    (open); https://github.com/pytorch/pytorch/pull/179291 tried an atexit
    ``destroy_process_group``, which cannot help while the groups are still
    referenced. The mechanism: https://github.com/pytorch/pytorch/issues/38228.

    So this does what the teardown does that a run's output depends on, with
    the interpreter still whole: join the non-daemon threads, run the atexit
    handlers (logging's flush and close, ``weakref.finalize``, temporary
    directories), flush every open file; then ``os._exit(code)`` ends the
    gloo threads with the process.

    Args:
        code: the exit status.
    """
    try:
        main_thread = threading.main_thread()
        for thread in threading.enumerate():
            if thread is not main_thread and not thread.daemon:
                thread.join()
        # No public way to run the atexit handlers now (the test suite's fork
        # server does the same).
        atexit._run_exitfuncs()
        _flush_open_files()
    finally:
        # os._exit (Python's): no teardown, which can abort a tool.
        os._exit(code)


def _flush_open_files() -> None:
    """Close unreachable files and flush the others, as the teardown
    would (a file a user's hook left open keeps what it wrote)."""
    gc.collect()
    # The files among the (hundreds of thousands of) objects, found by their
    # types in C loops (a Python isinstance loop took 0.4 CPU-s in a rank
    # of 400,000 objects on the test machine, this 0.1).
    objects = gc.get_objects()
    file_types = {kind for kind in set(map(type, objects))
                  if issubclass(kind, io.IOBase)}
    for obj in itertools.compress(objects,
                                  map(file_types.__contains__,
                                      map(type, objects))):
        try:
            if not obj.closed:
                obj.flush()
        except (OSError, ValueError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
