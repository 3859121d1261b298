"""mmpar.dist: launcher environments, backend choice, no CUDA on CPU."""
import datetime

import pytest
import torch
import torch.distributed as dist

from mmpar.dist import (default_backend, first_slurm_host, free_port,
                        init_dist, launch_env)


@pytest.mark.parametrize('nodelist,host', [
    ('node001', 'node001'),
    ('gpu1,gpu2', 'gpu1'),
    ('node[003-005,9],gpu1', 'node003'),
    ('cn[7,9-12]', 'cn7'),
])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_slurm_env_derives_everything():
    env = dict(
        SLURM_PROCID='5',
        SLURM_NTASKS='8',
        SLURM_LOCALID='1',
        SLURM_NODELIST='node[010-013]')
    place = launch_env('slurm', env)
    assert (place.rank, place.world_size, place.local_rank) == (5, 8, 1)
    assert (place.master_addr, place.master_port) == ('node010', 29500)
    env.update(MASTER_ADDR='10.0.0.1', MASTER_PORT='1234')
    place = launch_env('slurm', env)
    assert (place.master_addr, place.master_port) == ('10.0.0.1', 1234)
    assert launch_env('slurm', env, port=4321).master_port == 4321


def test_mpi_and_pytorch_env():
    mpi = launch_env(
        'mpi',
        dict(
            OMPI_COMM_WORLD_RANK='3',
            OMPI_COMM_WORLD_SIZE='4',
            OMPI_COMM_WORLD_LOCAL_RANK='1',
            MASTER_ADDR='h0'))
    assert (mpi.rank, mpi.world_size, mpi.local_rank, mpi.master_addr) == \
        (3, 4, 1, 'h0')
    torchrun = launch_env(
        'pytorch',
        dict(
            RANK='1',
            WORLD_SIZE='2',
            LOCAL_RANK='1',
            MASTER_ADDR='127.0.0.1',
            MASTER_PORT='29600'))
    assert (torchrun.rank, torchrun.world_size, torchrun.master_port) == \
        (1, 2, 29600)


def test_missing_variable_is_named():
    with pytest.raises(RuntimeError, match='SLURM_NTASKS'):
        launch_env('slurm', dict(SLURM_PROCID='0'))


def test_unknown_launcher_lists_allowed():
    with pytest.raises(ValueError,
                       match="launcher='k8s'.*none, pytorch, slurm, mpi"):
        init_dist('k8s')


def test_none_launcher_starts_nothing():
    init_dist('none')
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason='CPU-only behaviour')
def test_pytorch_launcher_on_cpu_never_touches_cuda(monkeypatch):
    assert default_backend() == 'gloo'

    def no_cuda(*args, **kwargs):
        raise AssertionError('a CUDA API was called on a CPU-only machine')

    monkeypatch.setattr(torch.cuda, 'set_device', no_cuda)
    monkeypatch.setattr(torch.cuda, 'current_device', no_cuda)
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('WORLD_SIZE', '1')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', str(free_port()))
    init_dist('pytorch', timeout=datetime.timedelta(seconds=30))
    assert dist.get_backend() == 'gloo'
    assert dist.get_world_size() == 1


def test_unknown_backend_lists_allowed(monkeypatch):
    monkeypatch.setenv('RANK', '0')
    with pytest.raises(ValueError, match="backend='mpi2'.*gloo, nccl"):
        init_dist('pytorch', backend='mpi2')
