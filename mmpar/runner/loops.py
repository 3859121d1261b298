"""Training loops that resume at the exact sample without replaying data.

MMEngine's ``IterBasedTrainLoop`` resumes at iteration k by calling
``next(dataloader)`` k times: every skipped batch is loaded, decoded and
collated again, which on large data takes hours. mmpar's loop instead tells a
:class:`SkippableInfiniteSampler` where to start, so the first batch after a
resume is the one the uninterrupted run would have seen next. MMEngine's
``EpochBasedTrainLoop`` restarts a checkpointed epoch from its first batch
(training on its first part twice); mmpar's starts a
:class:`SkippableDefaultSampler` at the checkpoint's position in the epoch
(:mod:`mmpar.runner.data_position`), also on another number of data ranks.
"""
import itertools
import logging
from typing import Iterator

import torch
from mmengine.dataset import DefaultSampler as MMEngineDefaultSampler
from mmengine.dataset import InfiniteSampler as MMEngineInfiniteSampler
from mmengine.logging import print_log
from mmengine.runner import EpochBasedTrainLoop as MMEngineEpochBasedTrainLoop
from mmengine.runner import IterBasedTrainLoop as MMEngineIterBasedTrainLoop

from mmpar.failures import ConfigError
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

    def reseed(self, seed: int) -> None:
        """Draw the order from ``seed`` (a resumed run's: the saved one)."""
        self.seed = seed
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


@DATA_SAMPLERS.register_module('DefaultSampler')
class SkippableDefaultSampler(MMEngineDefaultSampler):
    """MMEngine's ``DefaultSampler`` whose next epoch can start at a global
    position of its order.

    Registered as ``DefaultSampler`` in the ``mmpar`` scope; the indices are
    MMEngine's.
    """

    _start = 0

    def skip(self, num_samples: int) -> None:
        """Start the next epoch after its first ``num_samples`` global
        positions (a multiple of the number of data ranks), then go on
        whole."""
        if num_samples % self.world_size:
            raise ValueError(f'cannot skip {num_samples} samples on '
                             f'{self.world_size} data ranks: not a multiple')
        self._start = num_samples

    def reseed(self, seed: int) -> None:
        """Draw each epoch's order from ``seed`` (a resumed run's: the saved
        one)."""
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        # This rank holds global positions rank, rank + W, ...: the first
        # num_samples of them are its first num_samples / W.
        indices = list(super().__iter__())[self._start // self.world_size:]
        self._start = 0
        return iter(indices)


def _iterate_without_a_draw(dataloader):
    """``iter(dataloader)``, leaving torch's global generator as it was.

    Why: a ``DataLoader`` iterator draws its base seed from the global
    generator when made. The uninterrupted run made the iterator a resume
    goes on with before its checkpoint (the draw is in the saved RNG state);
    the resumed run, whose states were just restored, makes it again, and
    every later draw (dropout) would come one off."""
    state = torch.get_rng_state()
    iterator = iter(dataloader)
    torch.set_rng_state(state)
    return iterator


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

    # Global samples the saved run had read, and the iteration it resumed
    # at (None: not resumed; then iter x global batch).
    _resume_samples = None
    _resume_iter = 0

    def resume_at_sample(self, num_samples: int) -> None:
        """Continue the sample stream after its first ``num_samples`` global
        positions (what the saved run read) instead of ``iter`` times this
        run's global batch."""
        self._resume_samples = num_samples
        self._resume_iter = self.iter

    def samples_read(self, iterations: int, global_batch: int) -> int:
        """Global samples read by the end of iteration ``iterations``: this
        run's ``global_batch`` an iteration since its resume, on top of what
        the saved run had read (which may have used another batch)."""
        if self._resume_samples is None:
            return iterations * global_batch
        return (self._resume_samples +
                (iterations - self._resume_iter) * global_batch)

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
        per_rank = self.iter * self.dataloader.batch_size
        if self._resume_samples is not None:
            per_rank, rest = divmod(self._resume_samples, sampler.world_size)
            if rest:
                raise ConfigError(
                    f'the checkpoint resumed was saved after '
                    f'{self._resume_samples} samples, which '
                    f'{sampler.world_size} data ranks cannot split: the run '
                    'could not continue at the exact sample it stopped at. '
                    'Allowed: a number of data ranks that divides '
                    f'{self._resume_samples}')
        sampler.skip(per_rank)
        # The sampler never ends, so the loader's own iterator serves (what
        # MMEngine's loop wraps it in only restarts a finite one).
        self.dataloader_iterator = _ReplayAnsweredIterator(
            _iterate_without_a_draw(self.dataloader), self.iter)


@LOOPS.register_module('EpochBasedTrainLoop')
class ResumableEpochBasedTrainLoop(MMEngineEpochBasedTrainLoop):
    """MMEngine's ``EpochBasedTrainLoop``; a resume in the middle of an epoch
    goes on at the first batch not yet trained on.

    Registered as ``EpochBasedTrainLoop`` in the ``mmpar`` scope, and used by
    ``mmpar.Runner`` for ``train_cfg = dict(by_epoch=True, ...)``.

    Attributes:
        batches_in_epoch: the batches of the current epoch trained once the
            running iteration is done (what a checkpoint saved by its
            ``after_train_iter`` hooks records).
    """

    batches_in_epoch = 0
    _resume_batches = 0

    def resume_within_epoch(self, num_samples: int) -> None:
        """Start the next epoch ``num_samples`` global samples in (whole
        iterations of this run's global batch)."""
        sampler = getattr(self.dataloader, 'sampler', None)
        if not isinstance(sampler, SkippableDefaultSampler):
            print_log(
                f'The train sampler cannot skip ahead, so the first '
                f'{num_samples} samples of epoch {self.epoch + 1} are '
                "trained again; use sampler=dict(type='DefaultSampler') to "
                'resume at the exact sample.',
                logger='current',
                level=logging.WARNING)
            return
        sampler.skip(num_samples)
        self._resume_batches = num_samples // (self.dataloader.batch_size *
                                               sampler.world_size)

    def run_epoch(self) -> None:
        skipped, self._resume_batches = self._resume_batches, 0
        self.runner.call_hook('before_train_epoch')
        self.runner.model.train()
        # Batch indices go on from the skipped ones, as in an uninterrupted
        # run (the logger and interval hooks read them).
        batches = (_iterate_without_a_draw(self.dataloader) if skipped else
                   self.dataloader)
        for idx, data_batch in enumerate(batches, start=skipped):
            self.batches_in_epoch = idx + 1
            self.run_iter(idx, data_batch)
        self.runner.call_hook('after_train_epoch')
        self._epoch += 1
        self.batches_in_epoch = 0
