"""The seed API: one topology per process, set up by ``init_parallelism``.

The first version of mmpar exposed the layout as a process global
(``init_parallelism(mp, pp)``, ``parallel_group_info().mp.reduce(...)``).
Scripts written against it keep working through this module, the only one
with a module-level topology. mmpar's own code never reads it: the Runner
builds the topology (:func:`mmpar.parallel.topology.build_topology`), hands
it down, and only :func:`install`\\ s it here so that user code (and the test
harness's :func:`reset_parallelism`) still finds it.
"""
import warnings
from typing import Mapping, Optional, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mmpar.checks import check_int
from mmpar.parallel.config import SEED_SIZE_KEYS, ParallelConfig
from mmpar.parallel.axes import AXES, DATA_AXES
from mmpar.parallel.dims import (ParallelDims, ParallelismError,
                                 check_shard_size)
from mmpar.parallel.groups import GroupInfo
from mmpar.parallel.layout import ParallelLayout, layout_of
from mmpar.parallel.mesh import fallback_data_mesh
from mmpar.parallel.topology import (ParallelTopology, build_topology,
                                     require_default_group)

# The seed's group kinds (mp is tp).
DIMS = ('dp', 'pp', 'mp')

_current: Optional[ParallelTopology] = None


def _live() -> Optional[ParallelTopology]:
    """The topology, or None once its default group has been destroyed."""
    global _current
    if _current is not None and not _current.is_alive():
        _current.destroy()  # forgets DTensor's cached meshes
        _current = None
    return _current


def check_sizes(world_size: int,
                model_parallelism: int = 1,
                pipeline_parallelism: int = 1) -> Tuple[int, int, int]:
    """Validate the seed sizes and return ``(mp, pp, dp)``.

    A model parallelism larger than the world is clamped to the world size
    (with a warning), so a config written for a big cluster still runs on a
    small one.

    Raises:
        ParallelismError: a size below 1, or a world size not divisible by
            mp or by mp * pp; the message gives the numbers.
    """
    for key, value in (('world_size', world_size),
                       ('model_parallelism', model_parallelism),
                       ('pipeline_parallelism', pipeline_parallelism)):
        check_int(key, value, error=ParallelismError)
    mp, pp = model_parallelism, pipeline_parallelism
    if mp > world_size:
        warnings.warn(f'model_parallelism={mp} is larger than the world size '
                      f'{world_size}; using model_parallelism={world_size}')
        mp = world_size
    if world_size % mp:
        raise ParallelismError(
            f'world size {world_size} is not divisible by '
            f'model_parallelism={mp}')
    if world_size % (mp * pp):
        raise ParallelismError(
            f'world size {world_size} is not divisible by model_parallelism'
            f' * pipeline_parallelism = {mp} * {pp} = {mp * pp}')
    return mp, pp, world_size // (mp * pp)


def seed_dims(world_size: int, model_parallelism: int = 1,
              pipeline_parallelism: int = 1) -> ParallelDims:
    """The named axes of the seed sizes: tp=mp, pp, the rest sharded data."""
    mp, pp, dp = check_sizes(world_size, model_parallelism,
                             pipeline_parallelism)
    return ParallelDims(dp_replicate=1, dp_shard=dp, tp=mp, pp=pp,
                        world_size=world_size)


def parallel_layout(world_size: int,
                    model_parallelism: int = 1,
                    pipeline_parallelism: int = 1) -> ParallelLayout:
    """Every mp, pp and dp group for a world of ``world_size`` ranks, in the
    order ``init_parallelism`` creates them.

    Raises:
        ParallelismError: as :func:`check_sizes`.
    """
    return layout_of(seed_dims(world_size, model_parallelism,
                               pipeline_parallelism))


def install(topology: ParallelTopology) -> ParallelTopology:
    """Make ``topology`` the one the seed API answers with.

    Raises:
        ParallelismError: another live topology is installed.
    """
    global _current
    _refuse_another(topology)
    _current = topology
    return topology


def _refuse_another(topology: Optional[ParallelTopology] = None) -> None:
    current = _live()
    if current is not None and current is not topology:
        raise ParallelismError(
            f'parallelism is already initialised ({current.dims}); call '
            'reset_parallelism() first')


