"""The only module that makes process groups and DeviceMeshes.

:func:`build_mesh` turns a :class:`~mmpar.parallel.dims.ParallelDims` into
one group per axis for this rank and a ``DeviceMesh`` with dims
:data:`~mmpar.parallel.dims.AXES` plus the flattened axes of
:data:`~mmpar.parallel.axes.FLATTENED`: the data axis ``'dp'``, the
gradient axis ``'dp_cp'`` and FSDP's shard axis ``'dp_shard_cp'``.
:func:`fallback_data_mesh` serves wrappers built without a topology (tests,
scripts): the whole world as the data axis, or split into HSDP's
replicate x shard pair.

Groups are made with ``new_group`` and the default group's timeout
(``env_cfg.dist_cfg.timeout``), not torch's 30-minute default for new groups,
so a hung rank ends the job in the time the user configured; axes with the
same ranks share one group.
"""
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mmpar.device import device_type
from mmpar.dist import collective_timeout
from mmpar.parallel.axes import AXES, DATA_AXES, FLATTENED
from mmpar.parallel.dims import ParallelDims, node_local_shard
from mmpar.parallel.groups import GroupInfo
from mmpar.parallel.layout import ParallelLayout, layout_of


class ParallelMesh:
    """Named sub-meshes of the job: ``mesh['tp']``, ``mesh['dp']``, ...

    A thin view over the torch ``DeviceMesh`` (:attr:`root`, dims
    :data:`AXES`) that also answers the flattened axes (``'dp'``,
    ``'dp_cp'``, ``'dp_shard_cp'``) directly: torch deprecates slicing a
    flattened dim from the root mesh and asks callers to keep the flattened
    mesh themselves, which is what this
    does. Any other attribute is the root mesh's.
    """

    def __init__(self, root: DeviceMesh, flattened: Dict[str, DeviceMesh]):
        self.root = root
        self.flattened = flattened

    def __getitem__(self, names: Union[str, Tuple[str, ...]]) -> DeviceMesh:
        key = names if isinstance(names, str) else tuple(names)
        if isinstance(key, tuple) and len(key) == 1:
            key = key[0]
        if isinstance(key, str):
            return self.flattened[key] if key in self.flattened \
                else self.root[key]
        # A flattened axis that is one root dim (the others of size 1) is
        # that dim, so the result is a plain slice of the root.
        dims = tuple(self[name].mesh_dim_names[0] if name in self.flattened
                     else name for name in key)
        if all(dim in self.root.mesh_dim_names for dim in dims):
            return self.root[dims]
        # DeviceMesh._concatenate: the only way in torch 2.13 to put a root
        # dim and a flattened one side by side (HSDP's replicate x
        # (dp_shard x cp)) without slicing the flattened dim from the root,
        # which torch deprecates.
        return DeviceMesh._concatenate([self[name] for name in key])

    def __getattr__(self, name: str):
        return getattr(self.root, name)

    def __repr__(self) -> str:
        return f'ParallelMesh({self.root!r}, flattened={list(self.flattened)})'


@dataclass(frozen=True)
class BuiltMesh:
    """What :func:`build_mesh` made for this rank.

    Attributes:
        mesh: the named view (``mesh['dp']``, ``mesh['tp']``, ...).
        groups: this rank's :class:`GroupInfo` per axis and per flattened
            axis (``'dp'``, ``'dp_cp'``, ``'dp_shard_cp'``).
        created: every group this rank belongs to (for teardown), once.
        layout: every rank's groups (pure).
    """
    mesh: ParallelMesh
    groups: Dict[str, GroupInfo]
    created: tuple
    layout: ParallelLayout


def _new_groups(layout: ParallelLayout, kind: str, backend: Optional[str],
                made: Dict[tuple, dist.ProcessGroup]) -> GroupInfo:
    """Make every ``kind`` group (collective) and return this rank's.

    ``made`` maps a rank tuple to an existing group: with dp_replicate=1 the
    dp groups are the dp_shard groups, and one group serves both.
    """
    rank, mine = dist.get_rank(), None
    for ranks in layout.groups[kind]:
        key = (tuple(ranks), backend)
        if key not in made:
            # Every rank joins every new_group call, member or not.
            made[key] = dist.new_group(
                ranks, backend=backend, timeout=collective_timeout())
        if rank in ranks:
            mine = GroupInfo(made[key], list(ranks), ranks.index(rank),
                             len(ranks))
    return mine


