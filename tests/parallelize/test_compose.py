"""parallelize(): every data-parallel wrapper on a 2 x 2 data layout
(dp_replicate=2, dp_shard=2) at 4 gloo ranks matches one process, with
gradient accumulation and active global-norm clipping; layouts whose
techniques are missing are refused."""
import pytest
import torch
import torch.distributed as dist

from mmpar.failures import ConfigError
from tests.toy import (assert_states_close, make_batches, make_model,
                       make_optim_wrapper, shard_batch, train_reference)

# fp32 on CPU: sharded / hybrid reductions differ from the big batch only by
# summation order.
ATOL, RTOL = 1e-6, 1e-5
CLIP = 0.05  # far below the gradient norm here: clipping is active
LAYOUT = dict(dp_replicate=2, dp_shard=2)
WRAPPERS = {
    'ddp': dict(type='MMDistributedDataParallel'),
    'naive': dict(type='MMNaiveDataParallel'),
    'bucket': dict(type='MMBucketDataParallel', bucket_cap_mb=0.001),
    'fsdp1': dict(type='MMFullyShardedDataParallel',
                  fsdp_auto_wrap_policy=dict(type='module_class',
                                             module_classes=['Linear'])),
    'fsdp2': dict(type='MMFullyShard'),
}


def _train_composed(wrapper_cfg, batches, optim_kwargs):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from mmpar.wrappers import describe
    topology = setup_parallelism(LAYOUT, wrapper_cfg)  # reset by harness
    model = parallelize(make_model(), topology, LAYOUT, wrapper_cfg)
    optim_wrapper = make_optim_wrapper(model.module, **optim_kwargs)
    for batch in batches:
        model.train_step(
            shard_batch(batch, topology.dp_rank, topology.dp_size),
            optim_wrapper)
    if describe(model).holds_shards:
        state = model.full_state_dict()
        local = sum(p.numel() for p in _local_params(model))
    else:
        state = {k: v.detach().clone()
                 for k, v in model.module.state_dict().items()}
        local = sum(p.numel() for p in model.parameters())
    return state, local, _strategy(model)


def _local_params(model):
    for param in model.parameters():
        yield param.to_local() if hasattr(param, 'to_local') else param


def _strategy(model):
    strategy = getattr(model, 'sharding_strategy', None)
    if strategy is not None:
        return strategy.name
    mesh = getattr(model, 'device_mesh', None)
    return None if mesh is None else mesh.mesh_dim_names


@pytest.mark.parametrize('name', sorted(WRAPPERS))
def test_every_wrapper_matches_one_process_on_a_2x2_layout(run_dist, name):
    batches = make_batches(num_batches=4, batch_size=8)
    optim_kwargs = dict(accumulative_counts=2, clip=CLIP)
    expected = train_reference(make_model(), batches, **optim_kwargs)
    total = sum(p.numel() for p in make_model().parameters())
    results = run_dist(_train_composed, WRAPPERS[name], batches,
                       optim_kwargs, world_size=4)
    for state, local, strategy in results:
        assert_states_close(state, expected, atol=ATOL, rtol=RTOL)
        if name == 'fsdp1':
            # FULL_SHARD on a 2-D data layout is HSDP: shard over 2 ranks.
            assert strategy == 'HYBRID_SHARD'
            assert local == pytest.approx(total / 2, rel=0.1)
        elif name == 'fsdp2':
            assert strategy == ('dp_replicate', 'dp_shard')
            assert local == pytest.approx(total / 2, rel=0.1)
        else:
            assert local == total
    assert not torch.allclose(expected['net.0.weight'],
                              make_model().state_dict()['net.0.weight'])


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mmpar.parallel import reset_parallelism
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=4)
    yield
    reset_parallelism()


# (tp=2 and pp=2 are no longer refused as such: both techniques landed;
# tests/parallelize/test_tensor_parallel.py, test_pipeline_*.py. A bad
# pipeline section and a model without the pipeline protocol still are.)
@pytest.mark.parametrize('section,named', [
    (dict(pp=2, pipeline=dict(num_stages=2)),
     'parallel.pipeline.num_stages=2 is not allowed'),
    (dict(pp=2, pipeline=dict()), 'ToyModel cannot be pipelined'),
])
def test_missing_techniques_are_refused_before_wrapping(fake_world, section,
                                                        named):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    wrapper_cfg = dict(type='MMDistributedDataParallel')
    topology = setup_parallelism(section, wrapper_cfg)
    with pytest.raises(ConfigError, match=named):
        parallelize(make_model(), topology, section, wrapper_cfg)


def test_no_topology_leaves_the_model_alone():
    from mmpar.parallelize.compose import parallelize
    model = make_model()
    assert parallelize(model, None, None, None) is model


PP_TP = dict(pp=2, tp=2, pipeline=dict(schedule='1F1B'))


@pytest.mark.parametrize('changes,error,named', [
    # The plan is checked against the model before the first collective.
    (dict(tp_plan=dict(type='module_plan', plan={'layers.*': 'colwise'})),
     ValueError, ["parallel.tp_plan.plan: 'layers.0' is a Sequential",
                  'splits only nn.Linear']),
    (dict(tp_plan=dict(type='module_plan', plan={'layers.*.5': 'colwise'})),
     ValueError, ["pattern 'layers.*.5' matches no module of PipeMLP"]),
    # The split comes after tensor parallelism; it is still checked.
    (dict(tp_plan=dict(type='module_plan', plan={'head': 'colwise'}),
          pipeline=dict(schedule='1F1B', split_points=['layers.9'])),
     ConfigError, ["split_points: 'layers.9' names no layer"]),
])
def test_pp_x_tp_mistakes_fail_before_training(fake_world, changes, error,
                                               named):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from tests.parallelize.pipeline_cases import make_pipe_model
    section = dict(PP_TP, **changes)
    topology = setup_parallelism(section, None)
    with pytest.raises(error) as err:
        parallelize(make_pipe_model(expand=2), topology, section, None)
    for text in named:
        assert text in str(err.value)


def test_compile_under_pp_is_refused_naming_the_key(fake_world):
    from mmpar.parallel import setup_parallelism
    from mmpar.parallelize.compose import parallelize
    from tests.parallelize.pipeline_cases import make_pipe_model
    section = dict(PP_TP, tp_plan=dict(type='module_plan',
                                       plan={'head': 'colwise'}))
    topology = setup_parallelism(section, None)
    with pytest.raises(ConfigError, match=r"model_compile=\{'per_block': "
                       'True} with parallel.pp=2 is not supported'):
        parallelize(make_pipe_model(), topology, section, None,
                    dict(per_block=True))
