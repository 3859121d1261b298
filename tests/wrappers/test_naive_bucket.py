"""MMNaiveDataParallel and MMBucketDataParallel on 2 gloo ranks.

Parity: each rank's parameters after training match single-process training
on the global batch and torch DDP, with accumulative_counts=2 and active
clipping (clip=0.05 is far below the gradient norm; see test_ddp.py). With
its hooks removed (a pipeline runs the plain stage) the bucketed wrapper
averages the accumulated gradients when asked.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmpar.wrappers import (MMBucketDataParallel, MMNaiveDataParallel,
                            build_model_wrapper, check_wrapper_cfg)
from mmpar.wrappers.bucket import assign_buckets
from tests.toy import (ToyModel, assert_states_close, make_batches,
                       make_model, make_optim_wrapper, shard_batch,
                       train_reference)

STRATEGIES = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')
# fp32 on CPU: the averaged gradient differs from the big-batch gradient only
# by summation order.
ATOL, RTOL = 1e-6, 1e-5
# bf16 parameters: one bf16 ulp near 0.3 is ~1e-3; a few steps of rounding
# differences between the sharded and the global batch stay within 1e-2.
BF16_ATOL, BF16_RTOL = 1e-2, 1e-2
OPTIM_KWARGS = dict(accumulative_counts=2, clip=0.05)
# ~1 KiB buckets split the toy MLP's 6 parameters into 3 buckets.
WRAPPER_CFGS = {
    'naive': dict(type='MMNaiveDataParallel'),
    'bucket': dict(type='MMBucketDataParallel', bucket_cap_mb=0.001),
}


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_wrapper(cfg, batches, optim_kwargs, dtype=torch.float32):
    rank, world = dist.get_rank(), dist.get_world_size()
    # A different seed per rank: the start-up broadcast must fix it.
    wrapper = build_model_wrapper(cfg, make_model(seed=rank).to(dtype))
    optim_wrapper = make_optim_wrapper(wrapper.module, **optim_kwargs)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    return _state(wrapper.module)


def _train_torch_ddp(batches, optim_kwargs):
    # MMEngine's loop around plain torch DDP.
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    ddp = DistributedDataParallel(model)
    optim_wrapper = make_optim_wrapper(model, **optim_kwargs)
    for batch in batches:
        with optim_wrapper.optim_context(ddp):
            loss = ddp(**shard_batch(batch, rank, world), mode='loss')['loss']
        optim_wrapper.update_params(loss)
    return _state(model)


def _wrapper_and_ddp(cfg, batches, optim_kwargs):
    return (_train_wrapper(cfg, batches, optim_kwargs),
            _train_torch_ddp(batches, optim_kwargs))


@pytest.mark.parametrize('sync_strategy', STRATEGIES)
@pytest.mark.parametrize('kind', list(WRAPPER_CFGS))
def test_matches_single_process_and_torch_ddp(run_dist, kind, sync_strategy):
    cfg = dict(WRAPPER_CFGS[kind], sync_strategy=sync_strategy)
    saved_cfg = copy.deepcopy(cfg)
    batches = make_batches(num_batches=6, batch_size=8)
    expected = train_reference(make_model(), batches, **OPTIM_KWARGS)
    results = run_dist(_wrapper_and_ddp, cfg, batches, OPTIM_KWARGS)
    for state, ddp_state in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        assert_states_close(state, ddp_state, atol=ATOL, rtol=RTOL)
    assert cfg == saved_cfg
    untrained = make_model().state_dict()
    assert not torch.allclose(expected['net.0.weight'],
                              untrained['net.0.weight'])


def _train_manual_loop(cfg, batches, set_to_none):
    # No OptimWrapper: plain optimizer, zero_grad(set_to_none=...) and
    # weight decay, which would expose a gradient buffer that is not zeroed.
    model = make_model()
    wrapper = build_model_wrapper(cfg, model) if cfg else model
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for batch in batches:
        if cfg:
            batch = shard_batch(batch, dist.get_rank(), dist.get_world_size())
        wrapper(**batch, mode='loss')['loss'].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return _state(model)


@pytest.mark.parametrize('set_to_none', [True, False])
def test_bucket_zeroes_between_steps_either_way(run_dist, set_to_none):
    batches = make_batches(num_batches=4, batch_size=8)
    expected = _train_manual_loop(None, batches, set_to_none)
    results = run_dist(_train_manual_loop, WRAPPER_CFGS['bucket'], batches,
                       set_to_none)
    for state in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)


def test_bf16_params_train_like_single_process(run_dist):
    batches = [{k: v.bfloat16()
                for k, v in b.items()}
               for b in make_batches(num_batches=4, batch_size=8)]
    expected = train_reference(make_model().bfloat16(), batches,
                               **OPTIM_KWARGS)
    cfg = dict(WRAPPER_CFGS['bucket'], grad_dtype='float32')
    results = run_dist(_train_wrapper, cfg, batches, OPTIM_KWARGS,
                       torch.bfloat16)
    for state in results:
        assert all(v.dtype == torch.bfloat16 for v in state.values())
        assert_states_close(state, expected, atol=BF16_ATOL, rtol=BF16_RTOL)
    assert_states_close(results[0], results[1], atol=0, rtol=0)


def _accumulate_bf16(grad_dtype):
    # d(loss)/dw = x. Micro-batch gradients 1 and four times 2**-9: in bf16
    # (8 significant bits) 1 + 2**-9 rounds back to 1, so a bf16 accumulator
    # ends at 1.0; an fp32 one at 1 + 2**-7, which bf16 represents exactly.
    layer = nn.Linear(1, 1, bias=False).bfloat16()
    wrapper = MMBucketDataParallel(layer, grad_dtype=grad_dtype)
    xs = [1.0, 2**-9, 2**-9, 2**-9, 2**-9]
    for i, x in enumerate(xs):
        inputs = torch.full((1, 1), x, dtype=torch.bfloat16)
        if i < len(xs) - 1:
            with wrapper.no_sync():
                wrapper(inputs).sum().backward()
        else:
            wrapper(inputs).sum().backward()
    grad = layer.weight.grad
    return grad.dtype, grad.item()


def test_bf16_params_accumulate_in_fp32_main_grad(run_dist):
    assert run_dist(_accumulate_bf16, torch.float32) == [
        (torch.bfloat16, 1 + 2**-7)
    ] * 2
    # The same with a bf16 buffer loses the small gradients: the test above
    # can fail.
    assert run_dist(_accumulate_bf16, 'bfloat16') == [(torch.bfloat16, 1.0)
                                                       ] * 2


class _ParamReducingNaive(MMNaiveDataParallel):
    """picotron's bug: all-reduce the parameter the hook receives."""

    def _average_grad(self, param):
        if self.require_backward_grad_sync:
            dist.all_reduce(param.data, group=self.process_group)
            param.data.div_(self.world_size)


