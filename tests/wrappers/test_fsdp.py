"""FSDP1 and FSDP2 wrappers: parity with one process, global-norm clipping,
sharded memory, eval through the root, argument normalisation, policies."""
import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
from mmengine.config import Config
from mmengine.logging import MessageHub
from mmengine.model import is_model_wrapper
from torch import nn
from torch.distributed.fsdp import (BackwardPrefetch, CPUOffload,
                                    FullyShardedDataParallel, MixedPrecision,
                                    MixedPrecisionPolicy, ShardingStrategy)

from mmpar.registry import FSDP_WRAP_POLICIES
from mmpar.wrappers import (MMFullyShard, MMFullyShardedDataParallel,
                            build_model_wrapper, check_wrapper_cfg)
from mmpar.wrappers import fsdp_args
from mmpar.wrappers.policies import (modules_to_wrap, resolve_wrap_policy,
                                     size_based)
from tests.toy import (ToyModel, assert_states_close, make_batches,
                       make_head_only_model, make_model, make_optim_wrapper,
                       shard_batch, train_reference)

FSDP1, FSDP2 = 'MMFullyShardedDataParallel', 'MMFullyShard'
# fp32 on CPU: a sharded reduce-scatter and a global-norm all-reduce differ
# from the big-batch computation only by summation order.
ATOL, RTOL = 1e-6, 1e-5
CLIP = 0.05  # far below the gradient norm here, so clipping is active
FROZEN = 'net.2.bias'
LINEAR_POLICY = dict(type='module_class', module_classes=['Linear'])
HANG_TIMEOUT_S = 60  # far below the pool's 120 s collective timeout

PARITY_CASES = [
    (FSDP1, dict(sharding_strategy='FULL_SHARD',
                 fsdp_auto_wrap_policy=LINEAR_POLICY)),
    (FSDP1, dict(sharding_strategy='SHARD_GRAD_OP')),
    (FSDP1, dict(sharding_strategy='NO_SHARD')),
    # One-rank shard groups: torch would silently skip the gradient sync.
    (FSDP1, dict(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=1,
                 fsdp_auto_wrap_policy=LINEAR_POLICY)),
    (FSDP1, dict(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=2)),
    (FSDP1, dict(sharding_strategy='_HYBRID_SHARD_ZERO2',
                 hybrid_shard_size=1)),
    (FSDP1, dict(sync_strategy='multi_auto_sync',
                 fsdp_auto_wrap_policy=LINEAR_POLICY)),
    (FSDP1, dict(fsdp_auto_wrap_policy=LINEAR_POLICY,
                 activation_checkpointing='Linear')),
    (FSDP2, dict(fsdp_auto_wrap_policy=LINEAR_POLICY)),
    (FSDP2, dict(sharding_strategy='SHARD_GRAD_OP',
                 fsdp_auto_wrap_policy=dict(type='size_based',
                                            min_num_params=100))),
    (FSDP2, dict(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=1,
                 fsdp_auto_wrap_policy=LINEAR_POLICY)),
    (FSDP2, dict(sharding_strategy='HYBRID_SHARD', hybrid_shard_size=2)),
    (FSDP2, dict(sync_strategy='multi_auto_sync',
                 activation_checkpointing=['Linear'])),
]


def _frozen_model() -> ToyModel:
    model = make_model()
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def _wrap(wrapper_type, model, topology=None, **kwargs):
    """Compose's steps 3 and 5: activation checkpointing (the wrapper key
    still names it), then the wrapper over the topology's data axis (the
    whole world without one)."""
    from mmpar.parallelize.activation import (apply_activation_checkpointing,
                                              merge_wrapper_key)
    from mmpar.parallelize.compose import data_axis_args
    ac_cfg, cfg = merge_wrapper_key(None, dict(type=wrapper_type, **kwargs))
    model = apply_activation_checkpointing(model, ac_cfg)
    axis = {} if topology is None else data_axis_args(cfg, topology)
    return build_model_wrapper(cfg, model, default_args=axis)


