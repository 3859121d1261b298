"""Run a function on N gloo processes that live for the whole test session.

Starting a process and importing torch and MMEngine costs seconds, so each
world size gets one pool of workers, started on first use and shared by every
test. A rank that raises, or a job that hangs, fails the calling test with
the failing rank's traceback; the pool is then torn down and the next test
starts a fresh one.
"""
import datetime
import multiprocessing
import os
import pickle
import queue
import tempfile
import traceback
from typing import Callable, Dict, List

import torch.distributed as dist
import torch.multiprocessing as mp

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


def _worker(rank: int, world_size: int, init_file: str, tasks, results):
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
    parent = multiprocessing.parent_process()
    while True:  # until DistPool.close kills this process
        try:
            fn, args, kwargs = tasks.get(timeout=5)
        except queue.Empty:
            # A killed test session leaves no one to close the pool: its
            # workers go too (orphans once spent CPU for an hour).
            if not parent.is_alive():
                os._exit(0)
            continue
        saved_env = dict(os.environ)
        try:
            result = fn(*args, **kwargs)
            # Pickle here: the queue pickles in a background thread, where a
            # failure is only printed and the test would wait for a result
            # that never comes.
            results.put((rank, True, pickle.loads(pickle.dumps(result))))
        except BaseException:  # noqa: B902 - report everything to the test
            results.put((rank, False, traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            _reset_topology()


def _reset_topology() -> None:
    try:
        from mmpar.parallel import reset_parallelism
    except ImportError:
        return
    reset_parallelism()


class DistPool:
    """``world_size`` gloo processes that run one function at a time."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        # Spawned: forked from a forkserver that preloaded torch, MMEngine
        # and mmpar, a gloo group of the 4-rank pool once failed to connect
        # (connectFullMesh: connection closed by peer) in a clean-clone run;
        # never seen with new interpreters.
        ctx = mp.get_context('spawn')
        fd, self._init_file = tempfile.mkstemp(prefix='mmpar_rdzv_')
        os.close(fd)
        os.unlink(self._init_file)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, self._init_file, self._tasks[rank],
                      self._results),
                daemon=True) for rank in range(world_size)
        ]
        for proc in self._procs:
            proc.start()
        self.broken = False

    def run(self, fn: Callable, *args, timeout: float = TASK_TIMEOUT_S,
            **kwargs) -> List:
        """Run ``fn(*args, **kwargs)`` on every rank; return results by rank.

        Raises:
            AssertionError: a rank raised (its traceback is in the message),
                or the ranks did not all finish within ``timeout`` seconds.
        """
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        results, failures = [None] * self.world_size, {}
        pending = set(range(self.world_size))
        while pending:
            wait = GRACE_AFTER_FAILURE_S if failures else timeout
            try:
                rank, ok, payload = self._results.get(timeout=wait)
            except queue.Empty:
                break
            pending.discard(rank)
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
        if failures or pending:
            self.close()
            report = [f'rank {r} raised:\n{tb}' for r, tb in failures.items()]
            if pending:
                report.append(f'ranks {sorted(pending)} did not finish '
                              f'{fn.__name__} (hung or killed)')
            raise AssertionError('\n'.join(report))
        return results

    def max_threads(self) -> int:
        """The largest thread count of its workers (0 where /proc cannot
        tell)."""
        counts = [0]
        for proc in self._procs:
            try:
                counts.append(len(os.listdir(f'/proc/{proc.pid}/task')))
            except OSError:
                pass
        return max(counts)

    def close(self) -> None:
        # Killed, not asked to exit: a worker holds nothing to save, and
        # tearing down torch and gloo cost ~1 s a process (8 s for a pool of
        # 8 on 2 cores) at the end of every session.
        self.broken = True
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join()
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


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
