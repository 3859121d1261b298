"""Parallel topology: layout, validation, gloo groups, config, plan tool."""
import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mmpar.parallel import (AXES, DIMS, ParallelDims, ParallelismError, check_sizes,
                            default_dp_group, default_group_info,
                            init_parallelism, layout_of, parallel_group_info,
                            parallel_layout, parallelism_is_initialized,
                            reset_parallelism)
from tests.e2e import run_tool
from tests.parallel.grid import (MESH_ORDER, VARYING, VIEWS, layouts,
                                 rank_coordinates)
from tests.parallel.grid import brute_force_groups as grid_groups

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.filterwarnings(
    'ignore:`torch.jit.interface` is deprecated:DeprecationWarning')
MAX_WORLD = 16


def valid_layouts(max_world=MAX_WORLD):
    for world in range(1, max_world + 1):
        for mp in range(1, world + 1):
            for pp in range(1, world // mp + 1):
                if world % (mp * pp) == 0:
                    yield world, mp, pp


def brute_force_groups(world, mp, pp):
    """Groups by definition: enumerate the (dp, pp, mp) grid, mp fastest.

    Two ranks share an mp group when their (dp, pp) coordinates match, a pp
    group when (dp, mp) match, a dp group when (pp, mp) match.
    """
    dp = world // (mp * pp)
    coords = list(itertools.product(range(dp), range(pp), range(mp)))
    keep = dict(mp=(0, 1), pp=(0, 2), dp=(1, 2))  # coordinates held fixed
    groups = {}
    for kind, fixed in keep.items():
        by_key = {}
        for rank, coord in enumerate(coords):
            by_key.setdefault(tuple(coord[i] for i in fixed), []).append(rank)
        groups[kind] = {r: sorted(g) for g in by_key.values() for r in g}
    return groups


# -- layout: pure, every valid (world, mp, pp) up to 16 -----------------------
def test_layout_matches_brute_force_for_every_valid_layout():
    checked = 0
    for world, mp, pp in valid_layouts():
        layout = parallel_layout(world, mp, pp)
        expected = brute_force_groups(world, mp, pp)
        sizes = dict(mp=mp, pp=pp, dp=world // (mp * pp))
        for kind in DIMS:
            listed = layout.groups[kind]
            # The groups of one kind partition the world, each of its size.
            assert sorted(r for g in listed for r in g) == list(range(world))
            assert all(len(g) == sizes[kind] for g in listed)
            for rank in range(world):
                group = layout.group_of(kind, rank)
                assert group == expected[kind][rank], (world, mp, pp, kind,
                                                       rank)
                assert group in listed
        checked += 1
    assert checked > 100  # every layout, not an empty loop


def test_layout_of_matches_brute_force_for_every_named_layout():
    """layout_of (what mesh.py builds from) on every (dp_replicate, dp_shard,
    pp, cp, tp) up to 16 ranks, dp_replicate > 1 and cp > 1 included."""
    checked = 0
    for world in range(1, MAX_WORLD + 1):
        for sizes in layouts(world):
            layout = layout_of(ParallelDims(**dict(zip(MESH_ORDER, sizes)),
                                            world_size=world))
            expected = grid_groups(*sizes)
            for kind in (*VARYING, *VIEWS):
                listed = layout.groups[kind]
                assert sorted(r for g in listed for r in g) == list(
                    range(world))
                for rank in range(world):
                    assert layout.group_of(kind, rank) == \
                        expected[kind][rank], (sizes, kind, rank)
            checked += sizes[0] > 1
    assert checked > 50


def test_layout_of_issue_example():
    layout = parallel_layout(8, 2, 2)
    assert {k: layout.groups[k] for k in DIMS} == dict(
        mp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        pp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        dp=[[0, 4], [1, 5], [2, 6], [3, 7]])


@pytest.mark.parametrize('world', [4, 8, 16])
def test_rank_one_is_not_in_pp_group_of_rank_zero(world):
    # The widely copied formula puts rank 1 in pp group [0, 2] when mp=2.
    layout = parallel_layout(world, 2, 2)
    assert layout.group_of('pp', 1) == [1, 3]
    assert layout.group_of('pp', 0) == [0, 2]


# -- validation ---------------------------------------------------------------
@pytest.mark.parametrize('world,mp,pp,numbers', [
    (6, 4, 1, ('6', 'model_parallelism=4')),
    (8, 2, 3, ('8', '2 * 3 = 6')),
    (4, 1, 3, ('4', '1 * 3 = 3')),
    (4, 0, 1, ('model_parallelism=0', )),
    (4, 1, True, ('pipeline_parallelism=True', )),
])
def test_bad_sizes_name_the_numbers(world, mp, pp, numbers):
    with pytest.raises(ParallelismError) as err:
        check_sizes(world, mp, pp)
    for text in numbers:
        assert text in str(err.value)


def test_model_parallelism_above_world_is_clamped_with_warning():
    with pytest.warns(UserWarning, match='model_parallelism=8 is larger'):
        layout = parallel_layout(4, 8)
    assert (layout.mp, layout.pp, layout.dp) == (4, 1, 1)


def test_init_without_process_group_raises():
    assert not dist.is_initialized()
    with pytest.raises(ParallelismError, match='not initialised'):
        init_parallelism(2)
    with pytest.raises(ParallelismError, match='not initialised'):
        parallel_group_info()
    reset_parallelism()  # safe when nothing was initialised
    assert default_dp_group() is None
    info = default_group_info()
    assert (info.world_size, info.rank, info.global_ranks) == (1, 0, [0])
    x = torch.ones(3)
    assert info.reduce(x) is x and info.gather(x) is x and info.split(x) is x


@pytest.fixture
def fake_world():
    """A fake process group of 8 ranks in this process; this is rank 5."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group('fake', store=FakeStore(), rank=5, world_size=8)
    yield
    reset_parallelism()


def test_init_twice_raises_until_reset(fake_world):
    topology = init_parallelism(2, 2)
    assert parallelism_is_initialized()
    assert parallel_group_info() is topology
    with pytest.raises(ParallelismError, match='already initialised'):
        init_parallelism(2, 2)
    reset_parallelism()
    assert not parallelism_is_initialized()
    assert init_parallelism(4).mp.global_ranks == [4, 5, 6, 7]


def test_fake_world_groups_and_mesh(fake_world):
    topology = init_parallelism(2, 2)
    assert topology.mp.global_ranks == [4, 5] and topology.mp.rank == 1
    assert topology.pp.global_ranks == [5, 7] and topology.pp.rank == 0
    assert topology.dp.global_ranks == [1, 5] and topology.dp.rank == 1
    assert default_dp_group() is topology.dp.group
    # Named axes, tp fastest; the seed's (dp, pp, mp) grid with a leading
    # dp_replicate=1 (mesh dims renamed: the old ('dp', 'pp', 'mp') became
    # ('dp_replicate', 'dp_shard', 'ep', 'pp', 'cp', 'tp') plus a flattened
    # 'dp'; the seed has no ep or cp: size-1 dims).
    mesh = topology.mesh
    assert mesh.mesh_dim_names == AXES
    assert mesh.mesh.tolist() == [[[[[[0, 1]], [[2, 3]]]], [[[[4, 5]],
                                                            [[6, 7]]]]]]
    assert tuple(mesh.get_coordinate()) == (0, 1, 0, 0, 0, 1)
    for dim in ('tp', 'pp', 'cp', 'dp', 'dp_replicate', 'dp_shard',
                'dp_cp'):
        assert mesh[dim].get_group() is getattr(topology, dim).group
    assert topology.mp is topology.tp


def test_bad_sizes_raise_before_any_group(fake_world):
    with pytest.raises(ParallelismError, match='not divisible'):
        init_parallelism(3)
    assert not parallelism_is_initialized()


# -- real gloo groups at world size 4 -----------------------------------------
def _groups_and_collectives(mp, pp, backends):
    rank = dist.get_rank()
    topology = init_parallelism(mp, pp, **backends)
    out = {}
    for kind in DIMS:
        info = getattr(topology, kind)
        # Each member contributes its global rank: the sum proves who joined.
        total = info.reduce(torch.tensor([float(rank)]))
        pending = info.reduce(torch.tensor([1.0]), async_op=True)
        full = torch.arange(4.0 * info.world_size).reshape(info.world_size, 4)
        part = info.split(full, dim=0)
        gathered = info.gather(part, dim=0)
        gathered_async = info.gather(part.t(), dim=1, async_op=True).wait()
        out[kind] = dict(
            ranks=info.global_ranks,
            rank=info.rank,
            world_size=info.world_size,
            total=total.item(),
            count=pending.wait().item(),
            part=part.tolist(),
            roundtrip=torch.equal(gathered, full)
            and torch.equal(gathered_async, full.t()))
    out['mesh'] = tuple(topology.mesh[dim].get_local_rank()
                        for dim in ('dp', 'pp', 'tp'))
    out['dp_group_ok'] = default_dp_group() is topology.dp.group
    return out


@pytest.mark.parametrize('mp,pp,backends', [
    (2, 1, {}), (2, 2, dict(mp_backend='gloo', pp_backend='gloo',
                            dp_backend='gloo')), (1, 2, {}), (4, 1, {})])
def test_gloo_groups_match_layout(run_dist, mp, pp, backends):
    # The seed's (dp, pp, mp) is (dp_replicate=1, dp_shard, pp, tp).
    sizes = (1, 4 // (mp * pp), 1, pp, 1, mp)
    expected = grid_groups(*sizes)
    expected['mp'] = expected['tp']
    coords = rank_coordinates(*sizes)
    results = run_dist(_groups_and_collectives, mp, pp, backends,
                       world_size=4)
    for rank, got in enumerate(results):
        assert got['mesh'] == tuple(coords[rank][axis] for axis in
                                    ('dp_shard', 'pp', 'tp'))
        assert got['dp_group_ok']
        for kind in DIMS:
            ranks = expected[kind][rank]
            group_rank = ranks.index(rank)
            assert got[kind]['ranks'] == ranks
            assert got[kind]['rank'] == group_rank
            assert got[kind]['world_size'] == len(ranks)
            assert got[kind]['total'] == sum(ranks)
            assert got[kind]['count'] == len(ranks)
            assert got[kind]['part'] == [list(range(4 * group_rank,
                                                    4 * group_rank + 4))]
            assert got[kind]['roundtrip']


def _grads_over_data_axis(wrapper_type, model_parallelism):
    from mmpar.parallelize.compose import data_axis_args
    from mmpar.wrappers import build_model_wrapper
    from tests.toy import make_batches, make_model
    topology = init_parallelism(model_parallelism)
    # The data axis as compose hands it to the wrapper.
    cfg = dict(type=wrapper_type)
    wrapper = build_model_wrapper(cfg, make_model(),
                                  default_args=data_axis_args(cfg, topology))
    assert wrapper.process_group is topology.dp.group
    # Data by data rank: tensor-parallel peers read the same batch, so once
    # the dp peers have averaged, every rank holds the same gradient.
    batch = make_batches(num_batches=1, seed=10 + topology.dp_rank)[0]
    wrapper(batch['inputs']).pow(2).mean().backward()
    return topology.dp.global_ranks, wrapper.module.net[0].weight.grad


@pytest.mark.parametrize('model_parallelism', [1, 2])
@pytest.mark.parametrize('wrapper_type', [
    'MMDistributedDataParallel', 'MMNaiveDataParallel', 'MMBucketDataParallel'
])
def test_wrappers_reduce_over_the_data_axis(run_dist, wrapper_type,
                                            model_parallelism):
    # Replaces a test that asserted mp peers end with different gradients:
    # that pinned the silent divergence of issue 11 (each mp peer read other
    # data and nothing reconciled them).
    results = run_dist(_grads_over_data_axis, wrapper_type,
                       model_parallelism, world_size=4)
    groups = [ranks for ranks, _ in results]
    assert groups[0] == ([0, 1, 2, 3] if model_parallelism == 1 else [0, 2])
    reference = _grads_alone(4 // model_parallelism)
    for _, grad in results:
        torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-7)


def _grads_alone(dp):
    """The dp ranks' averaged gradient, computed in one process."""
    from tests.toy import make_batches, make_model
    grads = []
    for dp_rank in range(dp):
        model = make_model()
        batch = make_batches(num_batches=1, seed=10 + dp_rank)[0]
        model(batch['inputs']).pow(2).mean().backward()
        grads.append(model.net[0].weight.grad)
    return torch.stack(grads).mean(0)


def _gloo_threads_after_tp_topologies(rounds):
    """This rank's gloo threads after each of ``rounds`` tensor-parallel
    topologies was built, used by a DTensor redistribute (which fills
    DTensor's caches with its mesh) and torn down."""
    import gc
    import os

    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from mmpar.parallel import reset_parallelism, setup_parallelism

    def gloo_threads():
        names = [open(f'/proc/self/task/{task}/comm').read().strip()
                 for task in os.listdir('/proc/self/task')]
        return sum(name.startswith(('pt_gloo', 'gloo')) for name in names)

    reset_parallelism()
    gc.collect()
    counts = [gloo_threads()]
    for _ in range(rounds):
        topology = setup_parallelism(dims=ParallelDims(tp=2, world_size=2))
        mesh = topology.mesh['tp']
        distribute_tensor(torch.arange(8.), mesh, [Shard(0)]).redistribute(
            mesh, [Replicate()]).to_local()
        del topology, mesh
        reset_parallelism()
        gc.collect()
        counts.append(gloo_threads())
    return counts


def test_a_torn_down_topology_frees_its_groups(run_dist):
    """What the layout search does once per trial: the groups of a torn-down
    tensor-parallel topology end their threads (NCCL: free their
    communicators), although DTensor's caches saw its mesh."""
    for counts in run_dist(_gloo_threads_after_tp_topologies, 3):
        assert counts[1:] == [counts[0]] * 3, counts


# -- the `parallel` config section --------------------------------------------
def test_parallel_config_defaults_and_values():
    from mmpar.parallel.config import ParallelConfig
    assert ParallelConfig.from_cfg(None) == ParallelConfig()
    cfg = ParallelConfig.from_cfg(
        dict(model_parallelism=2, use_fsdp=True, cpu_offload=True,
             sharding_strategy='HYBRID_SHARD'))
    # Sizes not given stay None, so an alias can be told from a default
    # (was 1): the resolved layout is what counts. HYBRID_SHARD with
    # model_parallelism=2 is the seed's HSDP: dp_shard=2, replicate the rest.
    assert (cfg.model_parallelism, cfg.pipeline_parallelism) == (2, None)
    assert cfg.dims(8) == ParallelDims(dp_replicate=4, dp_shard=2, tp=1,
                                       pp=1, world_size=8)
    assert cfg.fsdp_kwargs == dict(
        cpu_offload=True, sharding_strategy='HYBRID_SHARD',
        sync_module_states=True)


@pytest.mark.parametrize('section,named', [
    (dict(model_paralelism=2), ('model_paralelism=2', 'allowed:',
                                'model_parallelism')),
    (dict(model_parallelism='2'), ("model_parallelism='2'", 'int >= 1')),
    (dict(pipeline_parallelism=True), ('pipeline_parallelism=True', )),
    (dict(pipeline_parallelism=0), ('pipeline_parallelism=0', )),
    (dict(use_fsdp='yes'), ("use_fsdp='yes'", 'True or False')),
    (dict(use_fsdp=True, sharding_strategy='FULL'),
     ("sharding_strategy='FULL'", 'FULL_SHARD', 'HYBRID_SHARD')),
    (dict(cpu_offload=True), ('cpu_offload=True', 'use_fsdp=False')),
    ([1, 2], ('parallel=[1, 2]', )),
])
def test_parallel_config_errors_name_key_value_allowed(section, named):
    from mmpar.parallel.config import ParallelConfig
    with pytest.raises(ValueError) as err:
        ParallelConfig.from_cfg(section)
    for text in named:
        assert text in str(err.value)


def test_default_wrapper_cfg():
    from mmpar.parallel.config import ParallelConfig
    from mmpar.wrappers.builder import default_wrapper_cfg
    assert default_wrapper_cfg(ParallelConfig()) == dict(
        type='MMDistributedDataParallel')
    section = dict(use_fsdp=True, cpu_offload=True)
    first = default_wrapper_cfg(ParallelConfig.from_cfg(section))
    assert first == dict(type='MMFullyShardedDataParallel', cpu_offload=True,
                         sharding_strategy='FULL_SHARD',
                         sync_module_states=True)
    first['cpu_offload'] = False  # a new dict each call
    assert default_wrapper_cfg(
        ParallelConfig.from_cfg(section))['cpu_offload'] is True
    assert section == dict(use_fsdp=True, cpu_offload=True)


def test_setup_parallelism_single_process_warns_and_skips():
    from mmpar.parallel import setup_parallelism
    assert setup_parallelism(None) is None
    with pytest.warns(UserWarning, match='single-process'):
        assert setup_parallelism(dict(model_parallelism=2)) is None
    assert not parallelism_is_initialized()


def test_setup_parallelism_builds_and_reuses(fake_world):
    from mmpar.parallel import setup_parallelism
    # model_parallelism=2 alone is refused now (no tp_plan): a 2-D data
    # layout instead.
    topology = setup_parallelism(dict(dp_replicate=2))
    assert topology.dims.shape == (2, 4, 1, 1, 1, 1)
    assert setup_parallelism(dict(dp_replicate=2)) is topology
    with pytest.raises(ParallelismError, match='already initialised'):
        setup_parallelism(dict(dp_replicate=4))


# -- the plan tool ------------------------------------------------------------
DATA = ROOT / 'tests' / 'data'


def run_plan_tool(*args):
    return run_tool(['python', 'tools/plan.py', *args], timeout=120,
                    check=False)


def test_plan_tool_fsdp_at_world_8():
    proc = run_plan_tool(str(DATA / 'plan_fsdp.py'), '--world-size', '8')
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert 'dp groups: [0, 1, 2, 3, 4, 5, 6, 7]' in out
    assert 'wrapper: MMFullyShardedDataParallel' in out
    assert 'FSDP units (5;' in out and 'blocks.3' in out
    # ceil(2410 / 8) + 4 * ceil(8416 / 8) = 302 + 4 * 1052
    assert 'params                                      4,510' in out
    assert 'optimizer state (AdamW: 2 x params)          9,020' in out


def test_plan_tool_bad_sizes_exit_nonzero_naming_key(capsys):
    # tools/plan.py's main, in-process (the subprocess path is tested above).
    from mmpar.analysis.plan_report import main
    code = main([
        str(DATA / 'plan_ddp.py'), '--world-size', '6', '--cfg-options',
        'parallel.model_parallelism=4'
    ])
    out, err = capsys.readouterr()
    assert code == 2 and out == ''
    assert err.startswith('error: ')
    assert 'model_parallelism=4' in err and 'world size 6' in err


def plan_of(name, world_size, rank=0, **options):
    from mmengine.config import Config
    from mmpar.analysis.plan import make_plan
    cfg = Config.fromfile(str(DATA / name))
    cfg.merge_from_dict(options)
    return make_plan(cfg, world_size, rank)


def test_plan_ddp_groups_and_memory():
    from mmpar.analysis.plan_report import format_plan
    # mp/pp > 1 now need a tp_plan / pipeline split (issue 11); the plan
    # applies the tp_plan (issue 16) and says the pipeline is not applied.
    # The report names the axes (tp, not mp) and DDP's reduction axis is
    # read from the wrapper. (pp x tp is planned in
    # tests/analysis/test_plan.py.)
    plan = plan_of('plan_ddp.py', 8, rank=1,
                   **{'parallel.model_parallelism': 2,
                      'parallel.tp_plan': dict(
                          type='module_plan',
                          plan={'blocks.*.mlp.0': 'colwise',
                                'blocks.*.mlp.2': 'rowwise'})})
    text = format_plan(plan)
    assert 'tp groups: [0, 1] [2, 3] [4, 5] [6, 7]' in text
    assert 'rank 1: tp [0, 1], pp [1], dp_shard [1, 3, 5, 7], ' \
        'dp_replicate [1], dp [1, 3, 5, 7]' in text
    # DDP replicates the tensor-parallel model as MMTensorParallelDDP
    # (issue 16), which holds this rank's tp shards.
    assert plan.wrapper_type == 'MMTensorParallelDDP'
    assert plan.axes == {'reduce': ('dp', [1, 3, 5, 7])}
    assert 'all-reduces gradients over the dp axis: [1, 3, 5, 7]' in text
    from tests.data.plan_model import PlanToyNet
    split = sum(b.mlp[0].weight.numel() + b.mlp[0].bias.numel() +
                b.mlp[2].weight.numel() for b in PlanToyNet().blocks)
    numel = plan.param_numel - split // 2
    assert plan.memory == [('params', numel, 4 * numel),
                           ('grads', numel, 4 * numel),
                           ('optimizer state (SGD: 1 x params)', numel,
                            4 * numel)]
    assert not dist.is_initialized()  # the fake world is torn down


# FULL_SHARD with mp=2 is now refused (no tp_plan); its 2-D replacement:
# dp_replicate=2 makes FULL_SHARD HSDP over 4-rank shard groups.
@pytest.mark.parametrize('strategy,section,hybrid_size,shard', [
    ('FULL_SHARD', dict(dp_replicate=2), None, 4),
    ('HYBRID_SHARD', dict(model_parallelism=2), None, 2),
    ('HYBRID_SHARD', dict(model_parallelism=1), 4, 4),
    ('NO_SHARD', dict(model_parallelism=1), None, 1)])
def test_plan_fsdp_units_cover_every_param(strategy, section, hybrid_size,
                                           shard):
    plan = plan_of('plan_fsdp.py', 8,
                   **{'parallel': dict(section, use_fsdp=True),
                      'model_wrapper_cfg.sharding_strategy': strategy,
                      'model_wrapper_cfg.hybrid_shard_size': hybrid_size})
    assert plan.shard_size == shard
    assert sum(u.numel for u in plan.units) == plan.param_numel
    assert [u.name for u in plan.units] == ['(root)'] + [
        f'blocks.{i}' for i in range(4)]
    per_rank = sum(-(-u.numel // shard) for u in plan.units)
    assert plan.memory[0] == ('params', per_rank, 4 * per_rank)


@pytest.mark.parametrize('options,named', [
    # Messages now come from the Runner's own checks (check_config).
    ({'model_wrapper_cfg': dict(type='MMDistributedDataParallel',
                                cpu_offload=True)},
     "model_wrapper_cfg.cpu_offload=True is not allowed; "
     "MMDistributedDataParallel takes no argument 'cpu_offload'"),
    ({'parallel.use_fsdp': True,
      'model_wrapper_cfg': dict(type='MMDistributedDataParallel')},
     'parallel.use_fsdp=True'),
    ({'model_wrapper_cfg': dict(
        type='MMFullyShardedDataParallel',
        fsdp_auto_wrap_policy=dict(type='size_based', min_num_params=10**9))},
     'model_wrapper_cfg.fsdp_auto_wrap_policy='),
    ({'model_wrapper_cfg': dict(
        type='MMFullyShardedDataParallel',
        fsdp_auto_wrap_policy=dict(type='module_class',
                                   module_classes=['Nope']))},
     'model_wrapper_cfg.fsdp_auto_wrap_policy'),
    ({'model_wrapper_cfg': dict(type='MMFullyShardedDataParallel',
                                fsdp_auto_wrap_policy='no_such_policy')},
     "fsdp_auto_wrap_policy='no_such_policy'"),
    ({'model_wrapper_cfg': dict(type='MMDistributedDataParallel',
                                bucket_cap=3)},
     "model_wrapper_cfg.bucket_cap=3 is not allowed"),
    ({'model_wrapper_cfg': dict(type='MMFullyShardedDataParallel',
                                sharding_strategy='HYBRID_SHARD',
                                hybrid_shard_size=3)},
     'model_wrapper_cfg.hybrid_shard_size=3 is not allowed'),
    ({'parallel.pipeline_parallelism': 3},
     'parallel.pipeline_parallelism=3 is pp'),
])
def test_plan_rejects_bad_combinations(options, named):
    from mmpar.analysis.plan import PlanError
    with pytest.raises(PlanError) as err:
        plan_of('plan_ddp.py', 8, **options)
    assert named in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize('policy_cfg', [
    dict(type='module_class', module_classes=['PlanBlock']),
    dict(type='size_based', min_num_params=5000),
])
def test_plan_fsdp_units_match_real_fsdp(fake_world, policy_cfg):
    # Real torch FSDP1 on the fake 8-rank group: its flat parameters are
    # what the plan's arithmetic must reproduce, unit by unit.
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from mmpar.analysis.fsdp_units import fsdp_units, resolve_policy
    from tests.data.plan_model import PlanToyNet
    model = PlanToyNet()
    policy, _ = resolve_policy(policy_cfg, model)
    planned = fsdp_units(model, policy, shard_size=8)
    wrapped = FSDP(model, auto_wrap_policy=policy,
                   device_id=torch.device('cpu'), use_orig_params=False)
    real = [(type(m.module).__name__, m._flat_param._unpadded_unsharded_size
             .numel(), m._flat_param.numel())
            for m in FSDP.fsdp_modules(wrapped)]
    assert sorted((u.cls, u.numel, u.numel_per_rank) for u in planned) == \
        sorted(real)
    assert len(planned) > 1


def test_stale_topology_is_dropped_with_its_default_group(fake_world):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    init_parallelism(2)
    dist.destroy_process_group()  # takes every subgroup with it
    dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=4)
    assert not parallelism_is_initialized()
    assert default_dp_group() is None
    assert init_parallelism(2).dp.global_ranks == [0, 2]


# -- the Runner ---------------------------------------------------------------
VIT_CONFIG = ROOT / 'configs' / 'vit_digits' / 'vit_digits.py'


def test_runner_builds_topology_and_wraps_over_dp_group(fake_world,
                                                       tmp_path,
                                                       monkeypatch):
    # Rank 5 of a fake 8-rank world: the real Runner start-up and DDP
    # wrapper, in one process (gloo reduction over dp: the DDP test above).
    from mmengine.config import Config

    from mmpar.runner import Runner
    for var in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS'):  # else MMEngine warns
        monkeypatch.setenv(var, '1')
    cfg = Config.fromfile(str(VIT_CONFIG))
    cfg.update(work_dir=str(tmp_path), launcher='pytorch',
               parallel=dict(dp_replicate=2))
    runner = Runner.from_cfg(cfg)
    topology = parallel_group_info()
    assert runner.topology is topology
    assert topology.dims.shape == (2, 4, 1, 1, 1, 1)
    assert topology.dp.global_ranks == list(range(8))
    assert type(runner.model).__name__ == 'MMDistributedDataParallel'
    assert runner.model.process_group is topology.dp.group


def test_runner_rejects_bad_parallel_section_up_front(tmp_path):
    from mmengine.config import Config

    from mmpar.runner import Runner
    cfg = Config.fromfile(str(VIT_CONFIG))
    cfg.update(work_dir=str(tmp_path), parallel=dict(model_paralelism=2))
    with pytest.raises(ValueError, match='parallel.model_paralelism=2 is not '
                       'a known key; allowed: model_parallelism'):
        Runner.from_cfg(cfg)
    assert not list(tmp_path.iterdir())  # failed before any work


def test_plan_fsdp2_units_match_real_fully_shard(fake_world):
    # FSDP2 on the fake world's dp mesh dim (rank 5, mp=2 pp=2: dp [1, 5]).
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from mmpar.analysis.fsdp_units import fsdp_units, resolve_policy
    from tests.data.plan_model import PlanBlock, PlanToyNet
    topology = init_parallelism(2, 2)
    model = PlanToyNet()
    policy, _ = resolve_policy(
        dict(type='module_class', module_classes=['PlanBlock']), model)
    planned = fsdp_units(model, policy, shard_size=2, per_param=True)
    for block in model.blocks:
        fully_shard(block, mesh=topology.mesh['dp'])
    fully_shard(model, mesh=topology.mesh['dp'])
    real_units = [n or '(root)' for n, m in model.named_modules()
                  if isinstance(m, FSDPModule)]
    assert [u.name for u in planned] == real_units
    assert all(isinstance(model.blocks[i], PlanBlock) for i in range(4))
    local = sum(p.to_local().numel() for p in model.parameters())
    assert sum(u.numel_per_rank for u in planned) == local
