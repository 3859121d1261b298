"""Checkpoint writes that go on in the background, one at a time.

An asynchronous save (``default_hooks.checkpoint.async_save=True``,
docs/fault_tolerance.md) blocks the train loop only to *stage* the state: a
copy in host memory that training can no longer change. The write of that
copy goes on in a thread (:class:`BackgroundSave`); the sharded format hands
it to DCP's ``async_save``, whose own thread this one waits on.

At most one write is in flight: the next save, the end of training and the
end of the run wait for it. What comes after a write (the rename that makes
the checkpoint visible, the ``last_checkpoint`` pointer) runs in the same
thread only once it succeeded, and a failure is kept and raised by the next
:meth:`BackgroundSave.check` or :meth:`BackgroundSave.wait`, never lost.
"""
import threading
import time
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
from mmengine.logging import print_log
from mmengine.utils import apply_to

from mmpar.parallel.mesh import checkpoint_group


class CheckpointSaveError(RuntimeError):
    """A background checkpoint write that failed."""


def stage(state: Any) -> Any:
    """``state`` with every tensor copied to host memory.

    A copy even for tensors already on the CPU (``Tensor.cpu()`` would
    return the same tensor there, which the next optimizer step changes
    while the writer reads it).
    """
    return apply_to(state, lambda x: isinstance(x, torch.Tensor),
                    lambda x: x.detach().to('cpu', copy=True))


class BackgroundSave:
    """At most one checkpoint write in flight, on a thread of its own."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._path: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._finished = True
        self._then: List[Callable[[], None]] = []
        self._group: Optional[dist.ProcessGroup] = None
        self._started = 0.0
        #: Seconds from :meth:`start` to the end of the last successful
        #: write and what followed it (None before one finished).
        self.last_duration: Optional[float] = None

    def group(self) -> Optional[dist.ProcessGroup]:
        """The writer group (:func:`mmpar.parallel.mesh.checkpoint_group`),
        made on first use: a collective, as the sharded save that asks is;
        None without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = checkpoint_group()
        return self._group

    def close(self) -> None:
        """:meth:`wait`, then free the writer group."""
        try:
            self.wait()
        finally:
            group, self._group = self._group, None
            if group is not None and dist.is_initialized():
                dist.destroy_process_group(group)

    @property
    def in_flight(self) -> bool:
        """Whether a write has started and not finished."""
        with self._lock:
            return not self._finished

    def start(self, path: str, write: Callable[[], None]) -> None:
        """Wait for the write in flight (raising its failure), then run
        ``write()`` (which writes ``path``) on a new thread."""
        self.wait()
        with self._lock:
            self._path, self._error = path, None
            self._finished, self._then = False, []
        self._started = time.perf_counter()
        # Not a daemon: an interpreter that ends normally finishes the
        # write (mmpar's tools wait for it explicitly, mmpar.failures ends
        # them with os._exit).
        self._thread = threading.Thread(
            target=self._run, args=(write, ),
            name='mmpar-checkpoint-writer')
        self._thread.start()

    def _run(self, write: Callable[[], None]) -> None:
        try:
            write()
            while True:
                with self._lock:
                    if not self._then:
                        self._finished = True
                        self.last_duration = (time.perf_counter() -
                                              self._started)
                        break
                    then = self._then.pop(0)
                then()
            # How long the write took, in the log of every async save.
            print_log(
                f'checkpoint {self._path} written in the background in '
                f'{self.last_duration:.2f} s', logger='current')
        except BaseException as err:  # noqa: B902 - kept for the caller
            with self._lock:
                self._error, self._finished = err, True

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the write in flight succeeded (in the writer
        thread), or now if none is in flight. Nothing runs after a failed
        write."""
        with self._lock:
            if not self._finished:
                self._then.append(action)
                return
            failed = self._error is not None
        if not failed:
            action()

    def check(self) -> None:
        """Raise the failure of a finished write, once; never blocks.

        Raises:
            CheckpointSaveError: the last write failed (its cause chained).
        """
        with self._lock:
            error, self._error = self._error, None
            path = self._path
        if error is not None:
            raise CheckpointSaveError(
                f'the background write of checkpoint {path!r} failed '
                f'({type(error).__name__}: {error}); the previous complete '
                'checkpoint and last_checkpoint are unchanged') from error

    def wait(self) -> None:
        """Block until no write is in flight, then :meth:`check`."""
        thread = self._thread
        if thread is not None:
            thread.join()
        self.check()