def _train_sharded(wrapper_type, wrapper_kwargs, batches, optim_kwargs,
                   topology=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = _wrap(wrapper_type, _frozen_model(), topology,
                    **wrapper_kwargs)
    # Built after wrapping: FSDP2 replaces the parameters with DTensors.
    optim_wrapper = make_optim_wrapper(wrapper.module, **optim_kwargs)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    if wrapper_kwargs.get('activation_checkpointing'):
        from mmpar.parallelize.activation import Checkpointed
        assert any(isinstance(m, Checkpointed) for m in wrapper.modules())
    return wrapper.full_state_dict()


def _case_id(case) -> str:
    wrapper_type, kwargs = case
    parts = ['fsdp1' if wrapper_type == FSDP1 else 'fsdp2']
    parts += [str(v if not isinstance(v, dict) else v['type'])
              for v in kwargs.values()]
    return '-'.join(parts)


@pytest.mark.parametrize(
    'wrapper_type,wrapper_kwargs', PARITY_CASES,
    ids=[_case_id(c) for c in PARITY_CASES])
def test_fsdp_matches_single_process(run_dist, wrapper_type,
                                     wrapper_kwargs):
    batches = make_batches(num_batches=6, batch_size=8)
    optim_kwargs = dict(accumulative_counts=2, clip=CLIP)
    expected = train_reference(_frozen_model(), batches, **optim_kwargs)
    results = run_dist(_train_sharded, wrapper_type, wrapper_kwargs, batches,
                       optim_kwargs)
    untrained = _frozen_model().state_dict()
    for state in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(state[FROZEN], untrained[FROZEN],
                                   atol=0, rtol=0)
    assert not torch.allclose(expected['net.0.weight'],
                              untrained['net.0.weight'])


def _train_hybrid_on_topology(model_parallelism, wrapper_type, batches,
                              optim_kwargs):
    from mmpar.parallel import setup_parallelism
    hybrid = dict(sharding_strategy='HYBRID_SHARD')
    # The seed's HSDP spelling: with HYBRID_SHARD, model_parallelism=k means
    # dp_shard=k (was init_parallelism(k), which now means tensor
    # parallelism). Reset by the harness.
    topology = setup_parallelism(dict(model_parallelism=model_parallelism),
                                 dict(type=wrapper_type, **hybrid))
    local_numel = _local_numel(_wrap(wrapper_type, make_model(), topology,
                                     **hybrid))
    state = _train_sharded(wrapper_type, hybrid, batches, optim_kwargs,
                           topology)
    return local_numel, state


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
@pytest.mark.parametrize('model_parallelism', [1, 2])
def test_hybrid_shards_over_the_topology_mp_group(run_dist, wrapper_type,
                                                  model_parallelism):
    batches = make_batches(num_batches=4, batch_size=8)
    optim_kwargs = dict(accumulative_counts=2, clip=CLIP)
    expected = train_reference(_frozen_model(), batches, **optim_kwargs)
    total = sum(p.numel() for p in make_model().parameters())
    for local_numel, state in run_dist(_train_hybrid_on_topology,
                                       model_parallelism, wrapper_type,
                                       batches, optim_kwargs):
        # Sharded over the mp group: mp=1 keeps whole parameters.
        assert local_numel == pytest.approx(total / model_parallelism,
                                            rel=0.1)
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)


BF16 = {
    FSDP1: dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32'),
    FSDP2: dict(param_dtype='bf16', reduce_dtype='fp32'),
}


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_bf16_mixed_precision_keeps_fp32_parameters(run_dist, wrapper_type):
    batches = make_batches(num_batches=2, batch_size=8)
    optim_kwargs = dict(clip=CLIP)
    expected = train_reference(_frozen_model(), batches, **optim_kwargs)
    results = run_dist(_train_sharded, wrapper_type,
                       dict(mixed_precision=BF16[wrapper_type]), batches,
                       optim_kwargs)
    for state in results:
        assert all(v.dtype == torch.float32 for v in state.values())
        # bf16 compute (8 mantissa bits): close to fp32 training, not equal.
        assert_states_close(state, expected, atol=1e-2, rtol=1e-2)
        assert not all(torch.equal(state[k], expected[k]) for k in state)


