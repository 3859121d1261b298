"""Where a run stands in its data: saved with every checkpoint, so that a
resume, on the same or another number of data ranks, starts at the first
sample not yet trained on.

Both of mmpar's train samplers (``DefaultSampler`` for epochs,
``InfiniteSampler`` for iterations) lay out one global order of samples and
give data rank ``r`` of ``W`` the positions ``r, r + W, r + 2W, ...``. With a
per-rank batch ``b``, iteration ``j`` therefore reads the global positions
``[j * G, (j + 1) * G)``, ``G = b * W`` the global batch, whatever ``W`` is.
After ``k`` iterations a run has read the first ``k * G`` positions; a resume
at ``W'`` data ranks with ``b' = G / W'`` continues at that position, each
rank at its own offset of the same order. With another global batch an
iteration-based run still continues at sample ``k * G`` (its iteration
counter goes on from ``k``); an epoch resumed in its middle is refused: its
remaining samples would not make whole iterations of the new batch.
"""
import logging
from typing import Optional

from mmengine.dist import get_world_size
from mmengine.logging import print_log

from mmpar.failures import ConfigError

# The key of a checkpoint's meta that holds the position.
META_KEY = 'data_position'


def global_batch(runner) -> int:
    """Samples one training iteration reads over all data ranks (tensor,
    pipeline and context peers read the same batch: counted once)."""
    topology = runner.topology
    num_data_ranks = (topology.dp_size if topology is not None
                      else get_world_size())
    return runner.train_dataloader.batch_size * num_data_ranks


def saved_position(runner, by_epoch: bool) -> dict:
    """The position a checkpoint records (with MMEngine's ``by_epoch``
    meaning: ``True`` for a save at the end of an epoch).

    Returns:
        ``global_batch``; ``epoch_samples``: the global samples of the
        current epoch trained so far (0 at an epoch's end; ``None`` for a
        loop without epochs, whose position is ``iter * global_batch``);
        ``sampler_seed``: the seed of the train sampler's order;
        ``samples``: the global samples an iteration loop has read (None
        for an epoch loop).
    """
    batches = getattr(runner.train_loop, 'batches_in_epoch', None)
    if batches is not None and by_epoch:
        batches = 0
    batch = global_batch(runner)
    sampler = getattr(runner.train_dataloader, 'sampler', None)
    samples_read = getattr(runner.train_loop, 'samples_read', None)
    # MMEngine's save names the iteration after the running one when the
    # save is not at an epoch's end (meta['iter'] = iter + 1).
    samples = samples_read(runner.iter + (0 if by_epoch else 1), batch) \
        if callable(samples_read) else None
    return dict(global_batch=batch,
                epoch_samples=None if batches is None else batches * batch,
                sampler_seed=getattr(sampler, 'seed', None), samples=samples)


def restore_position(runner, saved: Optional[dict]) -> None:
    """Point the train loop at ``saved`` (a checkpoint's position) after a
    resume; a checkpoint without one (written before positions were saved)
    changes nothing.

    Raises:
        ConfigError: the resumed run would start in the middle of an epoch
            (checkpointed by iteration) with another global batch than the
            saved run's.
    """
    if not saved:
        return
    loop = runner.train_loop
    # The saved run's order: its sampler's seed was drawn at random when the
    # config set none (MMEngine's default), and this run's sampler, built
    # before the checkpoint was read, drew another.
    sampler = getattr(getattr(loop, 'dataloader', None), 'sampler', None)
    reseed = getattr(sampler, 'reseed', None)
    if reseed is not None and saved.get('sampler_seed') is not None:
        reseed(saved['sampler_seed'])
    within_epoch = getattr(loop, 'resume_within_epoch', None)
    epoch_samples = saved.get('epoch_samples')
    if within_epoch is not None and not epoch_samples:
        return  # at an epoch boundary any global batch resumes exactly
    if within_epoch is None and runner.iter == 0:
        return
    resume_at_sample = getattr(loop, 'resume_at_sample', None)
    if within_epoch is None and resume_at_sample is not None:
        # The stream goes on at the sample the saved run stopped at (its own
        # count: an earlier resume may have changed the batch).
        samples = saved.get('samples')
        resume_at_sample(runner.iter * saved['global_batch']
                         if samples is None else samples)
        return
    _check_same_global_batch(runner, saved['global_batch'])
    if within_epoch is not None:
        within_epoch(epoch_samples)
    elif epoch_samples:
        print_log(
            f'The checkpoint was saved {epoch_samples} samples into an '
            f'epoch, which {type(loop).__name__} cannot skip: they are '
            'trained again.', logger='current', level=logging.WARNING)


def _check_same_global_batch(runner, saved_batch: int) -> None:
    batch = global_batch(runner)
    if batch == saved_batch:
        return
    num_data_ranks = batch // runner.train_dataloader.batch_size
    allowed = (f'train_dataloader.batch_size={saved_batch // num_data_ranks}'
               if saved_batch % num_data_ranks == 0 else
               f'a number of data ranks that divides {saved_batch}')
    raise ConfigError(
        f'train_dataloader.batch_size={runner.train_dataloader.batch_size} '
        f'on {num_data_ranks} data ranks reads {batch} samples per '
        f'iteration, but the checkpoint resumed was saved in the middle of '
        f'the data reading {saved_batch}: the run could not continue at the '
        f'exact sample it stopped at. Allowed: {allowed} (the same global '
        'batch; resume at an epoch boundary to change it)')
