"""Iteration-based training that resumes without replaying the data loader.

MMEngine's ``IterBasedTrainLoop`` resumes at iteration k by calling
``next(dataloader)`` k times: every skipped batch is loaded, decoded and
collated again, which on large data takes hours. mmpar's loop instead tells a
:class:`SkippableInfiniteSampler` where to start, so the first batch after a
resume is the one the uninterrupted run would have seen next.
"""
import itertools
import logging
from typing import Iterator

import torch
from mmengine.dataset import InfiniteSampler as MMEngineInfiniteSampler
from mmengine.logging import print_log
from mmengine.runner import IterBasedTrainLoop as MMEngineIterBasedTrainLoop
# The iterator MMEngine's loop uses (private; no public equivalent).
from mmengine.runner.loops import _InfiniteDataloaderIterator

from mmpar.registry import DATA_SAMPLERS, LOOPS


@DATA_SAMPLERS.register_module('InfiniteSampler')
class SkippableInfiniteSampler(MMEngineInfiniteSampler):
    """MMEngine's ``InfiniteSampler`` that can start at any position.

    Registered as ``InfiniteSampler`` in the ``mmpar`` scope; the index stream
    is the same as MMEngine's.
    """

    _start = 0

    def skip(self, num_samples: int) -> None:
        """Start this rank's stream after its first ``num_samples`` indices."""
        self._start = num_samples
        # MMEngine builds the index generator once, in __init__.
        self.indices = self._indices_of_rank()

    def _infinite_indices(self) -> Iterator[int]:
        # The global stream is a concatenation of permutations of the data
        # set; rank r takes positions r, r + W, ... Skipping n per-rank
        # samples skips n * W global positions: whole permutations are only
        # drawn (to advance the generator), never iterated.
        generator = torch.Generator()
        generator.manual_seed(self.seed)
        full, offset = divmod(self._start * self.world_size, self.size)

        def permutation():
            if self.shuffle:
                return torch.randperm(self.size, generator=generator)
            return torch.arange(self.size)

        for _ in range(full):
            permutation()
        yield from permutation()[offset:].tolist()
        while True:
            yield from permutation().tolist()

    def _indices_of_rank(self) -> Iterator[int]:
        return itertools.islice(self._infinite_indices(), self.rank, None,
                                self.world_size)


class _ReplayAnsweredIterator:
    """Answers MMEngine's ``k`` replay calls to ``next()`` without loading
    data (the sampler already starts after those batches), then delegates."""

    def __init__(self, iterator, num_replayed: int):
        self._iterator = iterator
        self._pending = num_replayed

    def __iter__(self):
        return self

    def __next__(self):
        if self._pending > 0:
            self._pending -= 1
            return None
        return next(self._iterator)


@LOOPS.register_module('IterBasedTrainLoop')
class FastResumeIterBasedTrainLoop(MMEngineIterBasedTrainLoop):
    """MMEngine's ``IterBasedTrainLoop``; a resume restores the sampler
    position instead of replaying ``iter`` batches.

    Registered as ``IterBasedTrainLoop`` in the ``mmpar`` scope, and used by
    ``mmpar.Runner`` for ``train_cfg = dict(by_epoch=False, ...)``.
    """

    def run(self) -> torch.nn.Module:
        if self.iter > 0:
            self._skip_trained_batches()
        return super().run()

    def _skip_trained_batches(self) -> None:
        sampler = getattr(self.dataloader, 'sampler', None)
        if not isinstance(sampler, SkippableInfiniteSampler):
            print_log(
                'The train sampler cannot skip ahead, so the data loader is '
                f'replayed for {self.iter} batches; use sampler='
                "dict(type='InfiniteSampler') to resume instantly.",
                logger='current',
                level=logging.WARNING)
            return
        sampler.skip(self.iter * self.dataloader.batch_size)
        self.dataloader_iterator = _ReplayAnsweredIterator(
            _InfiniteDataloaderIterator(self.dataloader), self.iter)
