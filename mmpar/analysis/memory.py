"""A rank's memory, predicted from the plan: the build, the steady state and
one micro-batch's activations.

::

    peak = baseline + max(build, params + grads + optimizer state
                                 + FSDP's gathered unit + activations)

* ``baseline``: what a rank holds before the model: this process after its
  imports (torch, MMEngine, mmpar), measured;
* ``build``: building and sharding the model. Built on the meta device
  (``meta_init``, the default for layouts that shard or split), a rank holds
  its local shards plus one whole parameter at a time; built whole, the
  whole model plus its shards (and, in host memory until training starts,
  a copy of the plain model for ``init_weights``:
  :mod:`mmpar.runner.init_weights`; not counted);
* steady state: this rank's parameters, gradients and optimizer state (the
  plan's table);
* FSDP's gathered unit: the largest unit's parameters and gradients whole,
  while it runs forward and backward; under pp the same (mmpar's stage
  reshards and reduce-scatters after every micro-batch), but every unit of
  this rank's stages twice where torch's schedules keep a stage's
  parameters gathered and its gradients unsharded until the reduction
  after the last micro-batch (``parallel.pipeline.
  reshard_per_microbatch=False``, the zero-bubble schedules), and at least
  every unit's parameters under the virtual-stage schedules, which gather
  a rank's stages as a step starts (``plan._gathered_numel``);
* activations: one micro-batch's saved tensors (:mod:`.activations`, a
  meta forward under the configured activation checkpointing; under tp on
  the split model, so that what the plan gathers whole, the input of the
  column-split projections and logits gathered whole, counts whole), times
  the micro-batches a pipeline stage holds at once, divided over cp (split
  sequences).

What it does not know: allocator overhead and fragmentation (under pipeline
micro-batches and activation checkpointing, glibc keeps freed tensors below
the mmap threshold resident: 10-20 MiB a rank in the layout benchmark at 4x
batch), communication buffers, data-loader workers (separate processes),
and anything a model allocates outside its parameters and saved
activations.
"""
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from mmpar.parallelize.tp_check import to_meta

GiB = 2**30


@dataclass
class MemoryEstimate:
    """A rank's predicted memory in bytes (see the module doc)."""
    baseline: int
    build: int
    params: int
    grads: int
    optimizer: int
    gathered_unit: int
    activations: Optional[int]  # None: no sample batch to measure with
    meta_init: bool

    @property
    def steady(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> int:
        return self.baseline + max(self.build, self.steady + self.gathered_unit
                                   + (self.activations or 0))

    def rows(self) -> list:
        """``(name, bytes)`` rows for the report."""
        acts = 'not estimated (no sample batch)' if self.activations is None \
            else self.activations
        return [
            ('baseline (this process after imports)', self.baseline),
            ('build peak ({})'.format('on the meta device' if self.meta_init
                                      else 'built whole'), self.build),
            ('steady: params + grads + optimizer', self.steady),
            ('FSDP: gathered (params + grads)',
             self.gathered_unit),
            ('activations in flight', acts),
            ('predicted peak per rank', self.peak),
        ]


def within_budget(peak: Optional[int], memory_budget: Optional[float]
                  ) -> bool:
    """The one memory-budget rule (the plan tool, the layout search and its
    benchmark apply it): a predicted peak per rank of ``peak`` bytes fits
    ``memory_budget`` GiB when it is at most that; everything fits no
    budget, nothing without a prediction fits one."""
    if memory_budget is None:
        return True
    return peak is not None and peak <= memory_budget * GiB


def sample_batch(cfg, model: nn.Module, batch_size: int) -> Optional[Any]:
    """One training micro-batch of ``batch_size`` samples as the model's
    forward takes it (the first sample repeated, through the loader's
    collate function and the model's data preprocessor), on the meta
    device; None when the data set cannot be built here."""
    from mmengine.dataset import pseudo_collate
    from mmengine.registry import FUNCTIONS
    from mmpar.registry import DATASETS
    loader = cfg.get('train_dataloader')
    if not isinstance(loader, dict) or 'dataset' not in loader:
        return None
    try:
        dataset = DATASETS.build(loader['dataset'])
        collate = loader.get('collate_fn') or dict(type='pseudo_collate')
        collate_fn = FUNCTIONS.get(collate['type']) \
            if isinstance(collate, dict) else collate
        batch = (collate_fn or pseudo_collate)([dataset[0]] * batch_size)
        data = model.data_preprocessor(batch, training=True)
    except Exception:  # noqa: B902 - any data set that does not build here
        return None
    return to_meta(data)


def in_flight(schedule: Optional[str], pp: int, microbatches: int,
              stages_per_rank: int = 1) -> int:
    """Micro-batches whose activations a pipeline rank holds at once: all of
    them for GPipe-like schedules, at most one per stage ahead for 1F1B and
    its interleaved and zero-bubble kin."""
    if schedule is None:
        return 1
    if schedule in ('GPipe', 'LoopedBFS'):
        return microbatches * stages_per_rank
    return min(microbatches, pp) * stages_per_rank
