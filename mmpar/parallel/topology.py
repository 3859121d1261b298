"""This process's place in the parallel layout: groups, mesh, ranks.

:func:`build_topology` makes a :class:`ParallelTopology`, the one object
that knows the layout; the Runner holds it and hands it down (compose gives
each technique and wrapper the group or sub-mesh it works over), so nothing
below reads a global. Its groups and mesh come from
:mod:`mmpar.parallel.mesh`, the only module that makes them. The seed API
(``init_parallelism``, ``parallel_group_info``) keeps one topology in a
module slot of its own: :mod:`mmpar.parallel.seed`.
"""
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpar.parallel.axes import REPLICATE_SHARD
from mmpar.parallel.dims import ParallelDims, ParallelismError
from mmpar.parallel.groups import GroupInfo
from mmpar.parallel.layout import ParallelLayout
from mmpar.parallel.mesh import ParallelMesh, build_mesh


@dataclass(frozen=True)
class ParallelTopology:
    """This process's groups: what :func:`parallel_group_info` returns.

    This rank's group on every axis of :data:`~mmpar.parallel.axes.AXES`
    and every flattened axis is an attribute of the axis's name:
    ``topology.tp``, ``.pp``, ``.cp``, ``.dp_replicate``, ``.dp_shard``,
    ``.dp`` (the data axis: what samplers and metrics work over),
    ``.dp_cp`` (the gradient axis: the ranks that read different tokens,
    over which gradients are reduced and the loss's token count is summed),
    ``.dp_shard_cp``; ``mp`` is the seed name of ``tp``.

    Attributes:
        dims: the named axes (sizes).
        mesh: named sub-meshes: ``mesh['tp']``, ``mesh['dp']``,
            ``mesh['dp_cp']``, ``mesh['dp_replicate', 'dp_shard']``, ...;
            ``mesh.root`` is the torch ``DeviceMesh`` with dims
            :data:`~mmpar.parallel.axes.AXES`.
        groups: this rank's :class:`GroupInfo` per axis and flattened axis.
        layout: every rank's groups (the pure layout).
    """
    dims: ParallelDims
    mesh: ParallelMesh
    groups: Mapping[str, GroupInfo]
    layout: ParallelLayout
    created_groups: tuple  # every group this rank made
    world_group: dist.ProcessGroup  # the default group they were made in

    def __getattr__(self, name: str) -> GroupInfo:
        # Only names that are not fields: the axes' groups.
        groups = self.__dict__.get('groups') or {}
        if name in groups:
            return groups[name]
        raise AttributeError(
            f'{type(self).__name__!r} object has no attribute {name!r}')

    @property
    def mp(self) -> GroupInfo:
        """The seed name of :attr:`tp`."""
        return self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's index on the data axis (what samplers shard by)."""
        return self.dp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.world_size - 1

    @property
    def prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage (None on the first)."""
        return None if self.is_first_stage else \
            self.pp.global_ranks[self.pp.rank - 1]

    @property
    def next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (None on the last)."""
        return None if self.is_last_stage else \
            self.pp.global_ranks[self.pp.rank + 1]

    def data_mesh(self) -> DeviceMesh:
        """The mesh a sharded data-parallel wrapper (FSDP1/FSDP2) works over:
        ``(dp_replicate, dp_shard_cp)`` (2-D: replicate outside, shard
        inside: HSDP) when ``dp_replicate > 1``, else the 1-D
        ``mesh['dp_cp']``. Parameters are sharded over ``dp_shard x cp``
        (as torchtitan does): cp peers hold the same weights, so they may
        as well hold different shards of them. The layout decides, so every
        wrapper agrees."""
        if self.dims.dp_replicate_enabled:
            return self.mesh[REPLICATE_SHARD]
        return self.mesh['dp_cp']

    def is_alive(self) -> bool:
        """Whether its groups still exist: destroying the default group
        destroys every subgroup, so a topology that outlived it (a test, a
        second run in one process) must not hand out dead groups."""
        return dist.is_initialized() and dist.group.WORLD is self.world_group

    def destroy(self) -> None:
        """Destroy this rank's groups (local, not collective)."""
        if self.is_alive():
            for group in self.created_groups:
                dist.destroy_process_group(group)
        forget_dtensor_specs()


def forget_dtensor_specs() -> None:
    """Drop DTensor's caches that hold meshes.

    The sharding-propagation cache is keyed by mesh *equality* (layout and
    ranks, not groups): a later mesh of the same layout would get an old
    mesh, and its destroyed groups, back ("Could not resolve the process
    group registered under the name ..."). The redistribution caches (the
    planners and the transform steps, filled by every DTensor redistribute:
    tensor parallelism) keep each mesh they saw, and a mesh keeps its
    groups' backends alive: destroyed, yet their threads (gloo) or
    communicators (NCCL) stay until the process ends. A layout search
    tearing down one candidate after another grew by 3 gloo groups per
    tensor-parallel trial (measured: 4 -> 103 threads a rank over 30
    trials) before they were cleared here.
    """
    # No public way to clear either in torch 2.13.
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()  # torch 2.13 private


def require_default_group(before: str) -> None:
    """Raises ParallelismError without a default process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelismError(
            'the default process group is not initialised; call '
            'mmpar.dist.init_dist (or torch.distributed.init_process_group) '
            f'before {before}')


def build_topology(dims: ParallelDims,
                   backends: Optional[dict] = None) -> ParallelTopology:
    """Make every group of ``dims`` and this rank's topology.

    Collective: every rank must call it with the same arguments, because
    ``torch.distributed.new_group`` must be called by all ranks, for every
    group, in the same order.

    Args:
        dims: the layout; its world size must be the default group's.
        backends: backend per axis name (or flattened axis); None uses the
            default group's.

    Raises:
        ParallelismError: no default process group, or ``dims`` made for
            another world size.
    """
    require_default_group('building the parallel topology')
    if dims.world_size != dist.get_world_size():
        raise ParallelismError(f'{dims} is for {dims.world_size} ranks, the '
                               f'world has {dist.get_world_size()}')
    built = build_mesh(dims, backends)
    return ParallelTopology(
        dims, built.mesh, MappingProxyType(dict(built.groups)),
        layout=built.layout, created_groups=built.created,
        world_group=dist.group.WORLD)