def _group_options(backend: str):
    """Backend options carrying the default group's timeout, for groups
    torch makes itself (a flattened mesh dim)."""
    timeout = collective_timeout()
    if timeout is None:
        return backend
    if backend == 'nccl':
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # no public setter in torch 2.13
        return backend, options
    return backend, dist.ProcessGroupGloo.Options(backend, timeout)


def _flatten(root: DeviceMesh, axes: Tuple[str, ...], name: str,
             backend: Optional[str], made: Dict[tuple, DeviceMesh]
             ) -> DeviceMesh:
    """``axes`` as one 1-D mesh named ``name`` that shares ``root``.

    With at most one of them larger than 1 it is that axis's slice; a set
    of larger axes already flattened (``dp_cp`` is ``dp`` when cp is 1) is
    reused; otherwise torch flattens them (a new group, with our timeout).
    It must share the root: FSDP2 combines it with a tp mesh of the same
    root.
    """
    # (The root's own sizes: slicing a dim only to read its size builds a
    # DeviceMesh each time, most of what building the mesh costs.)
    big = tuple(axis for axis in axes
                if root.size(root.mesh_dim_names.index(axis)) > 1)
    if len(big) <= 1:
        return root[big[0] if big else axes[0]]
    if big not in made:
        # DeviceMesh._flatten: no public way to flatten dims in torch 2.13.
        made[big] = root[big]._flatten(
            name, backend_override=_group_options(
                backend or dist.get_backend()))
    return made[big]


def build_mesh(dims: ParallelDims,
               backends: Optional[Mapping[str, Optional[str]]] = None
               ) -> BuiltMesh:
    """Make every group of ``dims`` and the job's DeviceMesh.

    Collective: every rank calls it with the same arguments (``new_group``
    must be called by all ranks, for every group, in the same order).

    Args:
        dims: the layout; its world size must be the default group's.
        backends: backend per axis name (or flattened axis; ``'dp'``'s
            serves the other flattened ones); None uses the default group's
            backend.

    Returns:
        This rank's mesh and groups.
    """
    backends = dict(backends or {})
    layout = layout_of(dims)
    made: Dict[tuple, dist.ProcessGroup] = {}
    groups = {
        axis: _new_groups(layout, axis, backends.get(axis), made)
        for axis in AXES
    }
    root = DeviceMesh.from_group(
        [groups[axis].group for axis in AXES],
        device_type(),
        mesh=torch.arange(dims.world_size).reshape(dims.shape),
        mesh_dim_names=AXES)
    flat, made = {}, {}
    for name, axes in FLATTENED.items():
        flat[name] = _flatten(root, axes, name, backends.get(name) or
                              backends.get('dp'), made)
        ranks = flat[name].mesh.tolist()
        groups[name] = GroupInfo(flat[name].get_group(), ranks,
                                 ranks.index(dist.get_rank()), len(ranks))
    # Only this rank's groups: for the others new_group returned a
    # non-member marker, which must never reach destroy_process_group.
    mine = {id(info.group): info.group for info in groups.values()}
    return BuiltMesh(
        ParallelMesh(root, flat), groups, tuple(mine.values()), layout)


def checkpoint_group() -> dist.ProcessGroup:
    """A gloo group of the whole world for background checkpoint writes.

    Collective: every rank calls it. DCP's ``async_save`` coordinates its
    ranks from a writer thread while training runs collectives on the
    layout's groups; on a group of its own (with a CPU backend, as DCP's
    staging needs) the two never interleave on one communicator. Its
    timeout is the default group's (``env_cfg.dist_cfg.timeout``).
    """
    return dist.new_group(backend='gloo', timeout=collective_timeout())


def fallback_data_mesh(hybrid: bool,
                       shard_size: Optional[int] = None) -> DeviceMesh:
    """The whole world as the data axis, for a wrapper with no topology.

    Args:
        hybrid: a 2-D ``('dp_replicate', 'dp_shard')`` mesh (HSDP) instead
            of the 1-D ``('dp',)`` one.
        shard_size: ranks per shard group when ``hybrid`` (consecutive
            ranks; default: one node's, ``LOCAL_WORLD_SIZE``); it must
            divide the world size.
    """
    world = dist.get_world_size()
    if not hybrid:
        return init_device_mesh(device_type(), (world, ),
                                mesh_dim_names=('dp', ))
    shard_size = node_local_shard(world, shard_size)
    return init_device_mesh(
        device_type(), (world // shard_size, shard_size),
        mesh_dim_names=DATA_AXES)
