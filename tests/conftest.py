import gc
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import pool_runner, recycle_leaky

# Token caches (mmpar.datasets.text_files) stay inside the run, not in ~.
os.environ.setdefault('MMPAR_CACHE', tempfile.mkdtemp(prefix='mmpar_cache_'))


def pytest_collection_modifyitems(config, items):
    """Skip ``gpu``-marked tests cleanly on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs CUDA (torch.cuda.is_available() '
                            'is False); run bash tools/gpu_check.sh on a GPU')
    for item in items:
        if item.get_closest_marker('gpu') is not None:
            item.add_marker(skip)


def pytest_unconfigure(config):
    """After the last test: collect once, then freeze what is left.

    pytest's unraisable-exception check, which runs next, collects this
    process five times to find every object whose finalizer raises; each
    full collection walks the ~450,000 objects the session holds (0.3 s
    after two test files; the whole suite's exit came 5.8 s after its
    result line, 0.8 s with this). What this collection frees is still
    reported (a ``__del__`` that raises in a cycle is); the frozen rest is
    what the session keeps alive to its exit (imported modules, shared
    runs).
    """
    gc.collect()
    gc.freeze()


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
    Returns the per-rank results; a failing rank fails the test. Workers
    that gathered too many threads are replaced after the test
    (:func:`tests.dist_harness.recycle_leaky`).
    """
    yield pool_runner(_pools)
    recycle_leaky(_pools)


# -- trained runs shared by several test files (tests/trained.py) ----------
# Read-only: a test that resumes from one writes into its own tmp_path.


@pytest.fixture(scope='session')
def trained_run(_pools, tmp_path_factory):
    """``trained_run(wrapper, fmt)``: the work dir of 3 epochs of the small
    ViT under ``wrapper`` (``tests.trained.CONFIGS`` key or ``ONE``) with
    ``fmt`` checkpoints of every epoch; trained once per session."""
    from tests.trained import TrainedRuns
    return TrainedRuns(tmp_path_factory.mktemp, pool_runner(_pools))


@pytest.fixture(scope='session')
def default_two_rank_run(tmp_path_factory):
    """``bash tools/dist_train.sh configs/vit_digits/vit_digits.py 2`` for 3
    epochs: ``epoch_1.pth`` .. ``epoch_3.pth``, the log with validation of
    every epoch; trained once per session."""
    from tests.trained import train_default_two_ranks
    return train_default_two_ranks(tmp_path_factory.mktemp('default_2rank'),
                                   epochs=3)
