"""The test pools replace workers that gathered threads (tests/dist_harness.py):
groups a test leaves behind keep gloo transport threads that burn CPU while
the pool idles."""
import os
import threading

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
    pool._pids = [os.getpid(), -1]  # -1: gone, not counted
    before = pool.max_threads()
    release = threading.Event()
    extra = threading.Thread(target=release.wait)
    extra.start()
    try:
        assert pool.max_threads() == before + 1
    finally:
        release.set()
        extra.join()


def _rank_and_parent(die_on_rank_1=False):
    import torch.distributed as dist
    if die_on_rank_1 and dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank(), os.getppid()


def test_workers_fork_from_the_fork_server_and_a_dead_one_fails_the_run():
    from tests.e2e import _served, fork_server
    pool = DistPool(2)
    try:
        ranks, parents = zip(*pool.run(_rank_and_parent))
        assert ranks == (0, 1)
        if _served():  # else new interpreters, children of this process
            assert set(parents) == {fork_server().proc.pid}
        try:
            pool.run(_rank_and_parent, True, timeout=60)
        except AssertionError as err:
            assert 'rank 1 raised:\nits process died' in str(err)
        else:
            raise AssertionError('a rank that died did not fail the run')
        assert pool.broken
    finally:
        pool.close()
