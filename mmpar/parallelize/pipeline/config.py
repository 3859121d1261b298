"""The ``parallel.pipeline`` section, checked at start-up.

::

    parallel = dict(pp=2, pipeline=dict(
        split_points=['blocks.2'],   # where stages 1, 2, ... begin
        schedule='1F1B',             # a PIPELINE_SCHEDULES name
        num_microbatches=4,          # must divide the per-rank batch size
        stages_per_rank=1,           # > 1 for the virtual-stage schedules
        reshard_per_microbatch=True))  # FSDP2 stages: see below

``split_points`` may be left out: the layers are then split evenly.
``reshard_per_microbatch`` (default True): an FSDP2 stage reshards its
parameters and reduce-scatters its gradients after every micro-batch's
backward, as FSDP2 does outside a pipeline (:mod:`.stage`); False keeps
torch's schedule behaviour (gathered parameters and unsharded gradients
through the step, one reduction after the last micro-batch: fewer
collectives, the whole stage in memory twice). The zero-bubble schedules
always keep torch's behaviour.

What needs the model (do the split points name its layers?) is checked when
the model is split (:mod:`mmpar.parallelize.pipeline.split`).
"""
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Tuple

from mmpar.checks import check_int
from mmpar.parallelize.pipeline.schedules import (ZERO_BUBBLE_SCHEDULES,
                                                  is_multi_stage)


def _fail(key: str, value, allowed: str) -> None:
    raise ValueError(f'parallel.pipeline.{key}={value!r} is not allowed; '
                     f'allowed: {allowed}')


@dataclass(frozen=True)
class PipelineConfig:
    """A checked ``parallel.pipeline`` section.

    Attributes:
        split_points: module names where a new stage begins, in model order
            (None: split the layers evenly).
        schedule: a :data:`~mmpar.registry.PIPELINE_SCHEDULES` name.
        num_microbatches: micro-batches each batch is split into.
        stages_per_rank: (virtual) stages each pp rank holds.
        reshard_per_microbatch: FSDP2 stages reshard and reduce-scatter
            after every micro-batch's backward (not under the zero-bubble
            schedules: :attr:`reshards_per_microbatch`).
    """
    split_points: Optional[Tuple[str, ...]] = None
    schedule: str = '1F1B'
    num_microbatches: int = 4
    stages_per_rank: int = 1
    reshard_per_microbatch: bool = True

    @classmethod
    def from_cfg(cls, cfg: Mapping, pp: Optional[int] = None,
                 batch_size: Optional[int] = None) -> 'PipelineConfig':
        """Check a ``parallel.pipeline`` dict.

        Args:
            cfg: the section.
            pp: the pipeline size, when known (checks the split-point count).
            batch_size: the per-rank train batch size, when known.

        Raises:
            ValueError: naming the key, the value and what is allowed.
        """
        if isinstance(cfg, cls):
            config = cfg
        else:
            if not isinstance(cfg, Mapping):
                raise ValueError(f'parallel.pipeline={cfg!r} is not allowed;'
                                 ' allowed: a dict')
            names = [f.name for f in fields(cls)]
            for key in cfg:
                if key not in names:
                    _fail(key, cfg[key], 'the keys ' + ', '.join(names))
            kwargs = dict(cfg)
            points = kwargs.get('split_points')
            if points is not None:
                if not isinstance(points, (list, tuple)) or not all(
                        isinstance(p, str) for p in points):
                    _fail('split_points', points,
                          'a list of module names, e.g. ["blocks.2"]')
                kwargs['split_points'] = tuple(points)
            config = cls(**kwargs)
        config.check(pp, batch_size)
        return config

    def check(self, pp: Optional[int], batch_size: Optional[int]) -> None:
        """Checks that need no model; see :meth:`from_cfg`."""
        multi = is_multi_stage(self.schedule)  # unknown names raise here
        for key in ('num_microbatches', 'stages_per_rank'):
            check_int(f'parallel.pipeline.{key}', getattr(self, key))
        if not isinstance(self.reshard_per_microbatch, bool):
            _fail('reshard_per_microbatch', self.reshard_per_microbatch,
                  'True (FSDP2 stages reshard and reduce-scatter after '
                  "every micro-batch) or False (torch's schedule "
                  'behaviour: once after the last)')
        if multi and self.stages_per_rank < 2:
            _fail('stages_per_rank', self.stages_per_rank,
                  f'an int >= 2 with schedule={self.schedule!r} (a '
                  'virtual-stage schedule); or a single-stage schedule '
                  '(GPipe, 1F1B) with stages_per_rank=1')
        if not multi and self.stages_per_rank != 1:
            _fail('stages_per_rank', self.stages_per_rank,
                  f'1 with schedule={self.schedule!r}; several stages per '
                  'rank need Interleaved1F1B, LoopedBFS, '
                  'InterleavedZeroBubble, ZBVZeroBubble or DualPipeV')
        if self.schedule in ('ZBVZeroBubble', 'DualPipeV') and \
                self.stages_per_rank != 2:
            _fail('stages_per_rank', self.stages_per_rank,
                  f'2 with schedule={self.schedule!r} (a V schedule)')
        if pp is not None and pp > 0 and self.split_points is not None:
            stages = pp * self.stages_per_rank
            if len(self.split_points) != stages - 1:
                _fail('split_points', list(self.split_points),
                      f'{stages - 1} names (pp={pp} x stages_per_rank='
                      f'{self.stages_per_rank} = {stages} stages)')
        if batch_size is not None and batch_size % self.num_microbatches:
            _fail('num_microbatches', self.num_microbatches,
                  f'a divisor of the per-rank batch size {batch_size} '
                  '(train_dataloader.batch_size)')

    def num_stages(self, pp: int) -> int:
        return pp * self.stages_per_rank

    @property
    def reshards_per_microbatch(self) -> bool:
        """Whether FSDP2 stages reshard and reduce-scatter after every
        micro-batch: asked for, and a schedule whose backward is whole (the
        zero-bubble schedules compute weight gradients in a later pass
        that needs the gathered parameters: torch's behaviour stays)."""
        return self.reshard_per_microbatch and \
            self.schedule not in ZERO_BUBBLE_SCHEDULES
