"""MMDistributedDataParallel: parity with one process, sync strategies."""
import pytest
import torch
import torch.distributed as dist

from mmpar.wrappers import MMDistributedDataParallel, build_model_wrapper
from tests.toy import (assert_states_close, make_batches, make_model,
                       make_optim_wrapper, shard_batch, train_reference)

STRATEGIES = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')
# fp32 on CPU: the all-reduced mean differs from the big-batch mean only by
# summation order.
ATOL, RTOL = 1e-6, 1e-5


def _train_ddp(sync_strategy, batches, optim_kwargs):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    wrapper = MMDistributedDataParallel(model, sync_strategy=sync_strategy)
    optim_wrapper = make_optim_wrapper(wrapper.module, **optim_kwargs)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize('sync_strategy', STRATEGIES)
def test_ddp_matches_single_process(run_dist, sync_strategy):
    batches = make_batches(num_batches=6, batch_size=8)
    # clip=0.05 is far below the gradient norm here, so clipping is active.
    optim_kwargs = dict(accumulative_counts=2, clip=0.05)
    expected = train_reference(make_model(), batches, **optim_kwargs)
    results = run_dist(_train_ddp, sync_strategy, batches, optim_kwargs)
    for state in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
    untrained = make_model().state_dict()
    assert not torch.allclose(expected['net.0.weight'],
                              untrained['net.0.weight'])


def test_clipping_is_active_in_parity_setup():
    model = make_model()
    batch = make_batches(num_batches=1)[0]
    loss = model(**batch, mode='loss')['loss']
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))
    assert norm > 0.05 * 4


def _grads_after_first_micro_batch(sync_strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batches(num_batches=1, batch_size=8)[0]
    wrapper = MMDistributedDataParallel(make_model(), sync_strategy=sync_strategy)
    optim_wrapper = make_optim_wrapper(wrapper.module, accumulative_counts=2)
    wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    grad = wrapper.module.net[0].weight.grad.detach().clone()
    gathered = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(gathered, grad)
    return torch.equal(gathered[0], gathered[1])


@pytest.mark.parametrize('sync_strategy,synced', [('single_auto_sync', False),
                                                   ('forced_sync', False),
                                                   ('multi_auto_sync', True)])
def test_sync_pattern_after_non_final_micro_batch(run_dist, sync_strategy,
                                                  synced):
    results = run_dist(_grads_after_first_micro_batch, sync_strategy)
    assert results == [synced, synced]


def _val_and_test_step():
    wrapper = MMDistributedDataParallel(make_model())
    batch = make_batches(num_batches=1, batch_size=4)[0]
    out_val = wrapper.val_step(batch)
    out_test = wrapper.test_step(batch)
    expected = wrapper.module(batch['inputs'])
    return torch.equal(out_val, expected) and torch.equal(out_test, expected)


def test_val_and_test_step_predict(run_dist):
    assert run_dist(_val_and_test_step) == [True, True]


def test_unknown_sync_strategy_names_the_choices():
    with pytest.raises(ValueError, match="sync_strategy='sometimes'.*"
                       'single_auto_sync, multi_auto_sync, forced_sync'):
        build_model_wrapper(
            dict(type='MMDistributedDataParallel', sync_strategy='sometimes'),
            make_model())


def test_unknown_wrapper_names_the_choices():
    cfg = dict(type='MMNoSuchWrapper', sync_strategy='forced_sync')
    with pytest.raises(ValueError, match="type='MMNoSuchWrapper'.*allowed:.*"
                       'MMDistributedDataParallel'):
        build_model_wrapper(cfg, make_model())
    assert cfg == dict(type='MMNoSuchWrapper', sync_strategy='forced_sync')