def _grad_error_vs_global_batch(wrapper_cls):
    # One synced backward on this rank's shard; each grad must equal the
    # gradient of the global-batch loss (computed here on a model copy).
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batches(num_batches=1, batch_size=8, seed=rank + 3)[0]
    gathered = [None] * world
    dist.all_gather_object(gathered, batch)
    global_batch = {k: torch.cat([b[k] for b in gathered]) for k in batch}
    wrapper = wrapper_cls(make_model())
    reference = copy.deepcopy(wrapper.module)
    reference(**global_batch, mode='loss')['loss'].backward()
    wrapper(**batch, mode='loss')['loss'].backward()
    return max((p.grad - r.grad).abs().max().item() for p, r in zip(
        wrapper.module.parameters(), reference.parameters()))


def test_hook_reduces_gradients_not_parameters(run_dist):
    for cls in (MMNaiveDataParallel, MMBucketDataParallel):
        assert max(run_dist(_grad_error_vs_global_batch, cls)) < 1e-6
    # The check catches the parameter-reducing hook.
    assert max(run_dist(_grad_error_vs_global_batch,
                        _ParamReducingNaive)) > 1e-2


class BranchyModel(ToyModel):
    """ToyModel with an extra head used only when ``use_extra`` is True."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(8, 4)

    def forward(self, inputs, targets=None, mode='tensor', use_extra=False):
        out = self.net(inputs)
        if use_extra:
            out = out + self.extra(inputs)
        return dict(loss=F.mse_loss(out, targets))


def _train_branchy(kind, use_extra_on_rank0, batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    states = {}
    for name in (kind, 'ddp'):
        torch.manual_seed(0)
        model = BranchyModel()
        if name == 'ddp':
            wrapper = DistributedDataParallel(
                model, find_unused_parameters=True)
        else:
            wrapper = build_model_wrapper(WRAPPER_CFGS[name], model)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        for batch in batches:
            use_extra = use_extra_on_rank0 and rank == 0
            wrapper(**shard_batch(batch, rank, world),
                    use_extra=use_extra)['loss'].backward()
            grad_is_none = model.extra.weight.grad is None
            optimizer.step()
            optimizer.zero_grad()
        states[name] = (_state(model), grad_is_none)
    return states


@pytest.mark.parametrize('kind', list(WRAPPER_CFGS))
def test_parameters_unused_on_every_rank_keep_no_grad(run_dist, kind):
    batches = make_batches(num_batches=3, batch_size=8)
    torch.manual_seed(0)
    model = BranchyModel()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for batch in batches:
        model(**batch)['loss'].backward()
        optimizer.step()
        optimizer.zero_grad()
    for states in run_dist(_train_branchy, kind, False, batches):
        for state, grad_is_none in states.values():
            assert grad_is_none
            assert_states_close(state, _state(model), atol=ATOL, rtol=RTOL)


def test_bucket_parameter_used_on_one_rank_matches_ddp(run_dist):
    batches = make_batches(num_batches=3, batch_size=8)
    for states in run_dist(_train_branchy, 'bucket', True, batches):
        (state, grad_is_none), (ddp_state, ddp_grad_is_none) = (
            states['bucket'], states['ddp'])
        assert not grad_is_none and not ddp_grad_is_none
        assert_states_close(state, ddp_state, atol=ATOL, rtol=RTOL)
    # The extra head trained (on rank 0's data only).
    assert not torch.allclose(state['extra.weight'],
                              BranchyModel().extra.weight)


def _count_bucket_collectives():
    calls = []
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(wrapper._in_backward)
        return all_reduce(tensor, *args, **kwargs)

    wrapper = MMBucketDataParallel(make_model(), bucket_cap_mb=0.001)
    batch = make_batches(num_batches=1, batch_size=4)[0]
    dist.all_reduce = counting_all_reduce
    try:
        with wrapper.no_sync():
            wrapper(**batch, mode='loss')['loss'].backward()
        calls_in_no_sync = len(calls)
        wrapper(**batch, mode='loss')['loss'].backward()
    finally:
        dist.all_reduce = all_reduce
    return calls_in_no_sync, calls, len(wrapper._buckets)


def test_bucket_launches_each_bucket_once_during_backward(run_dist):
    for calls_in_no_sync, calls, num_buckets in run_dist(
            _count_bucket_collectives):
        assert calls_in_no_sync == 0
        assert num_buckets == 3
        # Every bucket was launched from a gradient hook, i.e. while
        # backward was still running, not from the end-of-backward callback.
        assert calls == [True] * num_buckets


def _val_and_test_step(cfg):
    # A different seed per rank: the wrapper predicts with rank 0's weights
    # (the start-up broadcast), whatever this rank was built with.
    rank = dist.get_rank()
    wrapper = build_model_wrapper(cfg, make_model(seed=rank))
    batch = make_batches(num_batches=1, batch_size=4, seed=7 + rank)[0]
    return batch, wrapper.val_step(batch), wrapper.test_step(batch)


def test_val_and_test_step_predict(run_dist):
    # The oracle: a plain one-process forward of rank 0's weights, in this
    # process, on a model object the wrapper never saw.
    reference = make_model(seed=0).eval()
    for cfg in WRAPPER_CFGS.values():
        for batch, val, test in run_dist(_val_and_test_step, cfg):
            with torch.no_grad():
                expected = reference(batch['inputs'], mode='predict')
            torch.testing.assert_close(val, expected, rtol=0, atol=0)
            torch.testing.assert_close(test, expected, rtol=0, atol=0)


def test_assign_buckets_reverse_order_and_cap():
    params = [torch.empty(n) for n in (4, 4, 10, 2, 2)]
    # cap of 6 elements (itemsize 1): the 10-element tensor is alone.
    assert assign_buckets(params, cap_bytes=6, itemsize=1) == [[4, 3], [2],
                                                                [1], [0]]
    assert assign_buckets(params, cap_bytes=100, itemsize=4) == [[4, 3, 2, 1,
                                                                  0]]


@pytest.mark.parametrize('key,value,message', [
    ('bucket_cap_mb', 0, 'bucket_cap_mb=0 .*allowed: a number of MiB > 0'),
    ('bucket_cap_mb', -1.5, 'bucket_cap_mb=-1.5 .*allowed'),
    ('bucket_cap_mb', '25', "bucket_cap_mb='25' .*allowed"),
    ('grad_dtype', torch.int32,
     'grad_dtype=torch.int32 .*allowed: float32, float64, bfloat16'),
    ('grad_dtype', 'fp8', "grad_dtype='fp8' .*allowed: float32"),
])
def test_bad_bucket_args_name_key_value_and_choices(key, value, message):
    cfg = {'type': 'MMBucketDataParallel', key: value}
    saved = dict(cfg)
    with pytest.raises(ValueError, match=message):
        check_wrapper_cfg(cfg)
    # The constructor checks before any collective (no process group here).
    with pytest.raises(ValueError, match=message):
        MMBucketDataParallel(make_model(), **{key: value})
    assert cfg == saved


@pytest.mark.parametrize('cls', [MMNaiveDataParallel, MMBucketDataParallel])
def test_bad_sync_strategy_raises_before_collectives(cls):
    with pytest.raises(ValueError, match="sync_strategy='often'.*allowed"):
        cls(make_model(), sync_strategy='often')


def _grads_equal_after_first_micro_batch(cfg):
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batches(num_batches=1, batch_size=8)[0]
    wrapper = build_model_wrapper(cfg, make_model())
    optim_wrapper = make_optim_wrapper(wrapper.module, accumulative_counts=2)
    wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    # Equal on every rank iff the elementwise max and min over ranks agree.
    grads_max = torch.cat([p.grad.flatten() for p in wrapper.parameters()])
    grads_min = grads_max.clone()
    dist.all_reduce(grads_max, op=dist.ReduceOp.MAX)
    dist.all_reduce(grads_min, op=dist.ReduceOp.MIN)
    return torch.equal(grads_max, grads_min)


@pytest.mark.parametrize('kind', list(WRAPPER_CFGS))
def test_no_sync_on_non_final_micro_batch(run_dist, kind):
    for sync_strategy, synced in [('single_auto_sync', False),
                                  ('forced_sync', False),
                                  ('multi_auto_sync', True)]:
        cfg = dict(WRAPPER_CFGS[kind], sync_strategy=sync_strategy)
        assert run_dist(_grads_equal_after_first_micro_batch,
                        cfg) == [synced, synced]


def _grads_after_edits(grad_dtype, batches):
    # torch semantics without zero_grad: a second backward accumulates onto
    # whatever .grad holds, including the user's edits.
    if grad_dtype is None:
        model = wrapper = make_model()
    else:
        model = make_model()
        wrapper = MMBucketDataParallel(model, bucket_cap_mb=0.001,
                                       grad_dtype=grad_dtype)
        batches = [
            shard_batch(b, dist.get_rank(), dist.get_world_size())
            for b in batches
        ]
    wrapper(**batches[0], mode='loss')['loss'].backward()
    net = model.net
    net[0].weight.grad = None
    net[2].weight.grad.mul_(0.5)
    net[4].weight.grad = torch.ones_like(net[4].weight)
    wrapper(**batches[1], mode='loss')['loss'].backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize('grad_dtype', ['float32', 'float64'])
def test_bucket_respects_grad_edits_between_backwards(run_dist, grad_dtype):
    # float32: .grad is a view of the bucket; float64: .grad is a copy.
    batches = make_batches(num_batches=2, batch_size=8)
    expected = _grads_after_edits(None, batches)
    for grads in run_dist(_grads_after_edits, grad_dtype, batches):
        assert_states_close(grads, expected, atol=ATOL, rtol=RTOL)


def _grads_without_hooks(batches):
    # What a pipeline schedule does: it runs the plain module, never the
    # wrapper's forward; gradients accumulate in .grad until
    # all_reduce_grads averages them once per step.
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = MMBucketDataParallel(make_model(), bucket_cap_mb=0.001)
    wrapper.remove_grad_hooks()
    model = wrapper.module
    for set_to_none in (True, False, None):
        for batch in batches:
            loss = model(**shard_batch(batch, rank, world),
                         mode='loss')['loss'] / len(batches)
            loss.backward()
        wrapper.all_reduce_grads()
        if set_to_none is None:
            return {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=set_to_none)


def test_bucket_without_hooks_averages_on_request(run_dist):
    batches = make_batches(num_batches=2, batch_size=8)
    model = make_model()
    for batch in batches:
        (model(**batch, mode='loss')['loss'] / len(batches)).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    for grads in run_dist(_grads_without_hooks, batches):
        assert_states_close(grads, expected, ATOL, RTOL)
