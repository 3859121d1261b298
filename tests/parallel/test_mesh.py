"""mesh.py makes every group and mesh; the topology hands out named views.

Fake process group (8 ranks, this process is one of them): the real torch
DeviceMesh and groups, no communication.
"""
import re
from pathlib import Path

import pytest
import torch.distributed as dist

from mmpar.parallel import (AXES, ParallelDims, data_mesh, init_parallelism,
                            reset_parallelism)
from tests.parallel.grid import (MESH_ORDER, VARYING, VIEWS,
                                 brute_force_groups, layouts,
                                 rank_coordinates)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_world(request):
    from torch.testing._internal.distributed.fake_pg import FakeStore
    rank = getattr(request, 'param', 5)
    dist.init_process_group('fake', store=FakeStore(), rank=rank,
                            world_size=8)
    yield rank
    reset_parallelism()


TWO_BY_TWO_TP = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, pp=1,
                             world_size=8)


def test_groups_and_named_meshes_match_the_layout(fake_world):
    topology = init_parallelism(dims=TWO_BY_TWO_TP)
    expected = brute_force_groups(2, 2, 1, 1, 1, 2)
    # rank 5 = (dp_replicate 1, dp_shard 0, pp 0, tp 1): tp fastest.
    assert topology.tp.global_ranks == [4, 5]
    assert topology.dp_shard.global_ranks == [5, 7]
    assert topology.dp_replicate.global_ranks == [1, 5]
    assert topology.dp.global_ranks == [1, 3, 5, 7]
    assert (topology.dp_rank, topology.dp_size) == (2, 4)
    mesh = topology.mesh
    assert mesh.mesh_dim_names == AXES
    for kind in ('tp', 'pp', 'dp', 'dp_replicate', 'dp_shard'):
        info = getattr(topology, kind)
        assert info.global_ranks == expected[kind][5]
        assert mesh[kind].get_group() is info.group
        assert mesh[kind].mesh.tolist() == info.global_ranks
    hsdp = mesh['dp_replicate', 'dp_shard']
    assert hsdp.mesh.tolist() == [[1, 3], [5, 7]]
    assert hsdp.get_group('dp_shard') is topology.dp_shard.group
    # The flattened data axis shares the root (FSDP2 + TP needs that).
    assert mesh['dp']._get_root_mesh() is mesh.root


