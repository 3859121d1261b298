"""The layouts a layout search tries: candidates and their configs.

A :class:`Candidate` is one way to lay a config's model out over N ranks:
the size of every axis of :data:`~mmpar.parallel.dims.AXES`, the pipeline
schedule and micro-batches when ``pp > 1``, and the activation-checkpointing
mode. :func:`enumerate_candidates` lists every combination the search
considers (legal or not: the validator decides that, see :mod:`.search`);
:func:`candidate_config` turns one into the config that trains it, from the
user's config with only the keys the layout needs changed and the global
batch kept.
"""
import copy
import itertools
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from mmengine.config import Config
from torch import nn

from mmpar.parallel.config import SEED_SIZE_KEYS, ParallelConfig
from mmpar.parallel.dims import AXES
from mmpar.parallelize.activation import (check_activation_checkpointing,
                                          merge_wrapper_key)
from mmpar.wrappers.builder import declared, default_wrapper_cfg

# Single-stage schedules put one stage on a pp rank; the multi-stage ones
# tried hold 2 (virtual) stages per rank.
DEFAULT_SCHEDULES = ('1F1B', 'GPipe', 'Interleaved1F1B')
# Activation checkpointing modes, least recomputation first (None: off).
CHECKPOINTING_MODES = (None, 'selective', 'full')


@dataclass(frozen=True)
class Candidate:
    """One layout of N ranks.

    Attributes:
        sizes: ``(axis, size)`` for every axis of ``AXES``, in mesh order.
        schedule: the pipeline schedule (``pp > 1`` only).
        num_microbatches: micro-batches per batch (``pp > 1`` only).
        stages_per_rank: pipeline stages each pp rank holds.
        checkpointing: activation checkpointing mode, None for off.
    """
    sizes: Tuple[Tuple[str, int], ...]
    schedule: Optional[str] = None
    num_microbatches: Optional[int] = None
    stages_per_rank: int = 1
    checkpointing: Optional[str] = None

    @property
    def axes(self) -> Dict[str, int]:
        return dict(self.sizes)

    @property
    def data_ranks(self) -> int:
        """Ranks that read different batches: ``dp_replicate x dp_shard``."""
        axes = self.axes
        return axes['dp_replicate'] * axes['dp_shard']

    @property
    def layout(self) -> 'Candidate':
        """The same layout without activation checkpointing."""
        return Candidate(self.sizes, self.schedule, self.num_microbatches,
                         self.stages_per_rank)

    @property
    def label(self) -> str:
        """Short and unique: ``dp_shard=2 pp=2 (1F1B, 4 mb) ckpt=full``."""
        parts = [f'{axis}={size}' for axis, size in self.sizes if size > 1]
        text = ' '.join(parts) or 'one rank'
        if self.schedule is not None:
            virtual = f', {self.stages_per_rank} stages/rank' \
                if self.stages_per_rank > 1 else ''
            text += f' ({self.schedule}, {self.num_microbatches} mb{virtual})'
        if self.checkpointing:
            text += f' ckpt={self.checkpointing}'
        return text


