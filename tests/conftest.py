import os

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import DistPool


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests cleanly on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs CUDA (torch.cuda.is_available() '
                            'is False); run bash tools/gpu_check.sh on a GPU')
    for item in items:
        if item.get_closest_marker('gpu') is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_process_state():
    """Restore the environment and drop any process group after each test."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope='session')
def _pools():
    pools = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def run_dist(_pools):
    """``run_dist(fn, *args, world_size=2, **kwargs)`` runs fn on every rank.

    fn must be a module-level function (it is pickled to spawned workers).
    Returns the per-rank results; a failing rank fails the test.
    """

    def run(fn, *args, world_size=2, **kwargs):
        pool = _pools.get(world_size)
        if pool is None or pool.broken:
            pool = _pools[world_size] = DistPool(world_size)
        return pool.run(fn, *args, **kwargs)

    return run
