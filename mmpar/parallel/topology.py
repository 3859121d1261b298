"""Build the mp / pp / dp process groups and a matching ``DeviceMesh``.

The groups live in one module-level slot because torch's process groups are
process-global themselves; code that can should still pass the
:class:`ParallelTopology` that :func:`init_parallelism` returns.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpar.dist import collective_timeout, uses_cuda
from mmpar.parallel.groups import GroupInfo
from mmpar.parallel.layout import (DIMS, ParallelismError, ParallelLayout,
                                   parallel_layout)


@dataclass(frozen=True)
class ParallelTopology:
    """This process's groups: what :func:`parallel_group_info` returns.

    Attributes:
        layout: every group of every kind (the pure layout).
        mp: this rank's model-parallel group.
        pp: this rank's pipeline-parallel group.
        dp: this rank's data-parallel group.
        mesh: a ``DeviceMesh`` with dims ``('dp', 'pp', 'mp')`` built from
            the same groups, for FSDP2/HSDP and tensor parallelism.
    """
    layout: ParallelLayout
    mp: GroupInfo
    pp: GroupInfo
    dp: GroupInfo
    mesh: DeviceMesh
    created_groups: tuple  # every group this rank is a member of
    world_group: dist.ProcessGroup  # the default group they were made in


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
    return _current


def _require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ParallelismError(
            'the default process group is not initialised; call '
            'mmpar.dist.init_dist (or torch.distributed.init_process_group) '
            'before init_parallelism')


def init_parallelism(model_parallelism: int = 1,
                     pipeline_parallelism: int = 1,
                     *,
                     mp_backend: Optional[str] = None,
                     pp_backend: Optional[str] = None,
                     dp_backend: Optional[str] = None) -> ParallelTopology:
    """Create the model, pipeline and data-parallel groups on every rank.

    Collective: every rank must call it with the same arguments, because
    ``torch.distributed.new_group`` must be called by all ranks, for every
    group, in the same order.

    Args:
        model_parallelism: ranks per model-parallel group (clamped to the
            world size, with a warning, when larger).
        pipeline_parallelism: ranks per pipeline-parallel group.
        mp_backend: backend of the mp groups; None uses the default group's.
        pp_backend: backend of the pp groups; None uses the default group's.
        dp_backend: backend of the dp groups; None uses the default group's.

    Returns:
        This rank's topology (also available from
        :func:`parallel_group_info`).

    Raises:
        ParallelismError: no default process group, already initialised
            (call :func:`reset_parallelism` first), or sizes that do not
            divide the world size.
    """
    global _current
    _require_process_group()
    if _live() is not None:
        raise ParallelismError(
            'parallelism is already initialised (mp='
            f'{_current.layout.mp}, pp={_current.layout.pp}, dp='
            f'{_current.layout.dp}); call reset_parallelism() first')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = parallel_layout(world_size, model_parallelism,
                             pipeline_parallelism)
    backends = dict(mp=mp_backend, pp=pp_backend, dp=dp_backend)
    mine, created = {}, []
    for kind in ('mp', 'pp', 'dp'):
        for ranks in layout.groups[kind]:
            # Every rank joins every new_group call, member or not. The
            # timeout is the default group's (env_cfg.dist_cfg.timeout), not
            # torch's 30-minute default for new groups.
            group = dist.new_group(
                ranks, backend=backends[kind], timeout=collective_timeout())
            if rank in ranks:
                mine[kind] = GroupInfo(group, list(ranks), ranks.index(rank),
                                       len(ranks))
                created.append(group)
    mesh = DeviceMesh.from_group(
        [mine[dim].group for dim in DIMS],
        'cuda' if uses_cuda() else 'cpu',
        mesh=torch.arange(world_size).reshape(layout.shape),
        mesh_dim_names=DIMS)
    _current = ParallelTopology(layout, mine['mp'], mine['pp'], mine['dp'],
                                mesh, tuple(created), dist.group.WORLD)
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
