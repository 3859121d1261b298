"""A data-parallel wrapper, once dropped, leaves no model behind.

Its gradient hooks live in C++, where Python's cycle collector does not
look: hooks that held the wrapper kept the model, its gradients and
buckets alive for good (each layout-search trial of such a wrapper left
its model in the job; mmpar.wrappers.weak_hooks).
"""
import gc
import weakref

import pytest
import torch.distributed as dist

from mmpar.wrappers import build_model_wrapper
from tests.toy import (make_batches, make_model, make_optim_wrapper,
                       shard_batch)

# forced_sync adds its own buckets and hooks (ForcedSyncBuckets).
CFGS = {
    'naive': dict(type='MMNaiveDataParallel'),
    'naive forced_sync': dict(type='MMNaiveDataParallel',
                              sync_strategy='forced_sync'),
    'bucket': dict(type='MMBucketDataParallel', bucket_cap_mb=0.001),
    'bucket forced_sync': dict(type='MMBucketDataParallel',
                               bucket_cap_mb=0.001,
                               sync_strategy='forced_sync'),
}


def _alive_after_training(cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = build_model_wrapper(cfg, make_model())
    optim_wrapper = make_optim_wrapper(wrapper.module)
    for batch in make_batches(num_batches=2):
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    params = [weakref.ref(p) for p in wrapper.module.parameters()]
    refs = dict(wrapper=weakref.ref(wrapper), module=weakref.ref(
        wrapper.module), parameter=params[0])
    del wrapper, optim_wrapper
    gc.collect()
    return sorted(name for name, ref in refs.items() if ref() is not None)


@pytest.mark.parametrize('kind', list(CFGS))
def test_a_dropped_wrapper_frees_its_model(run_dist, kind):
    for alive in run_dist(_alive_after_training, CFGS[kind]):
        assert alive == [], f'{kind}: still alive after gc: {alive}'
