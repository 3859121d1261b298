"""Which ranks form the model, pipeline and data-parallel groups (pure).

Ranks form a grid ``(dp, pp, mp)`` in row-major order, mp varying fastest, so
that neighbouring ranks (usually on the same host, with the fastest link)
share a model-parallel group, the most talkative one. With 8 ranks, mp=2 and
pp=2::

    mp groups [[0, 1], [2, 3], [4, 5], [6, 7]]
    pp groups [[0, 2], [1, 3], [4, 6], [5, 7]]
    dp groups [[0, 4], [1, 5], [2, 6], [3, 7]]

Everything here is arithmetic on integers, so it is tested for every valid
layout without starting a process.
"""
import warnings
from dataclasses import dataclass
from typing import Dict, List, Tuple

DIMS = ('dp', 'pp', 'mp')


class ParallelismError(RuntimeError):
    """The parallel topology cannot be built or used as asked."""


@dataclass(frozen=True)
class ParallelLayout:
    """Every group of every kind for one ``(world, mp, pp)`` choice.

    Attributes:
        world_size: number of ranks.
        mp: model-parallel size (ranks per mp group).
        pp: pipeline-parallel size.
        dp: data-parallel size (``world_size // (mp * pp)``).
        groups: ``{'mp': [[ranks], ...], 'pp': ..., 'dp': ...}``; each group
            sorted, the groups of one kind partitioning ``range(world_size)``.
    """
    world_size: int
    mp: int
    pp: int
    dp: int
    groups: Dict[str, List[List[int]]]

    @property
    def shape(self) -> Tuple[int, int, int]:
        """The grid shape in ``DIMS`` order: ``(dp, pp, mp)``."""
        return (self.dp, self.pp, self.mp)

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ``kind`` (``mp``, ``pp`` or ``dp``) group holding ``rank``."""
        dp_index, pp_index, mp_index = self.coords(rank)
        if kind == 'mp':
            # mp groups are listed by (dp, pp) position.
            return self.groups['mp'][dp_index * self.pp + pp_index]
        if kind == 'pp':
            return self.groups['pp'][dp_index * self.mp + mp_index]
        if kind == 'dp':
            return self.groups['dp'][pp_index * self.mp + mp_index]
        raise ValueError(f'kind={kind!r} is not a group kind; '
                         f'allowed: {", ".join(DIMS)}')

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """``(dp_index, pp_index, mp_index)`` of ``rank`` in the grid."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f'rank={rank} is outside world size '
                             f'{self.world_size}')
        return (rank // (self.mp * self.pp), rank // self.mp % self.pp,
                rank % self.mp)


def check_sizes(world_size: int,
                model_parallelism: int = 1,
                pipeline_parallelism: int = 1) -> Tuple[int, int, int]:
    """Validate the sizes and return ``(mp, pp, dp)``.

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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ParallelismError(f'{key}={value!r} must be an int >= 1')
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


def parallel_layout(world_size: int,
                    model_parallelism: int = 1,
                    pipeline_parallelism: int = 1) -> ParallelLayout:
    """Compute every mp, pp and dp group for a world of ``world_size`` ranks.

    Args:
        world_size: number of ranks.
        model_parallelism: ranks per model-parallel group.
        pipeline_parallelism: ranks per pipeline-parallel group.

    Returns:
        The layout; group lists are in the order ``init_parallelism`` creates
        them (every rank must create groups in the same order).

    Raises:
        ParallelismError: as :func:`check_sizes`.
    """
    mp, pp, dp = check_sizes(world_size, model_parallelism,
                             pipeline_parallelism)
    block = mp * pp  # ranks holding one full model replica
    groups = {
        # Consecutive runs of mp ranks.
        'mp': [list(range(s, s + mp)) for s in range(0, world_size, mp)],
        # Inside each replica block, ranks with the same mp index, stride mp.
        'pp': [
            list(range(b + m, b + block, mp))
            for b in range(0, world_size, block) for m in range(mp)
        ],
        # Ranks at the same place in every replica block, stride mp * pp.
        'dp': [list(range(j, world_size, block)) for j in range(block)],
    }
    return ParallelLayout(world_size, mp, pp, dp, groups)
