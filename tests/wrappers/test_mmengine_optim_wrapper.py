"""Code written for MMEngine's wrappers, under mmpar's: MMEngine's own
``OptimWrapper`` (and a downstream subclass) handed to ``train_step``.

The loop below uses only MMEngine's classes and mmpar's registry, as an
outside project's loop would: ``MODEL_WRAPPERS.build(..., default_args=
dict(module=model))``, then ``wrapper.train_step(batch, optim_wrapper)``
with ``mmengine.optim.OptimWrapper(accumulative_counts=2, clip_grad=...)``.
Every wrapper must train as one process does, and the caller's object must
count and step as MMEngine's own wrapper would have it.
"""
import pytest
import torch
import torch.distributed as dist
from mmengine.optim import OptimWrapper, OptimWrapperDict

from mmpar.registry import MODEL_WRAPPERS
from tests.toy import (assert_states_close, make_batches,
                       make_head_only_model, make_model, shard_batch)

# The bound is rtol 1e-4, atol 1e-5; these are the sibling parity
# tests' (only the summation order differs from one process).
ATOL, RTOL = 1e-6, 1e-5
CLIP = 0.05  # far below the gradient norm: clipping is active
LR, ACCUMULATE, NUM_BATCHES = 0.1, 2, 6
LINEAR = dict(type='module_class', module_classes=['Linear'])
HANG_TIMEOUT_S = 60  # far below the pool's 120 s collective timeout

CASES = {
    'ddp-single': dict(type='MMDistributedDataParallel'),
    'ddp-multi': dict(type='MMDistributedDataParallel',
                      sync_strategy='multi_auto_sync'),
    'ddp-forced': dict(type='MMDistributedDataParallel',
                       sync_strategy='forced_sync'),
    'fsdp1-full': dict(type='MMFullyShardedDataParallel',
                       fsdp_auto_wrap_policy=LINEAR),
    'fsdp1-grad-op': dict(type='MMFullyShardedDataParallel',
                          sharding_strategy='SHARD_GRAD_OP'),
    'fsdp1-hybrid': dict(type='MMFullyShardedDataParallel',
                         sharding_strategy='HYBRID_SHARD',
                         hybrid_shard_size=2, fsdp_auto_wrap_policy=LINEAR),
    'fsdp1-multi': dict(type='MMFullyShardedDataParallel',
                        sync_strategy='multi_auto_sync',
                        fsdp_auto_wrap_policy=LINEAR),
    'fsdp2': dict(type='MMFullyShard', fsdp_auto_wrap_policy=LINEAR),
    'fsdp2-grad-op': dict(type='MMFullyShard',
                          sharding_strategy='SHARD_GRAD_OP'),
    'naive': dict(type='MMNaiveDataParallel'),
    'bucket': dict(type='MMBucketDataParallel', bucket_cap_mb=0.001),
}


