"""This process's place in the parallel layout: groups, mesh, ranks.

The topology lives in one module-level slot because torch's process groups
are process-global themselves (and the seed API, :func:`parallel_group_info`,
needs it); code that can should pass the :class:`ParallelTopology` that
:func:`init_parallelism` returns. Its groups and mesh come from
:mod:`mmpar.parallel.mesh`, the only module that makes them.
"""
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpar.parallel.dims import (ParallelDims, ParallelismError,
                                 node_local_shard)
from mmpar.parallel.groups import GroupInfo
from mmpar.parallel.layout import ParallelLayout, check_sizes
from mmpar.parallel.mesh import ParallelMesh, build_mesh, fallback_data_mesh


@dataclass(frozen=True)
class ParallelTopology:
    """This process's groups: what :func:`parallel_group_info` returns.

    Attributes:
        dims: the named axes (sizes).
        mesh: named sub-meshes: ``mesh['tp']``, ``mesh['pp']``,
            ``mesh['dp']`` (the flattened data axis),
            ``mesh['dp_replicate', 'dp_shard']``; ``mesh.root`` is the torch
            ``DeviceMesh`` with dims ``('dp_replicate', 'dp_shard', 'pp',
            'tp')``.
        tp: this rank's tensor-parallel group (``mp`` is its seed name).
        pp: this rank's pipeline-parallel group.
        dp: this rank's data-parallel group (dp_replicate x dp_shard).
        dp_replicate: this rank's replicate group (HSDP's outer axis).
        dp_shard: this rank's shard group (FSDP's axis).
        layout: every rank's groups (the pure layout).
    """
    dims: ParallelDims
    mesh: ParallelMesh
    tp: GroupInfo
    pp: GroupInfo
    dp: GroupInfo
    dp_replicate: GroupInfo
    dp_shard: GroupInfo
    layout: ParallelLayout
    created_groups: tuple  # every group this rank made
    world_group: dist.ProcessGroup  # the default group they were made in

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


_current: Optional[ParallelTopology] = None


def _live() -> Optional[ParallelTopology]:
    """The topology, or None once its default group has been destroyed.

    Destroying the default group destroys every subgroup; a topology that
    outlived it (a test, or a second run in one process) must not hand out
    dead groups.
    """
    global _current
    if _current is not None and not (dist.is_initialized() and
                                     dist.group.WORLD is _current.world_group):
        _current = None
        _forget_dtensor_specs()
    return _current


def _forget_dtensor_specs() -> None:
    # DTensor caches sharding results keyed by mesh *equality* (layout and
    # ranks, not groups): a later mesh of the same layout would get an old
    # mesh, and its destroyed groups, back ("Could not resolve the process
    # group registered under the name ...").
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    _clear_sharding_prop_cache()


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelismError(
            'the default process group is not initialised; call '
            'mmpar.dist.init_dist (or torch.distributed.init_process_group) '
            'before init_parallelism')


def init_parallelism(model_parallelism: int = 1,
                     pipeline_parallelism: int = 1,
                     *,
                     dims: Optional[ParallelDims] = None,
                     mp_backend: Optional[str] = None,
                     pp_backend: Optional[str] = None,
                     dp_backend: Optional[str] = None) -> ParallelTopology:
    """Create every axis's groups and the mesh on every rank.

    Collective: every rank must call it with the same arguments, because
    ``torch.distributed.new_group`` must be called by all ranks, for every
    group, in the same order.

    Args:
        model_parallelism: the seed API: ranks per tensor-parallel group
            (clamped to the world size, with a warning, when larger).
        pipeline_parallelism: the seed API: ranks per pipeline group.
        dims: the named axes; when given, the two sizes above are ignored.
        mp_backend: backend of the tp groups; None uses the default group's.
        pp_backend: backend of the pp groups; None uses the default group's.
        dp_backend: backend of the data-axis groups (dp, dp_replicate,
            dp_shard); None uses the default group's.

    Returns:
        This rank's topology (also available from
        :func:`parallel_group_info`).

    Raises:
        ParallelismError: no default process group, already initialised
            (call :func:`reset_parallelism` first), or sizes that do not
            fit the world size.
    """
    global _current
    _require_process_group()
    if _live() is not None:
        raise ParallelismError(
            f'parallelism is already initialised ({_current.dims}); call '
            'reset_parallelism() first')
    world_size = dist.get_world_size()
    if dims is None:
        mp, pp, dp = check_sizes(world_size, model_parallelism,
                                 pipeline_parallelism)
        dims = ParallelDims(dp_replicate=1, dp_shard=dp, tp=mp, pp=pp,
                            world_size=world_size)
    elif dims.world_size != world_size:
        raise ParallelismError(f'{dims} is for {dims.world_size} ranks, the '
                               f'world has {world_size}')
    built = build_mesh(dims, dict(tp=mp_backend, pp=pp_backend,
                                  dp=dp_backend, dp_replicate=dp_backend,
                                  dp_shard=dp_backend))
    groups = built.groups
    _current = ParallelTopology(
        dims, built.mesh, groups['tp'], groups['pp'], groups['dp'],
        groups['dp_replicate'], groups['dp_shard'], built.layout,
        built.created, dist.group.WORLD)
    return _current


