"""ParallelDims and resolve_dims: the one validator of the named axes (pure,
no process group)."""
import pytest

from mmpar.parallel import ParallelDims, ParallelismError
from mmpar.parallel.config import ParallelConfig


def dims_of(world_size, model_wrapper_cfg=None, **section):
    return ParallelConfig.from_cfg(section).dims(world_size,
                                                 model_wrapper_cfg)


def test_rest_axis_and_properties():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=1, pp=1,
                        world_size=8)
    assert dims.shape == (2, 4, 1, 1, 1, 1) and dims.dp == 8
    assert dims.dp_enabled and dims.dp_shard_enabled
    assert dims.dp_replicate_enabled
    assert not dims.tp_enabled and not dims.pp_enabled
    assert ParallelDims(world_size=1).shape == (1, 1, 1, 1, 1, 1)


@pytest.mark.parametrize('kwargs,named', [
    (dict(dp_replicate=3, dp_shard=-1), ['world size 8 is not divisible',
                                         'dp_replicate=3']),
    (dict(dp_replicate=2, dp_shard=2), ['world size 8 is not',
                                        'dp_replicate=2 * dp_shard=2']),
    (dict(dp_shard=-1, tp=-1), ['dp_shard and tp are both -1']),
    (dict(dp_shard=0), ['parallel.dp_shard=0', 'an int >= 1, or -1']),
    (dict(tp=True), ['parallel.tp=True']),
])
def test_bad_sizes_name_keys_and_numbers(kwargs, named):
    with pytest.raises(ParallelismError) as err:
        ParallelDims(world_size=8, **kwargs)
    assert isinstance(err.value, ValueError)  # a user mistake
    for text in named:
        assert text in str(err.value)


def test_defaults_are_all_data_parallel():
    assert dims_of(4).shape == (1, 4, 1, 1, 1, 1)
    assert dims_of(4, dp_replicate=2).shape == (2, 2, 1, 1, 1, 1)
    assert dims_of(4, dp_shard=2).shape == (2, 2, 1, 1, 1, 1)
    assert dims_of(8, dp_replicate=2, dp_shard=2, tp=2,
                   tp_plan='digits_vit').shape == (2, 2, 1, 1, 1, 2)


def test_pipeline_with_tensor_parallel_is_2d_or_3d():
    # pp x tp, then pp x tp x the data axis (tp innermost, pp next).
    both = dict(tp=2, tp_plan='digits_vit', pp=2, pipeline=dict())
    assert dims_of(4, **both).shape == (1, 1, 1, 2, 1, 2)
    assert dims_of(8, **both).shape == (1, 2, 1, 2, 1, 2)
    assert dims_of(8, dp_replicate=2, **both).shape == (2, 1, 1, 2, 1, 2)
    with pytest.raises(ParallelismError, match='world size 6 is not '
                       'divisible by .*pp=2 \\* tp=2 = 4'):
        dims_of(6, **both)


def test_seed_names_are_aliases():
    assert dims_of(8, model_parallelism=2, tp_plan='digits_vit').tp == 2
    assert dims_of(8, pipeline_parallelism=2, pipeline=dict()).pp == 2
    # The same value under both names is fine.
    assert dims_of(8, tp=2, model_parallelism=2, tp_plan='digits_vit').tp == 2


@pytest.mark.parametrize('section,named', [
    (dict(tp=2, model_parallelism=4, tp_plan='digits_vit'),
     ['parallel.tp=2', 'parallel.model_parallelism=4', 'disagree']),
    (dict(pp=2, pipeline_parallelism=1, pipeline=dict()),
     ['parallel.pp=2', 'parallel.pipeline_parallelism=1']),
])
def test_alias_and_name_disagreeing_is_an_error(section, named):
    with pytest.raises(ParallelismError) as err:
        dims_of(8, **section)
    for text in named:
        assert text in str(err.value)


HYBRID = dict(type='MMFullyShardedDataParallel',
              sharding_strategy='HYBRID_SHARD')


def test_hybrid_model_parallelism_means_dp_shard():
    # The seed's HYBRID_SHARD over (mp, dp) is HSDP.
    assert dims_of(8, HYBRID, model_parallelism=2).shape == (4, 2, 1, 1, 1, 1)
    assert dims_of(8, None, model_parallelism=4, use_fsdp=True,
                   sharding_strategy='HYBRID_SHARD').shape == (2, 4, 1, 1, 1, 1)
    # With a tp_plan, model_parallelism is tensor parallelism again (FSDP2:
    # FSDP1 with tp > 1 is refused).
    assert dims_of(8, dict(HYBRID, type='MMFullyShard'), model_parallelism=2,
                   tp_plan='digits_vit').shape == (1, 4, 1, 1, 1, 2)
    with pytest.raises(ParallelismError, match='dp_shard=4 and parallel.'
                       'model_parallelism=2 disagree'):
        dims_of(8, HYBRID, model_parallelism=2, dp_shard=4)


