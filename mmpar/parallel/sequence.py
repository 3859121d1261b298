"""How one sequence is laid out over the context-parallel (cp) ranks.

The sequence is cut into ``2 * cp`` equal chunks and cp rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` (an early and a late one), so that under
a causal mask every rank attends to the same number of keys
(:mod:`mmpar.parallelize.context` has the attention and the model
protocol). Here is what the layout itself is: which positions a rank holds,
cutting a tensor into its part and joining the parts back, the
:class:`ContextParallel` setting a model holds, and :func:`shard_batch`,
which the step body (:mod:`mmpar.wrappers.base`) calls after the data
preprocessor.
"""
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

# The model protocol's attribute names (mmpar/parallelize/context.py).
ATTENTION_ATTR = 'context_parallel_modules'
SHARDED_ATTR = 'context_parallel_sharded'
SETTING_ATTR = 'context_parallel'


# -- the sequence layout ----------------------------------------------------
def check_seq_len(seq_len: int, cp: int) -> int:
    """The chunk length of a sequence of ``seq_len`` tokens at ``cp``.

    Raises:
        ValueError: ``cp < 1``, or ``seq_len`` not a multiple of ``2 * cp``.
    """
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f'context parallel size cp={cp!r} must be an int '
                         '>= 1')
    if seq_len % (2 * cp):
        raise ValueError(
            f'sequence length {seq_len} must be a multiple of 2 x cp = '
            f'{2 * cp}: context parallelism cuts each sequence into 2 x cp '
            'equal chunks, two per rank')
    return seq_len // (2 * cp)


def chunk_ids(rank: int, cp: int) -> Tuple[int, int]:
    """The two chunks cp rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, cp: int,
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of ``x`` along ``dim``: its two chunks, joined.

    Raises:
        ValueError: ``x.shape[dim]`` not a multiple of ``2 * cp``.
    """
    chunks = x.split(check_seq_len(x.shape[dim], cp), dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, cp)], dim)


def unshard_sequence(shards: Sequence[torch.Tensor],
                     dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`shard_sequence` part, in
    rank order (the inverse of sharding for ranks ``0 .. len(shards)-1``)."""
    cp = len(shards)
    chunks = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        check_seq_len(shard.shape[dim] * cp, cp)
        for chunk, part in zip(chunk_ids(rank, cp), shard.chunk(2, dim)):
            chunks[chunk] = part
    return torch.cat(chunks, dim)


def sequence_positions(seq_len: int, rank: int, cp: int,
                       device=None) -> torch.Tensor:
    """Positions (in the whole sequence of ``seq_len``) of rank ``rank``'s
    tokens, in the order it holds them: ``(seq_len // cp, )`` int64."""
    return shard_sequence(
        torch.arange(seq_len, device=device), rank, cp, dim=0)


# -- the setting a model holds ----------------------------------------------
@dataclass(frozen=True)
class ContextParallel:
    """The cp group a model's attention spans, and this rank's place in it.

    Args:
        group: the context-parallel process group.
        rank: this process's rank in ``group``.
        size: the group's size (cp).
    """
    group: ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, cp: Union['ContextParallel', ProcessGroup,
                          DeviceMesh]) -> 'ContextParallel':
        """From a process group or a 1-D device mesh (the cp sub-mesh)."""
        if isinstance(cp, ContextParallel):
            return cp
        if isinstance(cp, DeviceMesh):
            if cp.ndim != 1:
                raise ValueError(f'context parallel mesh {cp} must be 1-D '
                                 '(the cp sub-mesh)')
            cp = cp.get_group()
        if not isinstance(cp, ProcessGroup):
            raise ValueError(f'context parallel group {cp!r} must be a '
                             'ProcessGroup or a 1-D DeviceMesh')
        return cls(cp, dist.get_rank(cp), dist.get_world_size(cp))

    def positions(self, local_len: int, device=None) -> torch.Tensor:
        """Positions of this rank's ``local_len`` tokens in the whole
        sequence (of ``local_len * size`` tokens).

        Raises:
            ValueError: the whole length not a multiple of ``2 * size``.
        """
        return sequence_positions(local_len * self.size, self.rank,
                                  self.size, device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor."""
        return shard_sequence(x, self.rank, self.size, dim)

    def __deepcopy__(self, memo):
        # A process group cannot be copied, and a copy of the model (a
        # pipeline stage is one) spans the same group.
        return self


def shard_batch(model: nn.Module, data: Any) -> Any:
    """``data`` (a model's preprocessed forward arguments) with the tensors
    the model names in ``context_parallel_sharded`` cut to this rank's part
    along dim 1 (a new dict); ``data`` itself when the model is not in
    context-parallel mode.

    The step body calls it after the data preprocessor: cp peers read the
    same batch, and each keeps its own chunks of inputs and targets.

    Raises:
        ValueError: a sequence length not a multiple of ``2 * cp``.
        TypeError: a model in context-parallel mode whose preprocessed batch
            is not a dict (the protocol names its sequence tensors by key).
    """
    setting = getattr(model, SETTING_ATTR, None)
    if setting is None:
        return data
    if not isinstance(data, Mapping):
        raise TypeError(
            f'context parallelism (parallel.cp={setting.size}) needs the '
            'data preprocessor to return a dict, whose '
            f'{type(model).__name__}.{SHARDED_ATTR} keys are cut along the '
            f'sequence; got a {type(data).__name__}')
    keys = getattr(model, SHARDED_ATTR)
    return {
        key: setting.shard(value) if key in keys and
        isinstance(value, torch.Tensor) else value
        for key, value in data.items()
    }
