"""Process-group start-up for every launcher, on CPU (gloo) and on an
accelerator (nccl on CUDA, xccl on XPU, ...: :mod:`mmpar.device`).

MMEngine 0.10.7's ``init_dist`` sets a CUDA device for every launcher and so
dies on a machine without CUDA. This module sets the device only when the
chosen backend needs one.
"""
import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist

from mmpar import device
from mmpar.device import default_backend

LAUNCHERS = ('none', 'pytorch', 'slurm', 'mpi')
BACKENDS = ('gloo', 'nccl', 'xccl')
DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_S = 1800
MIN_STORE_TIMEOUT_S = 120


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as a launcher describes it."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def check_launcher(launcher: str) -> str:
    """Return ``launcher`` if it is known.

    Raises:
        ValueError: naming the bad value and the allowed launchers.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f'launcher={launcher!r} is not supported; '
                         f'allowed: {", ".join(LAUNCHERS)}')
    return launcher


def usable_backend(backend: Optional[str]) -> str:
    """The backend to start with, given what ``env_cfg.dist_cfg`` says.

    None (a plain MMEngine config without ``env_cfg``) picks
    :func:`default_backend`. ``'nccl'`` without CUDA, as every OpenMMLab
    ``default_runtime.py`` asks, logs one warning naming the key and uses
    gloo, so such configs run on CPU machines unchanged.
    """
    if backend is None:
        return default_backend()
    if device.backend_needs_accelerator(backend) and \
            default_backend() != backend:
        import logging

        from mmengine.logging import print_log
        needs = dict(nccl='CUDA', xccl='XPU').get(backend, 'an accelerator')
        if os.environ.get('RANK', '0') == '0':  # one warning per job
            print_log(
                f'env_cfg.dist_cfg.backend={backend!r} needs {needs}, which '
                "is not available: using 'gloo' instead (set backend='gloo' "
                'or leave it unset to silence this)',
                logger='current',
                level=logging.WARNING)
        return 'gloo'
    return backend


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as ``scontrol show hostnames``.

    ``'node[003-005,9],gpu1'`` gives ``'node003'``; ``'gpu1,gpu2'`` gives
    ``'gpu1'``.
    """
    first = re.match(r'([^,\[]+)(\[([^\]]+)\])?', nodelist.strip())
    if first is None:
        raise ValueError(f'SLURM_NODELIST={nodelist!r} cannot be parsed')
    prefix, ranges = first.group(1), first.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(',')[0].split('-')[0]


def _require(env: Mapping[str, str], key: str, launcher: str) -> str:
    if key not in env:
        raise RuntimeError(f'launcher={launcher!r} needs the environment '
                           f'variable {key}, which is not set')
    return env[key]


def launch_env(launcher: str,
               env: Optional[Mapping[str, str]] = None,
               port: Optional[int] = None) -> LaunchEnv:
    """Read rank, world size, local rank and master address for a launcher.

    Args:
        launcher: one of ``'pytorch'``, ``'slurm'``, ``'mpi'``.
        env: the environment to read (defaults to ``os.environ``).
        port: master port; overrides ``MASTER_PORT`` from the environment.

    Returns:
        The process's place in the job.
    """
    check_launcher(launcher)
    env = os.environ if env is None else env
    if launcher == 'pytorch':
        keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR')
        rank, world, local, addr = (_require(env, k, launcher) for k in keys)
    elif launcher == 'slurm':
        keys = ('SLURM_PROCID', 'SLURM_NTASKS', 'SLURM_LOCALID')
        rank, world, local = (_require(env, k, launcher) for k in keys)
        addr = env.get('MASTER_ADDR') or first_slurm_host(
            _require(env, 'SLURM_NODELIST', launcher))
    elif launcher == 'mpi':
        keys = ('OMPI_COMM_WORLD_RANK', 'OMPI_COMM_WORLD_SIZE',
                'OMPI_COMM_WORLD_LOCAL_RANK')
        rank, world, local = (_require(env, k, launcher) for k in keys)
        addr = env.get('MASTER_ADDR', '127.0.0.1')
    else:
        raise ValueError("launcher='none' starts no process group")
    master_port = port or int(env.get('MASTER_PORT', DEFAULT_MASTER_PORT))
    return LaunchEnv(int(rank), int(world), int(local), addr, master_port)


