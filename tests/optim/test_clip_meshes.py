"""The global-norm clip over gradients on meshes whose dims are out of the
root's order, which torch 2.13 cannot reduce a DTensor norm over (FSDP2
over a parameter that is already a DTensor on an inner axis): the norm is
that of the whole gradients, on 4 gloo ranks, next to one on the data mesh.
On every other mesh the clip keeps torch's own DTensor norm, bit for bit.
"""
import pytest

WHOLE = (4, 6)  # the stacked parameter: 4 entries on dim 0, split twice


def _clip_norm(parallel: dict) -> tuple:
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from mmpar.optim.clip import _in_root_order, clip_grad_norm_
    from mmpar.parallel import setup_parallelism
    topology = setup_parallelism(parallel, dict(type='MMFullyShard'))
    mesh = topology.mesh
    stacked = torch.arange(24, dtype=torch.float32).reshape(WHOLE) / 7
    dense = torch.linspace(-1, 2, 10)
    inner = nn.Module()
    # A DTensor on the inner axis first, then sharded by FSDP2 over the
    # flattened one (as the experts: ep, then efsdp).
    inner.weight = nn.Parameter(distribute_tensor(stacked, mesh['ep'],
                                                  [Shard(0)]))
    fully_shard(inner, mesh=mesh['efsdp'])
    outer = nn.Module()
    outer.inner, outer.bias = inner, nn.Parameter(dense.clone())
    fully_shard(outer, mesh=topology.data_mesh())
    for param in outer.parameters():
        param.grad = param.detach().clone()  # the whole values, sharded
    norm = clip_grad_norm_(outer.parameters(), max_norm=1e9)
    expected = torch.cat([stacked.flatten(), dense]).norm()
    return (float(norm), float(expected),
            _in_root_order(inner.weight.device_mesh))


@pytest.mark.parametrize('parallel,in_order', [
    # efsdp = cp, which the root orders after ep: out of order
    (dict(ep=2, cp=2), False),
    # efsdp = dp_shard, before ep: torch's own DTensor norm
    (dict(ep=2, dp_shard=2), True),
], ids=['ep2_cp2', 'ep2_dp_shard2'])
def test_norm_of_whole_gradients_on_any_mesh(run_dist, parallel, in_order):
    for norm, expected, ordered in run_dist(_clip_norm, parallel,
                                            world_size=4):
        assert ordered == in_order
        assert norm == pytest.approx(expected, rel=1e-6)


def _ours_and_torchs(seed: int) -> tuple:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from mmpar.optim.clip import total_grad_norm
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))
    gen = torch.Generator().manual_seed(seed)
    grads = [distribute_tensor(torch.randn(16, 12, generator=gen), mesh,
                               placements)
             for placements in [(Shard(0), Shard(0)), (Shard(0), Shard(1)),
                                (Shard(0), Replicate()),
                                (Replicate(), Shard(1))]]
    torchs = torch.nn.utils.get_total_norm(grads).full_tensor()
    return float(total_grad_norm(grads)), float(torchs)


def test_an_in_order_mesh_keeps_torchs_norm_bit_for_bit(run_dist):
    """Mixed placements on a (dp, tp) mesh, as FSDP2 over tp makes them:
    torch's own DTensor norm, not the per-dim one (which rounds apart)."""
    for seed in range(4):
        for ours, torchs in run_dist(_ours_and_torchs, seed, world_size=4):
            assert ours == torchs