def init_parallelism(model_parallelism: int = 1,
                     pipeline_parallelism: int = 1,
                     *,
                     dims: Optional[ParallelDims] = None,
                     mp_backend: Optional[str] = None,
                     pp_backend: Optional[str] = None,
                     dp_backend: Optional[str] = None) -> ParallelTopology:
    """Create every axis's groups and the mesh on every rank (collective).

    Args:
        model_parallelism: ranks per tensor-parallel group (clamped to the
            world size, with a warning, when larger).
        pipeline_parallelism: ranks per pipeline group.
        dims: the named axes; when given, the two sizes above are ignored.
        mp_backend: backend of the tp groups; None uses the default group's.
        pp_backend: backend of the pp groups; None uses the default group's.
        dp_backend: backend of the data-axis groups (dp, dp_replicate,
            dp_shard); None uses the default group's.

    Returns:
        This rank's topology (also :func:`parallel_group_info`).

    Raises:
        ParallelismError: no default process group, already initialised
            (call :func:`reset_parallelism` first), or sizes that do not
            fit the world size.
    """
    _refuse_another()
    if dims is None:
        require_default_group('init_parallelism')
        dims = seed_dims(dist.get_world_size(), model_parallelism,
                         pipeline_parallelism)
    backends = dict(tp=mp_backend, pp=pp_backend,
                    **dict.fromkeys(('dp', ) + DATA_AXES, dp_backend))
    return install(build_topology(dims, backends))


def setup_parallelism(parallel_cfg=None,
                      model_wrapper_cfg: Optional[Mapping] = None,
                      dims: Optional[ParallelDims] = None
                      ) -> Optional[ParallelTopology]:
    """Build and install the topology a ``parallel`` section asks for.

    The Runner's start-up call (after ``init_dist``). Without a process
    group (a single-process run) there is nothing to split: sizes above 1
    are ignored with a warning and None is returned. An identical topology
    already installed (a second Runner in one process) is reused.

    Args:
        parallel_cfg: a :class:`ParallelConfig`, a ``parallel`` dict or None.
        model_wrapper_cfg: the config's wrapper section (see
            :meth:`ParallelConfig.dims`).
        dims: the layout, when already resolved for this world size.

    Raises:
        ValueError: a bad ``parallel`` section.
        ParallelismError: sizes that do not fit the world size, or a
            different topology already installed.
    """
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    if not (dist.is_available() and dist.is_initialized()):
        big = [f'{k}={getattr(parallel, k)}' for k in AXES + SEED_SIZE_KEYS
               if (getattr(parallel, k) or 1) > 1]
        if big:
            warnings.warn(f'parallel.{", ".join(big)} in a single-process '
                          'run: using 1 for every axis')
        return None
    if dims is None or dims.world_size != dist.get_world_size():
        dims = parallel.dims(dist.get_world_size(), model_wrapper_cfg)
    current = _live()
    if current is not None and current.dims == dims:
        return current
    return install(build_topology(dims))


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
    """The whole world as a :class:`GroupInfo` (a one-member group without
    a process group, so ``reduce``/``gather`` are no-ops there)."""
    if not (dist.is_available() and dist.is_initialized()):
        return GroupInfo(None, [0], 0, 1)
    world_size = dist.get_world_size()
    return GroupInfo(dist.group.WORLD, list(range(world_size)),
                     dist.get_rank(), world_size)


def default_dp_group() -> Optional[dist.ProcessGroup]:
    """The installed topology's gradient group (``dp x cp``: what
    data-parallel wrappers reduce over; the data-parallel group without
    cp), else None (torch's default, whole-world group)."""
    return None if _live() is None else _current.dp_cp.group


def data_mesh(hybrid: bool = False,
              hybrid_shard_size: Optional[int] = None) -> DeviceMesh:
    """The installed topology's :meth:`~ParallelTopology.data_mesh`, or the
    whole world (split into HSDP's pair for ``hybrid``) without one.

    Raises:
        ValueError: ``hybrid_shard_size`` that disagrees with the layout.
    """
    topology = _live()
    if topology is None:
        return fallback_data_mesh(hybrid, hybrid_shard_size)
    check_shard_size(hybrid_shard_size, topology.dims)
    return topology.data_mesh()


def reset_parallelism() -> None:
    """Forget the topology and destroy its groups; safe when not initialised.

    Destroying a group is local, not collective, so a rank can call this
    without the others (the test harness calls it after every task).
    """
    global _current
    topology, _current = _live(), None
    if topology is not None:
        topology.destroy()
