"""One process group and the three collectives the topology API offers."""
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from mmpar.parallel.dims import ParallelismError


class Pending:
    """The result of an ``async_op=True`` call: ``wait()`` gives the tensor.

    For a one-member group nothing was sent and ``wait()`` returns at once.
    """

    def __init__(self, work=None, finish: Callable[[], torch.Tensor] = None):
        self._work = work
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


@dataclass(frozen=True)
class GroupInfo:
    """This process's group of one kind (mp, pp, dp or the whole world).

    Attributes:
        group: the ``ProcessGroup`` (``dist.group.WORLD`` for the world).
        global_ranks: the group's members as global ranks, ascending.
        rank: this process's rank inside the group.
        world_size: number of members.
    """
    group: Optional[dist.ProcessGroup]
    global_ranks: List[int]
    rank: int
    world_size: int

    def reduce(self,
               tensor: torch.Tensor,
               op: dist.ReduceOp = dist.ReduceOp.SUM,
               *,
               async_op: bool = False):
        """All-reduce ``tensor`` in place over the group.

        Returns:
            ``tensor``; with ``async_op=True`` a :class:`Pending` whose
            ``wait()`` returns it once reduced. A one-member group returns
            its input untouched.
        """
        work = None if self.world_size == 1 else dist.all_reduce(
            tensor, op=op, group=self.group, async_op=async_op)
        return Pending(work, lambda: tensor) if async_op else tensor

    def split(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's equal slice of ``tensor`` along ``dim`` (no comms).

        Raises:
            ParallelismError: ``tensor.size(dim)`` is not divisible by the
                group size.
        """
        if self.world_size == 1:
            return tensor
        size = tensor.size(dim)
        if size % self.world_size:
            raise ParallelismError(
                f'cannot split dim {dim} of size {size} over a group of '
                f'{self.world_size} ranks: not divisible')
        # contiguous: a view of a strided slice would surprise a collective.
        return tensor.chunk(self.world_size, dim=dim)[self.rank].contiguous()

    def gather(self, tensor: torch.Tensor, dim: int = -1, *,
               async_op: bool = False):
        """All-gather every member's ``tensor`` and concatenate along ``dim``.

        The inverse of :meth:`split`. Returns the concatenation (a
        :class:`Pending` with ``async_op=True``); a one-member group returns
        its input.
        """
        if self.world_size == 1:
            return Pending(finish=lambda: tensor) if async_op else tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = dist.all_gather(parts, tensor, group=self.group,
                               async_op=async_op)
        if async_op:
            return Pending(work, lambda: torch.cat(parts, dim=dim))
        return torch.cat(parts, dim=dim)