def _grad_norm_after_step(wrapper_type, batch):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = _wrap(wrapper_type, make_model(),
                    fsdp_auto_wrap_policy=LINEAR_POLICY)
    optim_wrapper = make_optim_wrapper(wrapper.module, clip=CLIP)
    wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    norm = MessageHub.get_current_instance().get_scalar('train/grad_norm')
    return norm.current(), \
        optim_wrapper.clip_func == optim_wrapper.clip_grad_norm


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_clipping_uses_the_global_norm(run_dist, wrapper_type):
    batch = make_batches(num_batches=1, batch_size=8)[0]
    model = make_model()
    model(**batch, mode='loss')['loss'].backward()
    expected = float(
        torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf')))
    results = run_dist(_grad_norm_after_step, wrapper_type, batch)
    for norm, global_clip in results:
        assert norm == pytest.approx(expected, rel=1e-5)
        # mmpar's optim wrapper clips with the one global-norm clip from
        # construction on (no per-step swap).
        assert global_clip


def _train_head_only(batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    wrapper = _wrap(FSDP1, make_head_only_model())
    trainable_numel = sum(p.numel() for p in wrapper.parameters()
                          if p.requires_grad)
    optim_wrapper = make_optim_wrapper(wrapper.module, clip=CLIP)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    norm = MessageHub.get_current_instance().get_scalar('train/grad_norm')
    return wrapper.full_state_dict(), trainable_numel, norm.current()


def test_fsdp1_clip_with_a_rank_without_gradients(run_dist):
    # MMEngine's _clip_grad skips the clip on a rank without gradients;
    # the global-norm clip is a collective, so the other rank used to wait
    # in its all-reduce while this one was in the next all-gather (hang).
    batches = make_batches(num_batches=2, batch_size=8)
    expected = train_reference(make_head_only_model(), batches, clip=CLIP)
    expected_norm = MessageHub.get_current_instance().get_scalar(
        'train/grad_norm').current()
    results = run_dist(_train_head_only, batches, timeout=HANG_TIMEOUT_S)
    assert min(numel for _, numel, _ in results) == 0  # rank 0: none
    for state, _, norm in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        # Logged on every rank, the rank without gradients included.
        assert norm == pytest.approx(expected_norm, rel=1e-5)
    assert expected_norm > CLIP  # clipping was active


def _grad_shapes_after_first_micro_batch(wrapper_type, sync_strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batches(num_batches=1, batch_size=8)[0]
    wrapper = _wrap(wrapper_type, make_model(), sync_strategy=sync_strategy)
    optim_wrapper = make_optim_wrapper(wrapper.module, accumulative_counts=2)
    wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    return [None if p.grad is None else tuple(p.grad.shape)
            for p in wrapper.module.parameters()]


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_no_sync_on_non_final_micro_batch(run_dist, wrapper_type):
    full = [tuple(p.shape) for p in make_model().parameters()]
    # Unsynced: FSDP1 keeps whole local gradients on the original
    # parameters; FSDP2 keeps them on the unsharded parameters and leaves
    # the sharded ``.grad`` unset. Synced: FSDP1 holds flat shards, FSDP2
    # sharded DTensor gradients.
    unsynced = full if wrapper_type == FSDP1 else [None] * len(full)
    for shapes in run_dist(_grad_shapes_after_first_micro_batch,
                           wrapper_type, 'single_auto_sync'):
        assert shapes == unsynced
    for shapes in run_dist(_grad_shapes_after_first_micro_batch,
                           wrapper_type, 'multi_auto_sync'):
        assert shapes != unsynced


def _synced_states():
    rank0_state = make_model(seed=0).state_dict()
    model = make_model(seed=dist.get_rank())  # every rank starts differently
    wrapper = MMFullyShardedDataParallel(model, sync_module_states=True)
    full = wrapper.full_state_dict()
    return all(torch.equal(full[k], rank0_state[k]) for k in rank0_state)


def test_sync_module_states_broadcasts_rank0_on_cpu(run_dist):
    # The `parallel` section's default (use_fsdp=True) sets it; torch's FSDP1
    # refuses it for CPU modules, so the wrapper broadcasts itself.
    assert run_dist(_synced_states) == [True, True]


def _local_param_numel(wrapper_type):
    return _local_numel(
        _wrap(wrapper_type, make_model(), fsdp_auto_wrap_policy=LINEAR_POLICY))


def _local_numel(wrapper) -> int:
    local = [
        p.to_local() if hasattr(p, 'to_local') else p
        for p in wrapper.parameters()
    ]
    return sum(t.numel() for t in local)


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_full_shard_holds_one_nth_of_the_parameters(run_dist, wrapper_type):
    total = sum(p.numel() for p in make_model().parameters())
    per_rank = run_dist(_local_param_numel, wrapper_type)
    assert sum(per_rank) == total
    for numel in per_rank:
        # FSDP2 shards each tensor on dim 0, so rows may split unevenly.
        assert abs(numel - total / 2) <= 0.1 * total


def _eval_steps(wrapper_type):
    batch = make_batches(num_batches=1, batch_size=4)[0]
    expected = make_model()(batch['inputs'])
    # No wrap policy: the root unit holds every parameter, so skipping the
    # root's all-gather would fail.
    wrapper = _wrap(wrapper_type, make_model())
    return [torch.equal(step(batch), expected)
            for step in (wrapper.val_step, wrapper.test_step)]


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_val_and_test_step_run_through_the_root(run_dist, wrapper_type):
    assert run_dist(_eval_steps, wrapper_type) == [[True, True]] * 2


def _custom_policy_units(cfg_path):
    cfg = Config.fromfile(cfg_path)
    wrapper = build_model_wrapper(cfg.model_wrapper_cfg, make_model())
    return sum(isinstance(m, FullyShardedDataParallel)
               for m in wrapper.modules())


def test_custom_policy_through_custom_imports(run_dist, tmp_path):
    cfg_path = tmp_path / 'custom_policy.py'
    cfg_path.write_text(
        "custom_imports = dict(imports=['examples.my_pkg.my_policies'], "
        'allow_failed_imports=False)\n'
        "model_wrapper_cfg = dict(type='MMFullyShardedDataParallel', "
        "fsdp_auto_wrap_policy=dict(type='large_linear', "
        'min_weight_numel=100))\n')
    # ToyModel's Linear weights: 16x8, 16x16, 4x16: two reach 100 elements.
    units = run_dist(_custom_policy_units, str(cfg_path))
    assert units == [3, 3]  # the root and two units


def test_is_model_wrapper_recognises_both():
    for cls in (MMFullyShardedDataParallel, MMFullyShard):
        assert is_model_wrapper(cls.__new__(cls))


# -- argument normalisation (no process group) ------------------------------
def test_cpu_offload_normalised():
    assert fsdp_args.normalize_cpu_offload(None) is None
    assert fsdp_args.normalize_cpu_offload(True) == CPUOffload(True)
    offload = CPUOffload(offload_params=False)
    assert fsdp_args.normalize_cpu_offload(offload) is offload
    with pytest.raises(TypeError, match="cpu_offload='yes'"):
        fsdp_args.normalize_cpu_offload('yes')


@pytest.mark.parametrize('value,expected', [
    (None, None), ('pre', BackwardPrefetch.BACKWARD_PRE),
    ('post', BackwardPrefetch.BACKWARD_POST),
    ('BACKWARD_PRE', BackwardPrefetch.BACKWARD_PRE),
    (BackwardPrefetch.BACKWARD_POST, BackwardPrefetch.BACKWARD_POST)
])
def test_backward_prefetch_normalised(value, expected):
    assert fsdp_args.normalize_backward_prefetch(value) == expected


def test_bad_backward_prefetch_lists_the_choices():
    with pytest.raises(ValueError, match="backward_prefetch='early'.*pre, "
                       'post, BACKWARD_PRE, BACKWARD_POST'):
        fsdp_args.normalize_backward_prefetch('early')


def test_sharding_strategy_normalised():
    assert fsdp_args.normalize_sharding_strategy(
        None) is ShardingStrategy.FULL_SHARD
    for strategy in ShardingStrategy:
        assert fsdp_args.normalize_sharding_strategy(
            strategy.name) is strategy
    with pytest.raises(ValueError, match="'ZERO3'.*FULL_SHARD.*HYBRID_SHARD"):
        fsdp_args.normalize_sharding_strategy('ZERO3')


def test_hybrid_with_one_replica_is_its_plain_strategy():
    # World size 2 on the fake backend (one process): a shard group of both
    # ranks and a one-rank replicate group.
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=2)
    shard, replicate = dist.new_group([0, 1]), dist.new_group([0])
    for hybrid, plain in (('HYBRID_SHARD', 'FULL_SHARD'),
                          ('_HYBRID_SHARD_ZERO2', 'SHARD_GRAD_OP')):
        assert MMFullyShardedDataParallel._data_axis(
            ShardingStrategy[hybrid], (shard, replicate), None, None) == (
                ShardingStrategy[plain], shard)


def test_mixed_precision_from_dtype_names():
    cfg = dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')
    saved = copy.deepcopy(cfg)
    assert fsdp_args.normalize_mixed_precision(cfg) == MixedPrecision(
        torch.bfloat16, torch.float32, torch.float32)
    assert cfg == saved
    assert fsdp_args.normalize_mp_policy(
        dict(param_dtype='bf16', reduce_dtype=torch.float32)
    ) == MixedPrecisionPolicy(torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="param_dtype='bf17'.*bf16"):
        fsdp_args.normalize_mixed_precision(dict(param_dtype='bf17'))
    with pytest.raises(ValueError, match=r"unknown keys \['buffer_dtype'\]"):
        fsdp_args.normalize_mp_policy(cfg)
    with pytest.raises(TypeError, match='mixed_precision'):
        fsdp_args.normalize_mixed_precision('bf16')


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
@pytest.mark.parametrize('key,value,error,match', [
    ('sync_strategy', 'forced_sync', ValueError, 'forced_sync.*not supported'),
    ('sharding_strategy', 'ZERO3', ValueError, 'allowed: FULL_SHARD'),
    ('cpu_offload', 'yes', TypeError, 'cpu_offload'),
    # The names registered when the check runs (other tests may have
    # imported user policies by then), built-ins included.
    ('fsdp_auto_wrap_policy', 'nope', ValueError, 'REGISTERED'),
    ('fsdp_auto_wrap_policy', 3, TypeError, 'fsdp_auto_wrap_policy'),
    ('mixed_precision', dict(param_dtype='int9'), ValueError, 'int9'),
])
def test_check_cfg_rejects_bad_values(wrapper_type, key, value, error,
                                      match):
    cfg = {'type': wrapper_type, key: value}
    if match == 'REGISTERED':
        names = sorted(FSDP_WRAP_POLICIES.module_dict)
        assert {'module_class', 'size_based'} <= set(names)
        match = re.escape('registered: ' + ', '.join(names))
    with pytest.raises(error, match=match):
        check_wrapper_cfg(cfg)
    assert cfg == {'type': wrapper_type, key: value}


@pytest.mark.parametrize('wrapper_type', [FSDP1, FSDP2])
def test_config_check_rejects_bad_activation_checkpointing(wrapper_type):
    # Compose's step now, still spelled in the wrapper's config.
    from mmpar.config_check import check_layout
    from mmpar.failures import ConfigError
    cfg = dict(model_wrapper_cfg=dict(type=wrapper_type,
                                      activation_checkpointing=3))
    with pytest.raises(ConfigError, match='activation_checkpointing=3'):
        check_layout(cfg)


def test_fsdp2_rejects_no_shard():
    with pytest.raises(ValueError, match='NO_SHARD.*MMDistributedData'):
        check_wrapper_cfg(dict(type=FSDP2, sharding_strategy='NO_SHARD'))


# -- policies ---------------------------------------------------------------
def test_policy_resolver_does_not_mutate_and_binds_kwargs():
    model = make_model()
    cfg = dict(type='module_class', module_classes=['Linear'])
    policy = resolve_wrap_policy(cfg, model)
    assert cfg == dict(type='module_class', module_classes=['Linear'])
    assert policy(model.net[0], False, 0) and not policy(model.net[1], False,
                                                         0)
    assert resolve_wrap_policy(None) is None
    assert resolve_wrap_policy('size_based') is size_based
    assert resolve_wrap_policy(size_based) is size_based
    big = resolve_wrap_policy(dict(type='size_based', min_num_params=100))
    assert [m for m in modules_to_wrap(model, big)] == [
        model.net[0], model.net[2]
    ]


def test_module_class_does_not_look_inside_multihead_attention():
    policy = resolve_wrap_policy(LINEAR_POLICY)
    attn = nn.MultiheadAttention(8, 2)
    model = nn.Sequential(nn.Linear(8, 8), attn)
    assert modules_to_wrap(model, policy) == [model[0]]


def test_module_class_name_not_in_model_lists_its_classes():
    with pytest.raises(ValueError, match="'TransformerBlock' matches no "
                       'module in ToyModel.*Linear, Sequential, Tanh'):
        resolve_wrap_policy(
            dict(type='module_class', module_classes=['TransformerBlock']),
            make_model())


def test_unknown_policy_lists_the_registered_names():
    with pytest.raises(ValueError, match="'nope' is not a registered.*"
                       'module_class, size_based'):
        resolve_wrap_policy(dict(type='nope'))


def test_registered_non_callable_is_a_type_error():
    FSDP_WRAP_POLICIES._module_dict['not_callable'] = 42
    try:
        with pytest.raises(TypeError, match="'not_callable'.*not callable"):
            resolve_wrap_policy('not_callable')
    finally:
        del FSDP_WRAP_POLICIES._module_dict['not_callable']


def test_duplicate_policy_refused_unless_forced():

    def policy(module, recurse, nonwrapped_numel):
        return False

    FSDP_WRAP_POLICIES.register_module(name='dup_policy', module=policy)
    try:
        with pytest.raises(KeyError, match='dup_policy is already registered'):
            FSDP_WRAP_POLICIES.register_module(name='dup_policy',
                                               module=size_based)
        FSDP_WRAP_POLICIES.register_module(
            name='dup_policy', module=size_based, force=True)
        assert resolve_wrap_policy('dup_policy') is size_based
    finally:
        del FSDP_WRAP_POLICIES._module_dict['dup_policy']


def test_modules_to_wrap_matches_fsdp1_recursive_wrap():
    from torch.distributed.fsdp.wrap import _recursive_wrap

    class Marker(nn.Module):

        def __init__(self, module):
            super().__init__()
            self.inner = module

    for cfg in (LINEAR_POLICY, dict(type='size_based', min_num_params=100),
                dict(type='size_based', min_num_params=300)):
        model = make_model()
        policy = resolve_wrap_policy(cfg, model)
        chosen = modules_to_wrap(model, policy)
        _recursive_wrap(model, policy, Marker, set(), set(),
                        only_wrap_children=True)
        wrapped = [m.inner for m in model.modules() if isinstance(m, Marker)]
        assert sorted(map(id, chosen)) == sorted(map(id, wrapped)), cfg


def test_hybrid_shard_size_must_divide_world(monkeypatch):
    # The shard size a HYBRID wrapper without a topology uses.
    from mmpar.parallel.dims import node_local_shard
    assert node_local_shard(4, 2) == 2
    monkeypatch.setitem(os.environ, 'LOCAL_WORLD_SIZE', '4')
    assert node_local_shard(4) == 4
    with pytest.raises(ValueError, match='hybrid_shard_size=3'):
        node_local_shard(4, 3)
