"""An infinite shuffling sampler that holds no list of indices.

MMEngine's ``InfiniteSampler`` shuffles with ``torch.randperm(n)``: a list
of every index, 8 bytes each per rank (321 MiB for 8.4 M packed windows,
docs/benchmarks.md). :class:`PermutedInfiniteSampler` computes position
``i`` of epoch ``e``'s order as ``permute(i)``, a seeded bijection of
``[0, n)``: a 4-round Feistel network over the smallest power-of-four
domain ``>= n`` (bijective whatever its round function), walked until it
lands inside ``[0, n)`` (cycle walking: fewer than 4 steps on average, as
the domain is under ``4 n``). Memory is constant, an index costs a few
microseconds, and any global position is reached in O(1): data rank ``r``
of ``W`` reads positions ``r, r + W, ...`` directly, and a resume (mmpar's
``skip``, :mod:`mmpar.runner.data_position`) starts at the exact sample
without drawing the skipped epochs.
"""
from typing import Iterator

from mmpar.registry import DATA_SAMPLERS
from mmpar.runner.loops import SkippableInfiniteSampler

ROUNDS = 4
MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a well-mixed 64-bit function of ``value``."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


class FeistelPermutation:
    """A seeded bijection of ``[0, size)``.

    Args:
        size: the number of indices (>= 1).
        key: the seed; another key gives another order.
    """

    def __init__(self, size: int, key: int):
        self.size = size
        self.half_bits = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
        self.half_mask = (1 << self.half_bits) - 1
        self.keys = [_mix(key * ROUNDS + r) for r in range(ROUNDS)]

    def _encrypt(self, value: int) -> int:
        left, right = value >> self.half_bits, value & self.half_mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.half_mask)
        return (left << self.half_bits) | right

    def __call__(self, index: int) -> int:
        value = self._encrypt(index)
        while value >= self.size:  # cycle walking: stays a bijection
            value = self._encrypt(value)
        return value


@DATA_SAMPLERS.register_module()
class PermutedInfiniteSampler(SkippableInfiniteSampler):
    """mmpar's ``InfiniteSampler`` (an endless stream of epochs, rank ``r``
    of ``W`` at global positions ``r, r + W, ...``, ``skip`` to resume at
    the sample), shuffled by a seeded bijection per epoch instead of a
    list: constant memory whatever the data set's size.

    Args (MMEngine's): ``dataset``, ``shuffle`` (``True``), ``seed``
    (``None``: shared by the ranks). Epoch ``e``'s order is
    ``FeistelPermutation(len(dataset), seed * 2**32 + e)``; another order
    than ``InfiniteSampler``'s ``randperm``.
    """

    def _indices_of_rank(self) -> Iterator[int]:
        position = self._start * self.world_size + self.rank
        epoch, offset = divmod(position, self.size)
        permute = self._epoch_order(epoch)
        while True:
            yield permute(offset) if self.shuffle else offset
            offset += self.world_size
            while offset >= self.size:
                offset -= self.size
                epoch += 1
                permute = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.size, (self.seed << 32) + epoch)
