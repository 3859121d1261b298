"""Which ranks form each axis's groups (pure arithmetic on integers).

Ranks form a grid over :data:`mmpar.parallel.dims.AXES`
``(dp_replicate, dp_shard, pp, cp, tp)`` in row-major order, tp varying
fastest, so that neighbouring ranks (usually on the same host, with the
fastest link) share a tensor-parallel group, the most talkative one; ``dp``
is the flattened ``(dp_replicate, dp_shard)`` data axis, ``dp_cp`` the
gradient axis (``dp`` and ``cp`` flattened: ranks that read different tokens)
and ``dp_shard_cp`` the axis FSDP shards over (``dp_shard`` and ``cp``).
The seed names stay as keys: ``mp`` is ``tp``. With 8 ranks, tp=2 and
pp=2::

    mp groups [[0, 1], [2, 3], [4, 5], [6, 7]]
    pp groups [[0, 2], [1, 3], [4, 6], [5, 7]]
    dp groups [[0, 4], [1, 5], [2, 6], [3, 7]]

Everything here is arithmetic on integers, so it is tested for every valid
layout without starting a process.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from mmpar.parallel.axes import AXES, FLATTENED, SAMPLE_AXES
from mmpar.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of every kind for one layout.

    Attributes:
        world_size: number of ranks.
        mp: tensor (model) parallel size (ranks per tp group).
        pp: pipeline-parallel size.
        dp: data-parallel size (``world_size // (mp * pp * cp)``).
        groups: ``{'tp': [[ranks], ...], 'pp': ..., 'cp': ..., 'dp': ...,
            'dp_replicate': ..., 'dp_shard': ..., 'dp_cp': ...,
            'dp_shard_cp': ..., 'mp': (the tp groups)}``;
            each group sorted, the groups of one kind partitioning
            ``range(world_size)``.
        dims: the named axes this layout was made from.
    """
    world_size: int
    mp: int
    pp: int
    dp: int
    groups: Dict[str, List[List[int]]]
    dims: Optional[ParallelDims] = None

    @property
    def shape(self) -> Tuple[int, int, int]:
        """The seed's grid shape: ``(dp, pp, mp)``."""
        return (self.dp, self.pp, self.mp)

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ``kind`` group (an axis name, ``dp`` or ``mp``) of ``rank``."""
        if kind not in self.groups:
            raise ValueError(f'kind={kind!r} is not a group kind; '
                             f'allowed: {", ".join(self.groups)}')
        self.coords(rank)  # range check
        return next(g for g in self.groups[kind] if rank in g)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """``(dp_index, pp_index, mp_index)`` of ``rank`` in the grid (the
        seed's coordinates; a cp index lies between pp and mp)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f'rank={rank} is outside world size '
                             f'{self.world_size}')
        if self.dims is None:
            return (rank // (self.mp * self.pp), rank // self.mp % self.pp,
                    rank % self.mp)
        coords = self.dims.coords(rank)
        dp_index = 0
        for axis in SAMPLE_AXES:
            dp_index = dp_index * getattr(self.dims, axis) + coords[axis]
        return (dp_index, coords['pp'], coords['tp'])


def axis_groups(dims: ParallelDims, axes: Tuple[str, ...]) -> List[List[int]]:
    """The groups along ``axes`` (one axis, or several flattened together).

    Ranks in one group differ only in their coordinates on ``axes``; groups
    are listed in row-major order of the other coordinates, the order every
    rank creates them in.
    """
    grid = torch.arange(dims.world_size).reshape(dims.shape)
    moved = [AXES.index(a) for a in axes]
    size = dims.size_of(axes)
    last = list(range(len(AXES) - len(moved), len(AXES)))
    return grid.movedim(moved, last).reshape(-1, size).tolist()


def layout_of(dims: ParallelDims) -> ParallelLayout:
    """Every group of every axis of ``dims``, plus the flattened ``dp``,
    ``dp_cp`` and ``dp_shard_cp``, and ``mp``."""
    groups = {axis: axis_groups(dims, (axis, )) for axis in AXES}
    for name, axes in FLATTENED.items():
        groups[name] = axis_groups(dims, axes)
    groups['mp'] = groups['tp']
    return ParallelLayout(dims.world_size, dims.tp, dims.pp, dims.dp, groups,
                          dims)