def factorizations(world_size: int, num_axes: int) -> List[Tuple[int, ...]]:
    """Every tuple of ``num_axes`` sizes >= 1 whose product is
    ``world_size``, in lexicographic order."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [sizes for sizes in itertools.product(divisors, repeat=num_axes)
            if math.prod(sizes) == world_size]


def block_classes(model: nn.Module) -> List[str]:
    """The class names of a model's repeated blocks: what the pipeline
    protocol declares as its layers (``pipeline_layers``), else the
    classes of ``model.layers``."""
    from mmpar.analysis.activations import _block_class
    from mmpar.parallelize.pipeline.split import layer_names
    try:
        names = layer_names(model)
    except (TypeError, ValueError):
        return _block_class(model)
    modules = dict(model.named_modules())
    return sorted({type(modules[name]).__name__ for name in names})


def enumerate_candidates(cfg: Config, world_size: int, *,
                         replicating: bool,
                         schedules: Sequence[str] = DEFAULT_SCHEDULES,
                         microbatches: Optional[Sequence[int]] = None,
                         checkpointing: Sequence[Optional[str]] =
                         CHECKPOINTING_MODES) -> List[Candidate]:
    """Every layout of ``world_size`` ranks the search considers.

    Args:
        cfg: the user's config (its own pipeline schedule, micro-batches and
            checkpointing mode are always among the choices).
        world_size: the number of ranks.
        replicating: the wrapper replicates the model over the data axis
            (DDP and kin): ``dp_replicate`` and ``dp_shard`` then mean the
            same, and only ``dp_shard`` is used.
        schedules: pipeline schedules to try when ``pp > 1``.
        microbatches: micro-batch counts to try; None: ``pp`` and ``2 pp``.
        checkpointing: activation checkpointing modes to try.

    Returns:
        The candidates, legal or not (the search asks the validator).
    """
    parallel = ParallelConfig.from_cfg(cfg.get('parallel'))
    own = dict(parallel.pipeline or {})
    own_ac = _own_checkpointing(cfg)
    modes = list(dict.fromkeys([own_ac, *checkpointing]))
    schedules = list(dict.fromkeys(
        [own.get('schedule', '1F1B')] * bool(own) + list(schedules)))
    candidates = []
    model = cfg.get('model')  # model.moe: mixture-of-experts layers
    experts = isinstance(model, dict) and model.get('moe') is not None
    for sizes in factorizations(world_size, len(AXES)):
        axes = dict(zip(AXES, sizes))
        if replicating and axes['dp_replicate'] > 1:
            continue
        if axes['ep'] > 1 and not experts:  # nothing for ep to split
            continue
        pp = axes['pp']
        pipelines = [(None, None, 1)]
        if pp > 1:
            counts = list(microbatches or (pp, 2 * pp))
            if own.get('num_microbatches'):
                counts.insert(0, own['num_microbatches'])
            pipelines = [(schedule, count, _stages_per_rank(schedule, own))
                         for schedule in schedules
                         for count in dict.fromkeys(counts)]
        for (schedule, count, stages), mode in itertools.product(
                pipelines, modes):
            candidates.append(Candidate(
                tuple(axes.items()), schedule, count, stages, mode))
    return candidates


def _stages_per_rank(schedule: str, own: dict) -> int:
    from mmpar.parallelize.pipeline.schedules import is_multi_stage
    if not is_multi_stage(schedule):
        return 1
    if own.get('schedule') == schedule:
        return own.get('stages_per_rank', 2)
    return 2


def _own_checkpointing(cfg: Config) -> Optional[str]:
    ac_cfg, _ = merge_wrapper_key(cfg.get('activation_checkpointing'),
                                  cfg.get('model_wrapper_cfg'))
    ac_cfg = check_activation_checkpointing(ac_cfg)
    return ac_cfg['mode'] if ac_cfg else None


def wrapper_replicates(cfg: Config) -> bool:
    """Whether the config's data-parallel wrapper replicates the model
    (its class declares it does not shard parameters)."""
    parallel = ParallelConfig.from_cfg(cfg.get('parallel'))
    wrapper = cfg.get('model_wrapper_cfg') or default_wrapper_cfg(parallel)
    return not declared(wrapper['type']).shards_parameters


def written_candidate(cfg: Config, world_size: int) -> Candidate:
    """The config's own layout at ``world_size`` ranks, as a candidate.

    Raises:
        ConfigError / ParallelismError: the config's layout is refused.
    """
    from mmpar.config_check import check_layout
    plan = check_layout(cfg, world_size)
    dims, pipe, ac_cfg = plan.dims, plan.pipeline, \
        plan.activation_checkpointing  # checked by check_layout
    mode = ac_cfg['mode'] if ac_cfg else None
    sizes = tuple((axis, getattr(dims, axis)) for axis in AXES)
    if wrapper_replicates(cfg) and dims.dp_replicate > 1:
        sizes = tuple((a, 1 if a == 'dp_replicate' else
                       dims.dp if a == 'dp_shard' else s) for a, s in sizes)
    if not dims.pp_enabled:
        return Candidate(sizes, checkpointing=mode)
    return Candidate(sizes, pipe.schedule, pipe.num_microbatches,
                     pipe.stages_per_rank, mode)


def candidate_config(cfg: Config, candidate: Candidate, batch: int,
                     tp_plan=None, block_names: Sequence[str] = ()
                     ) -> Tuple[Config, dict]:
    """The config that trains ``candidate`` with ``batch`` samples per step.

    Only what the layout needs changes: the ``parallel`` section unless
    the layout is the config's own (every axis size, ``tp_plan`` when
    ``tp > 1``, ``pipeline`` when ``pp > 1``; the section's other keys
    kept), ``activation_checkpointing`` and the
    per-rank ``train_dataloader.batch_size`` (``batch`` over the data
    ranks). A wrapper's ``hybrid_shard_size`` and older
    ``activation_checkpointing`` key move to those keys.

    Args:
        cfg: the user's config (not changed).
        candidate: the layout.
        batch: global samples per step.
        tp_plan: the tensor-parallel plan for ``tp > 1``.
        block_names: the module classes to checkpoint.

    Returns:
        ``(config, changes)``: the full config, and the changed top-level
        keys with their new values (what a config inheriting ``cfg`` sets).

    Raises:
        ValueError: ``batch`` that the data ranks do not divide.
    """
    if batch % candidate.data_ranks:
        raise ValueError(
            f'train_dataloader.batch_size: the global batch {batch} does not '
            f'split over {candidate.data_ranks} data ranks; allowed: layouts '
            'whose dp_replicate x dp_shard divides it')
    changes = {}
    wrapper = cfg.get('model_wrapper_cfg')
    ac_cfg, plain_wrapper = merge_wrapper_key(
        cfg.get('activation_checkpointing'), wrapper)
    if plain_wrapper is not None and 'hybrid_shard_size' in plain_wrapper:
        plain_wrapper = {k: v for k, v in plain_wrapper.items()
                         if k != 'hybrid_shard_size'}
    # A wrapper's hybrid_shard_size moves to the parallel section.
    if candidate.layout != _own_layout(cfg, candidate) or \
            plain_wrapper != wrapper:
        changes['parallel'] = _parallel_section(cfg, candidate, tp_plan)
    if plain_wrapper != wrapper:
        changes['model_wrapper_cfg'] = plain_wrapper
    current = check_activation_checkpointing(ac_cfg)
    if candidate.checkpointing is None:
        wanted = None
    elif current and current['mode'] == candidate.checkpointing:
        wanted = ac_cfg
    else:
        wanted = dict(module_classes=list(
            current['module_classes'] if current else block_names),
            mode=candidate.checkpointing)
    if wanted != cfg.get('activation_checkpointing'):
        changes['activation_checkpointing'] = wanted
    per_rank = batch // candidate.data_ranks
    if per_rank != cfg.train_dataloader.batch_size:
        changes['train_dataloader'] = dict(batch_size=per_rank)
    new = copy.deepcopy(cfg)
    for key, value in changes.items():
        if key == 'train_dataloader':
            new.train_dataloader.batch_size = per_rank
        else:
            new[key] = copy.deepcopy(value)
    return new, changes


def _own_layout(cfg: Config, candidate: Candidate) -> Optional[Candidate]:
    """The config's own layout (without checkpointing) at the candidate's
    world size; None when the config's layout is refused there."""
    from mmpar.failures import ConfigError
    from mmpar.parallel.dims import ParallelismError
    try:
        return written_candidate(cfg, math.prod(candidate.axes.values())
                                 ).layout
    except (ConfigError, ParallelismError, ValueError):
        return None


def _parallel_section(cfg: Config, candidate: Candidate, tp_plan) -> dict:
    given = dict(cfg.get('parallel') or {})
    keep = {k: v for k, v in given.items()
            if k not in AXES + SEED_SIZE_KEYS + ('tp_plan', 'pipeline')}
    section = dict(candidate.sizes)
    axes = candidate.axes
    if axes['tp'] > 1:
        section['tp_plan'] = tp_plan
    if axes['pp'] > 1:
        pipeline = dict(schedule=candidate.schedule,
                        num_microbatches=candidate.num_microbatches)
        points = (given.get('pipeline') or {}).get('split_points')
        if points and len(points) + 1 == axes['pp'] * \
                candidate.stages_per_rank:
            pipeline['split_points'] = list(points)  # the user's cut
        if candidate.stages_per_rank > 1:
            pipeline['stages_per_rank'] = candidate.stages_per_rank
        section['pipeline'] = pipeline
    section.update(keep)
    return section