def _check_rank_against_brute_force(sizes, world_size, rank, expected,
                                    coords):
    """Build the real topology as ``rank`` of a fake world; compare every
    group it made, and every mesh view, with the brute force
    (``expected``: ``brute_force_groups(*sizes)``, ``coords``:
    ``rank_coordinates(*sizes)``, made once for all the ranks checked)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    mine = coords[rank]
    dist.init_process_group('fake', store=FakeStore(), rank=rank,
                            world_size=world_size)
    try:
        topology = init_parallelism(
            dims=ParallelDims(**dict(zip(MESH_ORDER, sizes)),
                              world_size=world_size))
        where = (sizes, rank)
        assert tuple(topology.mesh.get_coordinate()) == tuple(
            mine[axis] for axis in MESH_ORDER), where
        for kind in VARYING:
            want = expected[kind][rank]
            info, view = getattr(topology, kind), topology.mesh[kind]
            # The ranks the process group really holds, not a stored list.
            assert dist.get_process_group_ranks(info.group) == want, \
                (where, kind)
            assert (info.global_ranks, info.rank, info.world_size) == (
                want, want.index(rank), len(want)), (where, kind)
            assert view.mesh.tolist() == want, (where, kind)
            assert dist.get_process_group_ranks(view.get_group()) == want
        for kind in VIEWS:
            assert topology.mesh[kind].mesh.tolist() == \
                expected[kind][rank], (where, kind)
        # HSDP's 2-D mesh: replicas as rows, shards as columns.
        # (ep ranks are data ranks too, but not in this 2-D mesh.)
        hsdp = [[other for other in expected['dp'][rank]
                 if coords[other]['dp_replicate'] == r
                 and coords[other]['ep'] == mine['ep']]
                for r in range(sizes[0])]
        assert topology.mesh['dp_replicate', 'dp_shard'].mesh.tolist() == \
            hsdp, where
        # FSDP's: replicas as rows, each sharding over dp_shard x cp.
        shard_rows = [[other for other in expected['dp_cp'][rank]
                       if coords[other]['dp_replicate'] == r]
                      for r in range(sizes[0])]
        assert topology.mesh['dp_replicate', 'dp_shard_cp'].mesh.tolist() \
            == shard_rows, where
        assert (topology.dp_rank, topology.dp_size) == (
            expected['dp'][rank].index(rank), len(expected['dp'][rank]))
    finally:
        reset_parallelism()
        dist.destroy_process_group()


@pytest.mark.parametrize('world_size,ranks', [
    (4, 'all'), (8, 'all'), (12, (0, 5, 6, 11)), (16, (0, 7, 9, 15))])
def test_every_layout_builds_the_brute_force_groups(world_size, ranks):
    """Every (dp_replicate, dp_shard, ep, pp, cp, tp) of the world,
    dp_replicate > 1 and cp > 1 included, as every rank (at 12 and 16: the
    first, the last and two in the middle) would build it."""
    checked = 0
    for sizes in layouts(world_size):
        expected, coords = brute_force_groups(*sizes), rank_coordinates(*sizes)
        for rank in range(world_size) if ranks == 'all' else ranks:
            _check_rank_against_brute_force(sizes, world_size, rank,
                                            expected, coords)
        checked += sizes[0] > 1 and sizes[4] > 1
    assert checked >= 1  # replicated layouts with cp were among them


def test_one_group_serves_identical_axes(fake_world):
    # dp_replicate=1: the dp groups are the dp_shard groups, made once.
    topology = init_parallelism(2)
    assert topology.dp.group is topology.dp_shard.group
    assert topology.dims.shape == (1, 4, 1, 1, 1, 2)


@pytest.mark.parametrize('fake_world', [0, 3, 6], indirect=True)
def test_pipeline_neighbours(fake_world):
    dims = ParallelDims(dp_replicate=1, dp_shard=2, pp=2, tp=2, world_size=8)
    topology = init_parallelism(dims=dims)
    # pp groups: [0, 2], [1, 3], [4, 6], [5, 7]
    expected = {0: (True, False, None, 2), 3: (False, True, 1, None),
                6: (False, True, 4, None)}[fake_world]
    assert (topology.is_first_stage, topology.is_last_stage,
            topology.prev_rank, topology.next_rank) == expected


def test_data_mesh_follows_the_layout(fake_world):
    init_parallelism(dims=TWO_BY_TWO_TP)
    assert data_mesh().mesh_dim_names == ('dp_replicate', 'dp_shard')
    assert data_mesh(hybrid=True, hybrid_shard_size=2).mesh.tolist() == \
        [[1, 3], [5, 7]]
    with pytest.raises(ValueError, match='hybrid_shard_size=4 disagrees'):
        data_mesh(hybrid=True, hybrid_shard_size=4)
    reset_parallelism()
    init_parallelism(2)  # dp_replicate=1: one flat data axis
    assert data_mesh(hybrid=True).mesh.tolist() == [1, 3, 5, 7]


def test_data_mesh_without_topology_is_the_world(fake_world):
    assert data_mesh().mesh.tolist() == list(range(8))
    hybrid = data_mesh(hybrid=True, hybrid_shard_size=4)
    assert hybrid.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_groups_and_meshes_are_made_in_one_module():
    makers = re.compile(r'\b(new_group|init_device_mesh|DeviceMesh|from_group)\(')
    offenders = [
        str(path.relative_to(ROOT)) for path in (ROOT / 'mmpar').rglob('*.py')
        if path.name != 'mesh.py' and makers.search(path.read_text())
    ]
    assert offenders == []


def test_cp_meshes_flatten_with_the_data_axes(fake_world):
    # rank 5 of dp_replicate=2 x dp_shard=2 x cp=2: (1, 0, 1, 0, 1, 0).
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, world_size=8)
    topology = init_parallelism(dims=dims)
    assert topology.cp.global_ranks == [4, 5]
    assert topology.dp.global_ranks == [1, 3, 5, 7]
    assert topology.dp_cp.global_ranks == list(range(8))
    mesh = topology.mesh
    assert mesh['cp'].get_group() is topology.cp.group
    assert mesh['dp_cp'].get_group() is topology.dp_cp.group
    assert mesh['dp_shard_cp'].mesh.tolist() == [4, 5, 6, 7]
    # HSDP: replicate over dp_replicate, shard over dp_shard x cp, one root.
    hsdp = topology.data_mesh()
    assert hsdp.mesh_dim_names == ('dp_replicate', 'dp_shard_cp')
    assert hsdp.mesh.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hsdp._get_root_mesh() is mesh.root
