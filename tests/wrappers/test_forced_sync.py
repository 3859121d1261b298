"""forced_sync in buckets (MMDistributedDataParallel, MMNaiveDataParallel).

On 2 gloo ranks with accumulative_counts=2 and active clipping (clip=0.05,
far below the gradient norm): a non-final micro-batch makes no collective
call, the final one makes exactly one all-reduce per bucket, and training
with several small buckets (so buckets start during backward) matches one
process on the global batch.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from mmpar.wrappers import build_model_wrapper, check_wrapper_cfg
from mmpar.wrappers.forced_sync import ForcedSyncBuckets
from tests.toy import (assert_states_close, make_batches, make_model,
                       make_optim_wrapper, shard_batch, train_reference)

ATOL, RTOL = 1e-6, 1e-5  # fp32: only the summation order differs
OPTIM_KWARGS = dict(accumulative_counts=2, clip=0.05)
# ~1 KiB buckets split the toy MLP's 6 parameters into 3 buckets.
SMALL_BUCKETS = 0.001
CFGS = {
    'ddp': dict(type='MMDistributedDataParallel'),
    'naive': dict(type='MMNaiveDataParallel'),
}


@contextlib.contextmanager
def _counting_all_reduce():
    # The wrappers call torch.distributed.all_reduce through the module, so
    # patching the attribute sees every Python-level call.
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _calls_per_micro_batch(cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = build_model_wrapper(cfg, make_model())
    optim_wrapper = make_optim_wrapper(wrapper.module, **OPTIM_KWARGS)
    counts = []
    for batch in make_batches(num_batches=4, batch_size=8):
        with _counting_all_reduce() as calls:
            wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
        counts.append(len(calls))
    return counts, len(wrapper._forced_sync.buckets)


@pytest.mark.parametrize('kind', list(CFGS))
def test_collectives_only_on_final_micro_batch_one_per_bucket(run_dist, kind):
    cfg = dict(CFGS[kind], sync_strategy='forced_sync',
               bucket_cap_mb=SMALL_BUCKETS)
    for counts, num_buckets in run_dist(_calls_per_micro_batch, cfg):
        assert num_buckets == 3
        # micro-batches 1 and 3 are non-final: no communication at all.
        assert counts == [0, num_buckets, 0, num_buckets]


def _train(cfg, batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = build_model_wrapper(cfg, make_model(seed=rank))
    optim_wrapper = make_optim_wrapper(wrapper.module, **OPTIM_KWARGS)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    state = wrapper.module.state_dict()
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize('kind', list(CFGS))
def test_small_buckets_match_single_process(run_dist, kind):
    cfg = dict(CFGS[kind], sync_strategy='forced_sync',
               bucket_cap_mb=SMALL_BUCKETS)
    batches = make_batches(num_batches=6, batch_size=8)
    expected = train_reference(make_model(), batches, **OPTIM_KWARGS)
    for state in run_dist(_train, cfg, batches):
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)


def _unused_on_one_rank():
    # Rank 0 gives the first layer a gradient, rank 1 does not: the buckets
    # still pair up, and the average counts rank 1's contribution as zero.
    # The last layer has no gradient on any rank and keeps .grad = None.
    model = make_model()
    first, last = model.net[0].weight, model.net[4].weight
    reducer = ForcedSyncBuckets(model.parameters(), bucket_cap_mb=0.001)
    first.grad = torch.full_like(first, 2.0) if dist.get_rank() == 0 else None
    for param in model.parameters():
        if param is not first and param is not last:
            param.grad = torch.ones_like(param)
    reducer.finish()
    return (first.grad.unique().tolist(), last.grad is None,
            model.net[2].weight.grad.unique().tolist())


def test_unused_parameters_pair_up_and_stay_none(run_dist):
    for first, last_none, middle in run_dist(_unused_on_one_rank):
        assert first == [1.0]
        assert last_none
        assert middle == [1.0]


def test_naive_bucket_cap_validated_up_front():
    with pytest.raises(ValueError, match='bucket_cap_mb=0 .*allowed'):
        check_wrapper_cfg(dict(type='MMNaiveDataParallel', bucket_cap_mb=0))


def _launched_during_backward(armed):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    reducer = ForcedSyncBuckets(model.parameters(), bucket_cap_mb=0.001)
    if armed:
        reducer.arm()
    batch = shard_batch(make_batches(num_batches=1)[0], rank, world)
    model(**batch, mode='loss')['loss'].backward()
    started = sum(b.handle is not None for b in reducer.buckets)
    reducer.finish()
    return started, len(reducer.buckets)


def test_buckets_start_during_the_armed_backward_only(run_dist):
    for started, num_buckets in run_dist(_launched_during_backward, True):
        # Every parameter got its gradient, so every bucket started before
        # backward returned, none waiting for finish().
        assert started == num_buckets == 3
    for started, _ in run_dist(_launched_during_backward, False):
        assert started == 0
