"""Data by data rank: samplers and the evaluator work over the data axis.

MMEngine's samplers shard a data set by the global rank and world size, and
its ``collect_results`` gathers every rank's results. With tensor-,
pipeline- or context-parallel peers (``tp``, ``pp`` or ``cp > 1``) both are
wrong: peers must read the same batch (a cp rank then keeps its chunks of
each sequence), and counting every peer's results would count each sample
``tp * pp * cp`` times (then truncate to the data set's size, dropping real
samples). The Runner passes its loaders and metrics through here; with
``dp == world`` (every layout without tp/pp/cp) nothing changes.

Samplers are fixed after MMEngine builds them, so configs keep naming
MMEngine's ``DefaultSampler`` / ``InfiniteSampler`` unchanged.
"""
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from mmengine.dataset import DefaultSampler, InfiniteSampler
from mmengine.evaluator import BaseMetric, Evaluator
from mmengine.structures import BaseDataElement
from torch.utils.data import DataLoader

from mmpar.dist import all_gather_objects
from mmpar.failures import ConfigError
from mmpar.parallel.axes import BY_NAME, PEER_AXES
from mmpar.parallel.topology import ParallelTopology


def _to_cpu(data):
    """Tensors and data elements in ``data`` moved to the CPU (what
    MMEngine's ``collect_results`` does to metric results)."""
    if isinstance(data, (torch.Tensor, BaseDataElement)):
        return data.to('cpu')
    if isinstance(data, list):
        return [_to_cpu(item) for item in data]
    if isinstance(data, tuple):
        return tuple(_to_cpu(item) for item in data)
    if isinstance(data, dict):
        return {key: _to_cpu(value) for key, value in data.items()}
    return data


def _needs_data_axis(topology: Optional[ParallelTopology]) -> bool:
    return topology is not None and \
        topology.dp_size != topology.dims.world_size


def shard_sampler(sampler, rank: int, size: int) -> None:
    """Make an MMEngine sampler built for the world read ``rank``'s share
    of ``size`` data ranks instead (in place).

    Raises:
        ConfigError: a sampler type that shards some other way.
    """
    if isinstance(sampler, DefaultSampler):
        sampler.rank, sampler.world_size = rank, size
        # DefaultSampler.__init__'s arithmetic, for the new rank and size.
        if sampler.round_up:
            sampler.num_samples = math.ceil(len(sampler.dataset) / size)
            sampler.total_size = sampler.num_samples * size
        else:
            sampler.num_samples = math.ceil(
                (len(sampler.dataset) - rank) / size)
        return
    if isinstance(sampler, InfiniteSampler):
        sampler.rank, sampler.world_size = rank, size
        # Built once in __init__ (private; no public way to rebuild it).
        sampler.indices = sampler._indices_of_rank()
        return
    raise ConfigError(
        f'sampler type={type(sampler).__name__!r} shards data by the global '
        'rank, which is wrong when tp, pp or cp > 1 (tensor/pipeline/context '
        'peers must read the same batch); allowed: DefaultSampler, '
        'InfiniteSampler (or subclasses)')


def shard_loader_by_data_rank(loader: DataLoader,
                              topology: Optional[ParallelTopology]
                              ) -> DataLoader:
    """Point ``loader``'s sampler and worker seeds at the data axis.

    Returns:
        ``loader`` (changed in place when tp or pp > 1).
    """
    if not _needs_data_axis(topology) or not isinstance(loader, DataLoader):
        return loader
    shard_sampler(loader.sampler, topology.dp_rank, topology.dp_size)
    init_fn = loader.worker_init_fn
    if isinstance(init_fn, functools.partial) and 'rank' in init_fn.keywords:
        # MMEngine seeds workers by global rank: peers would augment the same
        # samples differently.
        keywords = dict(init_fn.keywords, rank=topology.dp_rank)
        loader.worker_init_fn = functools.partial(init_fn.func, *init_fn.args,
                                                  **keywords)
    return loader


def evaluate_on_data_axis(metric: BaseMetric, size: int,
                          topology: ParallelTopology) -> dict:
    """``BaseMetric.evaluate`` over the data axis only.

    One rank per data index contributes (tp and cp rank 0 of the last
    pipeline stage, which holds the outputs; a context-parallel model sums
    its predictions over its cp group); their results are gathered over
    their dp group in MMEngine's order (interleaved by rank, truncated to
    ``size``), the metric is computed on the first of them and broadcast to
    every rank.
    """
    # The reporting rank of every peer axis (tp and cp rank 0, the last
    # stage); the source is the one of them at data index 0.
    dims = topology.dims
    reporter = {axis: BY_NAME[axis].reporter % getattr(dims, axis)
                for axis in PEER_AXES}
    contributes = all(topology.groups[axis].rank == index
                      for axis, index in reporter.items())
    source = dims.rank_at(**reporter)
    metrics = [None]
    if contributes:
        parts = all_gather_objects(metric.results, topology.dp.group)
        if topology.dp_rank == 0:
            ordered = [r for group in zip(*parts) for r in group][:size]
            computed = metric.compute_metrics(_to_cpu(ordered))
            if metric.prefix:
                computed = {f'{metric.prefix}/{k}': v
                            for k, v in computed.items()}
            metrics = [computed]
    dist.broadcast_object_list(metrics, src=source)
    metric.results.clear()
    return metrics[0]


class DataAxisEvaluator(Evaluator):
    """MMEngine's ``Evaluator`` whose metrics collect over the data axis
    (:func:`evaluate_on_data_axis`) instead of the whole world.

    Args:
        metrics: the metrics (built ``BaseMetric`` objects or configs).
        topology: this rank's topology.
    """

    def __init__(self, metrics, topology: ParallelTopology):
        super().__init__(metrics)
        self.topology = topology

    def evaluate(self, size: int) -> dict:
        metrics = {}
        for metric in self.metrics:
            results = evaluate_on_data_axis(metric, size, self.topology)
            clash = sorted(set(results) & set(metrics))
            if clash:
                raise ValueError(
                    f'metric names {clash} are given by two metrics; give '
                    'the metrics different prefixes')
            metrics.update(results)
        return metrics


def evaluate_metrics_on_data_axis(evaluator,
                                  topology: Optional[ParallelTopology]):
    """``evaluator`` collecting over the data axis when tp, pp or cp > 1 (a
    :class:`DataAxisEvaluator` with the same metrics), else itself.

    Raises:
        ConfigError: an evaluator class of its own, which cannot be told
            to collect over the data axis.
    """
    if not _needs_data_axis(topology):
        return evaluator
    if type(evaluator) is not Evaluator:
        raise ConfigError(
            f'evaluator type={type(evaluator).__name__!r} collects over the '
            'whole world, which counts each sample once per tensor/pipeline/'
            'context peer when tp, pp or cp > 1; allowed: the default '
            'Evaluator')
    return DataAxisEvaluator(evaluator.metrics, topology)