class CountingOptimWrapper(OptimWrapper):
    """A downstream project's subclass: its own methods must run."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_steps = 0

    def step(self, **kwargs):
        self.num_steps += 1
        super().step(**kwargs)


def _mmengine_optim_wrapper(model, cls=OptimWrapper):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return cls(optimizer, accumulative_counts=ACCUMULATE,
               clip_grad=dict(max_norm=CLIP))


def _one_process(model, batches, cls=OptimWrapper):
    optim_wrapper = _mmengine_optim_wrapper(model, cls)
    for batch in batches:
        model.train_step(batch, optim_wrapper)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _outside_loop(wrapper_cfg, build_model, batches, cls=OptimWrapper):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = MODEL_WRAPPERS.build(wrapper_cfg,
                                   default_args=dict(module=build_model()))
    # Built on the wrapped parameters, as MMEngine's Runner does.
    optim_wrapper = _mmengine_optim_wrapper(wrapper.module, cls)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    counts = dict(inner_count=optim_wrapper.inner_count,
                  num_steps=getattr(optim_wrapper, 'num_steps', None),
                  clip_func=optim_wrapper.clip_func,
                  own_clip_grad='_clip_grad' in vars(optim_wrapper))
    return wrapper.full_state_dict(), counts


@pytest.mark.parametrize('case', list(CASES))
def test_mmengine_optim_wrapper_matches_one_process(run_dist, case):
    batches = make_batches(num_batches=NUM_BATCHES, batch_size=8)
    expected = _one_process(make_model(), batches)
    results = run_dist(_outside_loop, CASES[case], make_model, batches)
    for state, counts in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        # The caller's counter advanced once per micro-batch, and its
        # clip function is MMEngine's again after every step.
        assert counts['inner_count'] == NUM_BATCHES
        assert counts['clip_func'] is torch.nn.utils.clip_grad_norm_
    untrained = make_model().state_dict()
    assert not torch.allclose(expected['net.0.weight'],
                              untrained['net.0.weight'])


def test_downstream_subclass_runs_its_own_step(run_dist):
    batches = make_batches(num_batches=NUM_BATCHES, batch_size=8)
    expected = _one_process(make_model(), batches, CountingOptimWrapper)
    results = run_dist(_outside_loop, CASES['fsdp1-full'], make_model,
                       batches, CountingOptimWrapper)
    for state, counts in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        assert counts['num_steps'] == NUM_BATCHES // ACCUMULATE


def test_fsdp1_clip_with_a_rank_without_gradients(run_dist):
    # MMEngine's _clip_grad skips the clip on a rank without gradients (rank
    # 0 here: its flat shard holds frozen parameters only); the global-norm
    # clip is a collective, so the ranks went out of step and hung.
    batches = make_batches(num_batches=NUM_BATCHES, batch_size=8)
    expected = _one_process(make_head_only_model(), batches)
    results = run_dist(_outside_loop,
                       dict(type='MMFullyShardedDataParallel'),
                       make_head_only_model, batches, timeout=HANG_TIMEOUT_S)
    for state, counts in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        # The caller's object is MMEngine's again after every step.
        assert counts['clip_func'] is torch.nn.utils.clip_grad_norm_
        assert not counts['own_clip_grad']


def _gpt2():
    from mmpar.models.hf import HFCausalLM
    torch.manual_seed(0)
    return HFCausalLM(config=dict(
        model_type='gpt2', vocab_size=64, n_embd=32, n_layer=2, n_head=2,
        n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _token_batches():
    generator = torch.Generator().manual_seed(3)
    return [dict(inputs=tokens[:, :-1], data_samples=tokens[:, 1:])
            for tokens in (torch.randint(0, 64, (4, 13), generator=generator)
                           for _ in range(4))]


@pytest.mark.parametrize('wrapper_type',
                         ['MMFullyShardedDataParallel', 'MMFullyShard'])
def test_transformers_gpt2_matches_one_process(run_dist, wrapper_type):
    pytest.importorskip('transformers')
    batches = _token_batches()
    expected = _one_process(_gpt2(), batches)
    cfg = dict(type=wrapper_type, fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['GPT2Block']))
    results = run_dist(_outside_loop, cfg, _gpt2, batches)
    for state, counts in results:
        assert_states_close(state, expected, atol=1e-5, rtol=1e-4)
        assert counts['inner_count'] == len(batches)
    assert not torch.allclose(expected['hf_model.transformer.h.0.mlp.c_fc.'
                                       'weight'],
                              _gpt2().state_dict()['hf_model.transformer.'
                                                   'h.0.mlp.c_fc.weight'])


def _refuse_optim_wrapper_dict():
    wrapper = MODEL_WRAPPERS.build(dict(type='MMDistributedDataParallel'),
                                   default_args=dict(module=make_model()))
    optim_wrappers = OptimWrapperDict(
        a=_mmengine_optim_wrapper(wrapper.module))
    batch = make_batches(num_batches=1)[0]
    with pytest.raises(TypeError, match='not an OptimWrapperDict'):
        wrapper.train_step(batch, optim_wrappers)
    with pytest.raises(TypeError, match='got SGD'):
        wrapper.train_step(batch, torch.optim.SGD(
            wrapper.module.parameters(), lr=LR))
    return True


def test_what_cannot_be_adopted_is_refused_by_name(run_dist):
    assert run_dist(_refuse_optim_wrapper_dict) == [True, True]


# ---------------------------------------------- runners that are not mmpar's


def _runner_weights(runner_cls_name, optim_type, work_dir):
    from mmengine.runner import Runner as MMEngineRunner

    from mmpar.runner import Runner
    from tests.trained import small_cfg
    import tests.data.downstream_optim  # noqa: F401 (registers it)
    cfg = small_cfg('configs/vit_digits/vit_digits.py', work_dir, 1,
                    f'{runner_cls_name}_{optim_type}', **dict(
                        val_cfg=None, val_dataloader=None,
                        val_evaluator=None))
    # MMEngine's Runner looks wrappers up in its root registry: a wrapper
    # of another package goes by its scoped name there.
    cfg.model_wrapper_cfg = dict(type='mmpar.MMBucketDataParallel',
                                 sync_strategy='forced_sync')
    cfg.optim_wrapper = dict(type=optim_type, accumulative_counts=2,
                             optimizer=dict(type='SGD', lr=0.05,
                                            momentum=0.9),
                             clip_grad=dict(max_norm=0.5))
    cls = MMEngineRunner if runner_cls_name == 'mmengine' else Runner
    runner = cls.from_cfg(cfg)
    runner.train()
    state = {k: v.detach().clone()
             for k, v in runner.model.module.state_dict().items()}
    return state, type(runner.optim_wrapper).__name__, getattr(
        runner.optim_wrapper, 'num_steps', None)


def test_mmengine_runner_with_a_downstream_optim_wrapper(run_dist, tmp_path):
    """MMEngine's own Runner (``runner_type``) builds MMEngine-registered
    optim wrappers and hands them to mmpar's wrapper: the same weights as
    mmpar's Runner with mmpar's optim wrapper."""
    ours = run_dist(_runner_weights, 'mmpar', 'OptimWrapper',
                    str(tmp_path / 'ours'))
    theirs = run_dist(_runner_weights, 'mmengine', 'DownstreamOptimWrapper',
                      str(tmp_path / 'theirs'))
    for (expected, _, _), (state, cls_name, num_steps) in zip(ours, theirs):
        assert cls_name == 'DownstreamOptimWrapper'
        # 1 epoch: 3 iterations at 2 ranks, accumulated by 2 (the last
        # window is cut short by the epoch's end: MMEngine's max count).
        assert num_steps == 2
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)


class OwnUpdateParams(OptimWrapper):
    """A downstream subclass that changes update_params (halves the loss)."""

    def update_params(self, loss, step_kwargs=None, zero_kwargs=None):
        super().update_params(loss * 0.5, step_kwargs, zero_kwargs)


def _adopt(wrapper_cfg):
    from mmpar.failures import ConfigError
    wrapper = MODEL_WRAPPERS.build(wrapper_cfg,
                                   default_args=dict(module=make_model()))
    try:
        wrapper.parallel_optim_wrapper(_mmengine_optim_wrapper(
            wrapper.module, OwnUpdateParams))
    except ConfigError as err:
        return str(err)
    return 'adopted'


def test_a_subclass_with_its_own_update_params_is_refused(run_dist):
    # The wrapper's step calls backward/step/zero_grad, never update_params:
    # the subclass's change would be skipped, training other weights than
    # MMEngine's wrapper with no error. Refused, naming the class.
    for said in run_dist(_adopt, CASES['ddp-single']):
        assert 'OwnUpdateParams overrides update_params' in said, said