def parallelism_is_initialized() -> bool:
    """Whether :func:`init_parallelism` has run (and not been reset)."""
    return _live() is not None


def parallel_group_info() -> ParallelTopology:
    """This rank's topology: ``.mp``, ``.pp``, ``.dp`` (and ``.mesh``).

    Raises:
        ParallelismError: :func:`init_parallelism` has not run.
    """
    if _live() is None:
        raise ParallelismError(
            'parallelism is not initialised; call init_parallelism() first')
    return _current


def default_group_info() -> GroupInfo:
    """The whole world as a :class:`GroupInfo`.

    Without a process group (a single-process run) this is a one-member
    group, so ``reduce``/``gather`` are no-ops there.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(None, [0], 0, 1)
    world_size = dist.get_world_size()
    return GroupInfo(dist.group.WORLD, list(range(world_size)),
                     dist.get_rank(), world_size)


def default_dp_group() -> Optional[dist.ProcessGroup]:
    """The group wrappers reduce gradients over by default.

    Returns:
        This rank's data-parallel group when the topology is initialised,
        else None (which torch reads as the default, whole-world group).
    """
    return None if _live() is None else _current.dp.group


def data_mesh(hybrid: bool = False,
              hybrid_shard_size: Optional[int] = None) -> DeviceMesh:
    """The mesh a sharded data-parallel wrapper (FSDP1/FSDP2) works over.

    With a topology: ``mesh['dp_replicate', 'dp_shard']`` (2-D: replicate
    outside, shard inside: HSDP) when its ``dp_replicate > 1``, else the
    1-D ``mesh['dp']``: the layout decides, so every wrapper agrees. Without
    one: the whole world, 1-D, or for ``hybrid`` split into shard groups of
    ``hybrid_shard_size`` consecutive ranks (default: one node's ranks).

    Raises:
        ValueError: ``hybrid_shard_size`` that disagrees with the topology's
            ``dp_shard``, or does not divide the world size.
    """
    topology = _live()
    if topology is None:
        if not hybrid:
            return fallback_data_mesh(False)
        return fallback_data_mesh(
            True, node_local_shard(dist.get_world_size(), hybrid_shard_size))
    dims = topology.dims
    if hybrid_shard_size is not None and hybrid_shard_size != dims.dp_shard:
        raise ValueError(
            f'model_wrapper_cfg.hybrid_shard_size={hybrid_shard_size!r} '
            f'disagrees with the layout (dp_shard={dims.dp_shard}); allowed: '
            'leave it unset and give parallel.dp_shard instead')
    if dims.dp_replicate_enabled:
        return topology.mesh['dp_replicate', 'dp_shard']
    return topology.mesh['dp']


def reset_parallelism() -> None:
    """Forget the topology and destroy its groups; safe when not initialised.

    Destroying a group is local, not collective, so a rank can call this
    without the others (the test harness calls it after every task).
    """
    global _current
    topology, _current = _live(), None
    if topology is None:
        return
    for group in topology.created_groups:
        dist.destroy_process_group(group)
    _forget_dtensor_specs()
