"""Every data rank does the same number of collective steps, for any data
set size, ``drop_last`` and loop kind, or the run stops at start-up naming
the key.

A rank with one batch more than its peers would wait in that batch's
collectives (the gradient reduction of training; the parameter gathers of a
sharded or split model's forward in validation) until the collective timeout,
while its peers have moved on. From the sampler's arithmetic the batches of
every data rank are known before the loop starts:

- ``DefaultSampler`` with ``round_up=True`` (the default) gives every rank
  ``ceil(N / W)`` samples (repeats at the end, which evaluation drops):
  always even. With ``round_up=False`` rank ``r`` gets ``len(range(r, N, W))``
  samples, and the batches differ when ``W`` does not divide ``N``.
- ``InfiniteSampler`` never runs out, unless the data set is empty.

An epoch-based train loop needs the same number of batches on every rank; an
iteration-based one at least one batch on each (a rank whose loader is empty
cannot restart it); validation and test need the same number only when the
model's forward has collectives (sharded or split models), replicas (DDP,
naive and bucketed data parallelism) evaluate any split.
"""
import math
from typing import List, Optional

from mmengine.dataset import DefaultSampler, InfiniteSampler
from torch.utils.data import DataLoader

from mmpar.failures import ConfigError


def batches_per_rank(loader: DataLoader) -> Optional[List[float]]:
    """Each data rank's number of batches per epoch of ``loader`` (``inf``
    for an infinite sampler); None where the sampler or batching is not
    MMEngine's (its arithmetic unknown here)."""
    sampler = getattr(loader, 'sampler', None)
    batch_size = getattr(loader, 'batch_size', None)
    if batch_size is None or not isinstance(
            sampler, (InfiniteSampler, DefaultSampler)):
        return None  # a batch_sampler or a sampler of the user's
    num_samples = len(loader.dataset)
    if isinstance(sampler, InfiniteSampler):
        return [math.inf if num_samples else 0] * sampler.world_size
    size = sampler.world_size
    if sampler.round_up:
        samples = [math.ceil(num_samples / size)] * size
    else:
        samples = [len(range(rank, num_samples, size))
                   for rank in range(size)]
    rounding = math.floor if loader.drop_last else math.ceil
    return [rounding(n / batch_size) for n in samples]


def check_even_work(loader, key: str, every_rank_steps: bool,
                    same_count: bool) -> None:
    """Refuse a loader on which data ranks would wait for each other.

    Args:
        loader: the built data loader (sampler sharded by data rank).
        key: its config key (``train_dataloader``...), for the message.
        every_rank_steps: every rank needs at least one batch (a train
            loop).
        same_count: every rank needs the same number of batches (an epoch
            of training, or evaluation of a model whose forward has
            collectives).

    Raises:
        ConfigError: naming the key, the sizes and what is allowed.
    """
    if not isinstance(loader, DataLoader):
        return
    batches = batches_per_rank(loader)
    if batches is None or len(batches) < 2:  # no peers to wait for
        return
    uneven = same_count and len(set(batches)) > 1
    empty = every_rank_steps and min(batches) == 0
    if not (uneven or empty):
        return
    sampler = loader.sampler
    round_up = getattr(sampler, 'round_up', None)
    setting = (f'{len(loader.dataset)} samples on {sampler.world_size} data '
               f'ranks with {key}.batch_size={loader.batch_size}, '
               f'drop_last={loader.drop_last}'
               + ('' if round_up is None else
                  f', sampler round_up={round_up}'))
    counts = ', '.join(str(n) for n in batches)
    if uneven:
        raise ConfigError(
            f'{key}: {setting} give the data ranks {counts} batches: a rank '
            'with more would wait forever in a collective its peers never '
            f'join. Allowed: {key}.sampler.round_up=True (the default: '
            'every rank the same number of samples; evaluation drops the '
            'repeats), or a data set size divisible by the number of data '
            'ranks')
    raise ConfigError(
        f'{key}: {setting} give the data ranks {counts} batches: a rank '
        'without a batch cannot train. Allowed: a non-empty data set, and '
        f'{key}.drop_last=False or a batch_size of at most the samples per '
        'rank')
