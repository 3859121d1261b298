"""The test pools replace workers that gathered threads (tests/dist_harness.py):
groups a test leaves behind keep gloo transport threads that burn CPU while
the pool idles."""
import os
import threading
import types

from tests.dist_harness import MAX_WORKER_THREADS, DistPool, recycle_leaky


class _FakePool:

    def __init__(self, threads: int):
        self.threads, self.broken = threads, False

    def max_threads(self) -> int:
        return self.threads

    def close(self) -> None:
        self.broken = True


def test_only_pools_past_the_thread_limit_are_closed():
    pools = {2: _FakePool(MAX_WORKER_THREADS), 4: _FakePool(
        MAX_WORKER_THREADS + 1)}
    recycle_leaky(pools)
    assert (pools[2].broken, pools[4].broken) == (False, True)


def test_max_threads_counts_a_workers_threads():
    pool = DistPool.__new__(DistPool)  # its workers: this process
    pool._procs = [types.SimpleNamespace(pid=os.getpid()),
                   types.SimpleNamespace(pid=-1)]  # gone: not counted
    before = pool.max_threads()
    release = threading.Event()
    extra = threading.Thread(target=release.wait)
    extra.start()
    try:
        assert pool.max_threads() == before + 1
    finally:
        release.set()
        extra.join()