def init_dist(launcher: str,
              backend: Optional[str] = None,
              timeout: Union[int, float, datetime.timedelta,
                             None] = DEFAULT_TIMEOUT_S,
              port: Optional[int] = None,
              **kwargs) -> None:
    """Start the default process group for ``launcher``.

    Args:
        launcher: ``'none'`` (do nothing), ``'pytorch'`` (torchrun's
            environment), ``'slurm'`` or ``'mpi'``.
        backend: ``'gloo'``, ``'nccl'``, ``'xccl'`` or the accelerator's
            own; None picks the accelerator's (nccl on CUDA), gloo without
            one.
        timeout: collective timeout, seconds or a ``timedelta``.
        port: master port for slurm/mpi (else ``MASTER_PORT``, else 29500).
        **kwargs: passed to ``torch.distributed.init_process_group``.

    Raises:
        ValueError: an unknown launcher or backend.
        RuntimeError: a variable the launcher needs is missing.
    """
    check_launcher(launcher)
    if launcher == 'none':
        return
    backend = backend or default_backend()
    allowed = tuple(dict.fromkeys(BACKENDS + (default_backend(), )))
    if backend not in allowed:
        raise ValueError(f'dist_cfg.backend={backend!r} is not supported; '
                         f'allowed: {", ".join(allowed)}')
    place = launch_env(launcher, port=port)
    # MMEngine and torch read these; torchrun sets them, slurm and mpi do not.
    os.environ.update(
        RANK=str(place.rank),
        WORLD_SIZE=str(place.world_size),
        LOCAL_RANK=str(place.local_rank),
        MASTER_ADDR=place.master_addr,
        MASTER_PORT=str(place.master_port))
    if device.backend_needs_accelerator(backend):
        device.set_device(place.local_rank)
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=timeout)
    store = _restart_safe_store(place, timeout)
    if store is not None and 'store' not in kwargs:
        kwargs.update(store=store, rank=place.rank,
                      world_size=place.world_size)
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def restart_attempt() -> int:
    """Which attempt of a torchrun job this is: 0 for the first, k > 0
    for the k-th restart (``TORCHELASTIC_RESTART_COUNT``, set by
    torchrun's agent; 0 outside torchrun)."""
    value = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    return int(value) if value.isdigit() else 0


def _restart_safe_store(place: LaunchEnv,
                        timeout: Optional[datetime.timedelta]):
    """torchrun's store, with keys private to this restart attempt.

    Under torchrun the workers share the agent's TCPStore, which outlives a
    restart (``--max-restarts``); torch's env:// rendezvous adds no
    per-attempt prefix, so a restarted gloo group reads the dead workers'
    addresses and fails with "connectFullMesh ... Connection refused".
    Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` fixes that.
    None when not under torchrun's agent.
    """
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    attempt = restart_attempt()
    # Start-up (imports, peers arriving) may take longer than a short
    # collective timeout; the store only serves the rendezvous.
    store_timeout = max(timeout or datetime.timedelta(0),
                        datetime.timedelta(seconds=MIN_STORE_TIMEOUT_S))
    store = dist.TCPStore(
        place.master_addr,
        place.master_port,
        place.world_size,
        is_master=False,
        timeout=store_timeout)
    return dist.PrefixStore(f'mmpar/attempt_{attempt}/', store)


def collective_timeout() -> Optional[datetime.timedelta]:
    """The default group's collective timeout (None without a group).

    ``torch.distributed.new_group`` gives a new group torch's default timeout
    (30 minutes for gloo), not the default group's, so a group made after
    start-up would ignore ``env_cfg.dist_cfg.timeout`` and a hung rank would
    block its peers for half an hour. Pass this to ``new_group``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        # No public getter of a group's timeout in torch 2.13.
        return dist.group.WORLD._get_backend(
            torch.device(device.device_type())).options._timeout
    except (AttributeError, RuntimeError):
        return None  # a backend without options: torch's default applies


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj`` of ``group`` (default: the world), in rank
    order; ``[obj]`` without a process group. A collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def local_rank() -> int:
    """``LOCAL_RANK`` from the environment (0 when unset)."""
    return int(os.environ.get('LOCAL_RANK', 0))


def free_port() -> int:
    """A TCP port that is free on this host now (for tests and local runs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]