def test_hybrid_without_axes_shards_within_a_node(monkeypatch):
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '4')
    assert dims_of(8, HYBRID).shape == (2, 4, 1, 1, 1, 1)
    assert dims_of(8, dict(HYBRID, hybrid_shard_size=2)).shape == \
        (4, 2, 1, 1, 1, 1)
    with pytest.raises(ParallelismError,
                       match='hybrid_shard_size=3 is not allowed'):
        dims_of(8, dict(HYBRID, hybrid_shard_size=3))


@pytest.mark.parametrize('section,named', [
    # The old silent-divergence config: default DDP, mp=2, 4 ranks.
    (dict(model_parallelism=2), ['parallel.model_parallelism=2',
                                 'parallel.tp_plan is not set',
                                 "sharding_strategy='HYBRID_SHARD'"]),
    (dict(tp=4), ['parallel.tp=4', 'tp_plan']),
    (dict(pipeline_parallelism=2), ['parallel.pipeline_parallelism=2',
                                    'parallel.pipeline', 'dict(...)']),
    (dict(pp=2), ['parallel.pp=2']),
    # pp with tp still needs both the split and the plan.
    (dict(pp=2, tp=2, pipeline=dict(schedule='1F1B')),
     ['parallel.tp=2', 'parallel.tp_plan is not set']),
    (dict(pp=2, tp=2, tp_plan='digits_vit'),
     ['parallel.pp=2', 'parallel.pipeline']),
])
def test_layouts_that_cannot_train_are_refused(section, named):
    with pytest.raises(ParallelismError) as err:
        dims_of(4, **section)
    for text in named:
        assert text in str(err.value)


def test_single_process_clamps_tp_with_warning():
    with pytest.warns(UserWarning, match='model_parallelism=2 is larger'):
        assert dims_of(1, model_parallelism=2).shape == (1, 1, 1, 1, 1, 1)


@pytest.mark.parametrize('section,named', [
    (dict(tp_plan=None, pipeline='1F1B'), ["parallel.pipeline='1F1B'",
                                            'a dict']),
    (dict(dp_replicate=-2), ['parallel.dp_replicate=-2', 'or -1']),
    (dict(model_parallelism=-1), ['parallel.model_parallelism=-1',
                                  'an int >= 1']),
])
def test_section_types_are_checked(section, named):
    with pytest.raises(ValueError) as err:
        ParallelConfig.from_cfg(section)
    for text in named:
        assert text in str(err.value)


def test_tp_plan_and_pipeline_are_kept_as_given():
    plan, pipeline = (lambda model, tp_mesh: None), dict(num_stages=2,
                                                       schedule='1F1B')
    cfg = ParallelConfig.from_cfg(dict(tp_plan=plan, pipeline=pipeline))
    assert cfg.tp_plan is plan and cfg.pipeline == pipeline


def test_cp_is_an_axis_between_pp_and_tp():
    dims = dims_of(8, cp=2)
    assert dims.shape == (1, 4, 1, 1, 2, 1)
    assert (dims.dp, dims.cp, dims.dp_cp) == (4, 2, 8) and dims.cp_enabled
    both = dict(cp=2, tp=2, tp_plan='llama', pp=2, pipeline=dict())
    assert dims_of(8, **both).shape == (1, 1, 1, 2, 2, 2)
    assert dims_of(8, cp=-1, dp_shard=2).shape == (1, 2, 1, 1, 4, 1)


@pytest.mark.parametrize('world_size,cp', [(6, 4), (4, 3)])
def test_cp_not_dividing_the_world_names_the_key(world_size, cp):
    with pytest.raises(ParallelismError) as err:
        dims_of(world_size, cp=cp)
    assert f'parallel.cp={cp} does not divide the world size ' \
        f'{world_size}; allowed: one of 1, ' in str(err.value)
    with pytest.raises(ValueError, match=r'parallel.cp=0 is not allowed'):
        dims_of(4, cp=0)


def test_cp_layout_groups():
    from mmpar.parallel.layout import layout_of
    # 8 ranks: dp_shard=2 x pp=2 x cp=2 (tp=1): cp inside pp.
    layout = layout_of(dims_of(8, cp=2, pp=2, pipeline=dict()))
    assert layout.groups['cp'] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups['pp'] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups['dp'] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Gradients are reduced over dp x cp; FSDP shards over dp_shard x cp.
    assert layout.groups['dp_cp'] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert layout.groups['dp_shard_cp'] == layout.groups['dp_cp']
    assert layout.coords(6) == (1, 1, 0)


def test_flattened_sizes_and_enabled_flags_are_properties():
    # Made from the axes table, yet visible as any property is (dir(),
    # help(), IDEs): not answered by a __getattr__.
    from mmpar.parallel.axes import AXES, FLATTENED
    names = [*FLATTENED, *(f'{a}_enabled' for a in (*AXES, *FLATTENED))]
    for name in names:
        assert isinstance(vars(ParallelDims).get(name), property), name
