"""``forced_sync`` in buckets: one averaging of all gradients, few collectives.

Under ``forced_sync`` a wrapper communicates nothing during accumulation and
averages every gradient once, after the last micro-batch's backward. Doing
that one gradient at a time costs one latency-bound collective per parameter
(56 on the default example); :class:`ForcedSyncBuckets` instead flattens the
gradients into DDP-sized buckets (``bucket_cap_mb``, the same bucket layout
as :class:`~mmpar.wrappers.bucket.MMBucketDataParallel`) and all-reduces each
with one asynchronous call:

* during the last micro-batch's backward (:meth:`ForcedSyncBuckets.arm`), a
  bucket whose parameters all have their final gradient starts its
  all-reduce at once, overlapping the rest of backward. This is sound only
  because it is the last backward before the step: a post-accumulate-grad
  hook fires once per backward, after the parameter's gradient is complete;
* :meth:`ForcedSyncBuckets.finish` then starts the buckets still waiting
  (parameters that got no gradient in this backward), each while the next is
  being flattened, waits, divides by the group size and copies the averages
  back into ``.grad``.

Each bucket carries one flag per parameter in the same all-reduce, so a
parameter no rank produced a gradient for keeps ``.grad = None`` (as in one
process) and ranks that used different parameters still send equal-sized
buffers instead of hanging.
"""
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn

from mmpar.wrappers.bucketing import assign_buckets
from mmpar.wrappers.weak_hooks import remove_when_collected, weak_hook

DEFAULT_BUCKET_CAP_MB = 25.0  # torch DDP's default


class _FlatBucket:
    """Parameters of one dtype and device whose gradients travel together."""

    def __init__(self, params: List[nn.Parameter]):
        self.params = params
        self.num_pending = len(params)
        self.flat: Optional[torch.Tensor] = None
        self.handle = None

    def flatten(self) -> torch.Tensor:
        """Gradients (zeros where None) then one 0/1 flag per parameter."""
        pieces = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(
                p.numel(), dtype=p.dtype, device=p.device) for p in self.params
        ]
        first = self.params[0]
        return torch.cat(pieces + [torch.tensor(
            [p.grad is not None for p in self.params], dtype=first.dtype,
            device=first.device)])

    def write_back(self, world_size: int) -> None:
        """Divide the reduced buffer and copy it into every ``.grad``."""
        *views, flags = self.flat.div_(world_size).split(
            [p.numel() for p in self.params] + [len(self.params)])
        for param, view, flag in zip(self.params, views, flags.tolist()):
            view = view.view_as(param)
            if flag <= 0:  # no rank produced a gradient
                param.grad = None
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)
        self.flat = self.handle = None


class ForcedSyncBuckets:
    """Bucketed, asynchronous gradient averaging for ``forced_sync``.

    Args:
        params: the parameters whose gradients to average (those without
            ``requires_grad`` are skipped).
        process_group: the group to average over; None is the default group.
        bucket_cap_mb: the most MiB of gradients in one bucket, > 0.

    Attributes:
        buckets: the buckets, in launch order; ``len(buckets)`` collectives
            run per optimizer step.
    """

    def __init__(self,
                 params,
                 process_group: Optional[dist.ProcessGroup] = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        self.process_group = process_group
        params = [p for p in params if p.requires_grad]
        cap_bytes = bucket_cap_mb * 2**20
        self.buckets: List[_FlatBucket] = []
        # torch.cat needs one dtype and device per bucket. Groups keep the
        # parameters' first-appearance order, so every rank builds the same
        # buckets in the same order.
        groups = {}
        for param in params:
            groups.setdefault((param.dtype, param.device), []).append(param)
        for group in groups.values():
            itemsize = group[0].element_size()
            for indices in assign_buckets(group, cap_bytes, itemsize):
                self.buckets.append(_FlatBucket([group[i] for i in indices]))
        self._next = 0  # buckets start strictly in index order on all ranks
        self._armed = False
        # Held weakly, removed with the buckets: else they keep the model
        # alive (mmpar.wrappers.weak_hooks).
        self._handles = remove_when_collected(self, [
            param.register_post_accumulate_grad_hook(
                weak_hook(self, '_on_accumulated', bucket))
            for bucket in self.buckets for param in bucket.params
        ])

    def arm(self) -> None:
        """Start buckets from the coming backward as their gradients complete.

        Call only right before the last backward before :meth:`finish`.
        """
        self._armed = True

    def _on_accumulated(self, bucket: _FlatBucket,
                        param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket.num_pending -= 1
        self._launch_ready()

    def _launch(self, bucket: _FlatBucket) -> None:
        bucket.flat = bucket.flatten()
        bucket.handle = dist.all_reduce(
            bucket.flat, group=self.process_group, async_op=True)

    def _launch_ready(self) -> None:
        while (self._next < len(self.buckets)
               and self.buckets[self._next].num_pending <= 0):
            self._launch(self.buckets[self._next])
            self._next += 1

    def finish(self) -> None:
        """Average every gradient over the group; returns when done."""
        self._armed = False
        world_size = dist.get_world_size(self.process_group)
        for bucket in self.buckets[self._next:]:
            bucket.num_pending = 0
        # Each launch is asynchronous, so flattening the next bucket overlaps
        # the previous one's communication.
        self._launch_ready()
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.write_back(world_size)
            bucket.num_pending = len(bucket.params)
        self._next = 0
