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
"""
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Iterator

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
        # Leave together. A rank that tears gloo down while a peer is still
        # finishing the last collective can abort at exit ("terminate called
        # without an active exception", seen once in 5 clean 2-rank runs).
        # Only on success: after a failure a barrier would wait for the dead.
        _barrier()
    finally:
        destroy_process_group()
