"""Run a function on N gloo processes that live for the whole test session.

Starting a process and importing torch and MMEngine costs seconds, so each
world size gets one pool of workers, started on first use and shared by every
test. A rank that raises, or a job that hangs, fails the calling test with
the failing rank's traceback; the pool is then torn down and the next test
starts a fresh one. Workers fork from the suite's fork server where the
tools do (tests/e2e.py), else they are new interpreters; each talks to the
pool over its own Unix socket.
"""
import datetime
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection, wait
from typing import Callable, Dict, List

import torch.distributed as dist

TASK_TIMEOUT_S = 300
# A worker whose thread count passes this is replaced after the test. Groups
# a test does not destroy (some torch and mmpar paths make groups of their
# own) keep their gloo transport threads, and each wakes up now and then: in
# a clean-clone run the 2- and 4-rank pools' workers had reached 270-350
# threads by the last part of the suite and, idle, burned 17-24 % of a core
# each (measured from /proc), 1.3 of the machine's 2 cores together.
MAX_WORKER_THREADS = 96
# After one rank fails, how long the others get to finish before the pool is
# killed (they are usually blocked in a collective the failed rank never
# joined).
GRACE_AFTER_FAILURE_S = 10
# How long a pool waits for its workers to connect (a fresh interpreter
# imports torch first).
CONNECT_TIMEOUT_S = 120


def _serve(rank: int, world_size: int, init_file: str, address: str):
    """A worker: join the gloo world, then run what the pool sends until
    the pool closes the connection or kills this process."""
    conn = Connection(_connect(address))
    conn.send_bytes(pickle.dumps((rank, os.getpid())))
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS='1')
    import torch
    torch.set_num_threads(1)
    dist.init_process_group(
        'gloo',
        init_method=f'file://{init_file}',
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120))
    while True:
        try:
            task = conn.recv_bytes()
        except (EOFError, OSError):
            # The test session is gone (or closed the pool): so is this
            # worker (orphans once spent CPU for an hour).
            os._exit(0)
        saved_env = dict(os.environ)
        try:
            fn, args, kwargs = pickle.loads(task)
            reply = (True, fn(*args, **kwargs))
            # Every rank has made the task's groups before any rank destroys
            # them (_reset_topology): a task may make groups it never uses,
            # and gloo fails a rank still connecting to a peer that already
            # closed its end ("connectFullMesh failed ... Connection closed
            # by peer", seen once in a clean-clone run on 2 loaded cores).
            dist.barrier()
        except BaseException:  # noqa: B902 - report everything to the test
            reply = (False, traceback.format_exc())
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            _reset_topology()
        _send(conn, reply)


def _send(conn: Connection, obj) -> None:
    """Plain pickle both ways: multiprocessing's pickler would share a
    tensor's storage through a handshake keyed on the sender's authkey, which
    a served worker does not share with the test session."""
    try:
        data = pickle.dumps(obj)
    except Exception:  # noqa: B902 - an unpicklable result fails the test
        data = pickle.dumps((False, traceback.format_exc()))
    conn.send_bytes(data)


def _connect(address: str) -> int:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    return sock.detach()


def _reset_topology() -> None:
    try:
        from mmpar.parallel import reset_parallelism
    except ImportError:
        return
    reset_parallelism()


class DistPool:
    """``world_size`` gloo processes that run one function at a time."""

    def __init__(self, world_size: int):
        from tests.e2e import ROOT, tool_env, tool_python
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix='mmpar_pool_')
        init_file = os.path.join(self._dir, 'rendezvous')
        address = os.path.join(self._dir, 'socket')
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(world_size)
        listener.settimeout(CONNECT_TIMEOUT_S)
        env = {k: v for k, v in tool_env().items() if k not in (
            'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')}
        # Started as the tools are (tests/e2e.py): forked from the fork
        # server, which imported torch, MMEngine, mmpar and transformers
        # once, where tools are served (a new interpreter paid ~4.5 s of CPU
        # for them, and a clean-clone run starts ~30 workers: a pool is
        # replaced when it fails or gathers threads); else new interpreters.
        self._procs = [subprocess.Popen(
            [tool_python(), '-m', 'tests.dist_harness',
             *map(str, (rank, world_size, init_file, address))],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL)
            for rank in range(world_size)]
        self.broken, self._closed = False, False
        # The workers' own pids (a served one's process is not the shim
        # this process started).
        self._conns, self._pids = [None] * world_size, []
        try:
            for _ in range(world_size):
                sock, _ = listener.accept()
                sock.settimeout(None)
                conn = Connection(sock.detach())
                rank, pid = pickle.loads(conn.recv_bytes())
                self._conns[rank] = conn
                self._pids.append(pid)
        except OSError:
            self.close()
            raise AssertionError(f'the {world_size}-rank test pool did not '
                                 f'start within {CONNECT_TIMEOUT_S} s')
        finally:
            listener.close()

    def run(self, fn: Callable, *args, timeout: float = TASK_TIMEOUT_S,
            **kwargs) -> List:
        """Run ``fn(*args, **kwargs)`` on every rank; return results by rank.

        Raises:
            AssertionError: a rank raised (its traceback is in the message),
                died, or the ranks did not all finish within ``timeout``
                seconds.
        """
        for conn in self._conns:
            conn.send_bytes(pickle.dumps((fn, args, kwargs)))
        results, failures = [None] * self.world_size, {}
        pending = dict(zip(self._conns, range(self.world_size)))
        while pending:
            wait_s = GRACE_AFTER_FAILURE_S if failures else timeout
            ready = wait(list(pending), timeout=wait_s)
            if not ready:
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    ok, payload = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    ok, payload = False, 'its process died'
                if ok:
                    results[rank] = payload
                else:
                    failures[rank] = payload
        if failures or pending:
            self.close()
            report = [f'rank {r} raised:\n{tb}' for r, tb in failures.items()]
            if pending:
                report.append(f'ranks {sorted(pending.values())} did not '
                              f'finish {fn.__name__} (hung or killed)')
            raise AssertionError('\n'.join(report))
        return results

    def max_threads(self) -> int:
        """The largest thread count of its workers (0 where /proc cannot
        tell)."""
        counts = [0]
        for pid in self._pids:
            try:
                counts.append(len(os.listdir(f'/proc/{pid}/task')))
            except OSError:
                pass
        return max(counts)

    def close(self) -> None:
        # Killed, not asked to exit: a worker holds nothing to save, and
        # tearing down torch and gloo cost ~1 s a process (8 s for a pool of
        # 8 on 2 cores) at the end of every session.
        self.broken = True
        if self._closed:  # a failed run closed it already
            return
        self._closed = True
        for pid in self._pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self._procs:  # a served worker's shim, or the worker
            proc.kill()
            proc.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def recycle_leaky(pools: Dict[int, DistPool]) -> None:
    """Close the pools whose workers have gathered more than
    :data:`MAX_WORKER_THREADS` threads (between tests: the next use starts
    fresh workers)."""
    for pool in pools.values():
        if not pool.broken and pool.max_threads() > MAX_WORKER_THREADS:
            pool.close()


def pool_runner(pools: Dict[int, DistPool]) -> Callable:
    """``run(fn, *args, world_size=2, **kwargs)`` on the pool of that world
    size in ``pools`` (started, or restarted after a failure, on demand)."""

    def run(fn, *args, world_size=2, **kwargs):
        pool = pools.get(world_size)
        if pool is None or pool.broken:
            pool = pools[world_size] = DistPool(world_size)
        return pool.run(fn, *args, **kwargs)

    return run


if __name__ == '__main__':  # a worker (see DistPool)
    _serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
