"""The test pools renew workers that gathered threads (tests/dist_harness.py):
groups a test leaves behind keep gloo transport threads that burn CPU while
the pool idles."""
import os
import threading
import types

import torch
import torch.distributed as dist

from tests.dist_harness import (MAX_WORKER_THREADS, DistPool, pool_runner,
                                recycle_leaky)


class _FakePool:

    def __init__(self, threads: int):
        self.threads, self.broken, self.renewed = threads, False, False

    def max_threads(self) -> int:
        return self.threads

    def renew(self) -> None:
        self.renewed = True


def test_only_pools_past_the_thread_limit_are_renewed():
    pools = {2: _FakePool(MAX_WORKER_THREADS), 4: _FakePool(
        MAX_WORKER_THREADS + 1)}
    recycle_leaky(pools)
    assert (pools[2].renewed, pools[4].renewed) == (False, True)


def _leave_groups(count: int) -> int:
    for _ in range(count):
        dist.barrier(group=dist.new_group([0, 1]))
    return os.getpid()


def _sum_of_ranks() -> float:
    value = torch.tensor(float(dist.get_rank()))
    dist.all_reduce(value)
    return value.item()


def test_a_renewed_pool_keeps_its_processes_and_drops_the_threads(_pools):
    run = pool_runner(_pools)
    pids = run(_leave_groups, 40)  # 40 groups: ~130 threads a worker
    pool = _pools[2]
    assert pool.max_threads() > MAX_WORKER_THREADS
    recycle_leaky(_pools)
    assert not pool.broken and _pools[2] is pool
    assert pool.max_threads() <= 16
    assert run(_leave_groups, 0) == pids  # the same workers
    assert run(_sum_of_ranks) == [1.0, 1.0]  # in a working world


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
