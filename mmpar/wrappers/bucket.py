"""``MMBucketDataParallel``: bucketed, overlapped gradient all-reduce.

Gradients are accumulated into flat ``grad_dtype`` buckets; a bucket is
all-reduced asynchronously as soon as its last gradient arrives, while
backward keeps computing earlier layers (the design of torch DDP's reducer,
https://arxiv.org/abs/2006.15704, and Megatron's fp32 ``main_grad``).

Gradient life cycle, per parameter:

* forward (grad enabled) *absorbs* ``.grad`` into the bucket: None means the
  user zeroed it (set_to_none), so the slice is zeroed; a tensor the wrapper
  did not write, or wrote and the user changed, is copied in. Then ``.grad``
  is the bucket slice itself when the parameter's dtype is ``grad_dtype``
  (autograd accumulates into it in place, no copy: DDP's
  ``gradient_as_bucket_view``), else None;
* backward: the post-accumulate hook adds a gradient that is not already in
  the slice (the other dtypes) and drops ``.grad``; a complete bucket launches
  its all-reduce;
* end of backward (after the hook of the last parameter this backward
  computes a gradient for, as ``register_multi_grad_hook`` tells): launch
  the buckets still waiting (their unused parameters contribute zeros), wait,
  divide by the group size and write ``.grad`` back in the parameter's dtype.
"""
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from mmpar.parallel.dtensor import like_param, local_grad, local_tensor
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.bucketing import (assign_buckets,  # noqa: F401
                                      check_bucket_cap_mb)
from mmpar.wrappers.dp_base import PythonDataParallel
from mmpar.wrappers.weak_hooks import (remove_hooks, remove_when_collected,
                                       weak_hook)

GRAD_DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in ('float32', 'float64', 'bfloat16')
}


def check_grad_dtype(grad_dtype: Union[str, torch.dtype]) -> torch.dtype:
    """Normalise ``grad_dtype`` (a name or a torch dtype) to a torch dtype.

    Raises:
        ValueError: naming the bad value and the allowed ones.
    """
    dtype = GRAD_DTYPES.get(grad_dtype) if isinstance(grad_dtype, str) \
        else grad_dtype
    if dtype in GRAD_DTYPES.values():
        return dtype
    raise ValueError(f'grad_dtype={grad_dtype!r} is not supported; allowed: '
                     f'{", ".join(GRAD_DTYPES)} (as names or torch dtypes)')


def _unchanged(grad: torch.Tensor, written: Optional[torch.Tensor],
               view: torch.Tensor) -> bool:
    """``grad`` is the ``.grad`` last written from the bucket slice ``view``
    and still holds its values (compared, not read from torch's private
    version counter): the slice, in the wider ``grad_dtype``, stays."""
    if grad is not written:
        return False
    local = local_tensor(grad)
    return torch.equal(local, view.to(local.dtype))


class _Bucket:
    """A flat ``grad_dtype`` buffer: gradients, then one flag per parameter.

    The flags travel in the same all-reduce as the gradients: a flag > 0
    afterwards means some rank produced a gradient for the parameter, so it
    gets a ``.grad``; a parameter no rank used keeps ``.grad = None``, as in
    single-process training and DDP's ``find_unused_parameters``.
    """

    def __init__(self, params: List[nn.Parameter], dtype: torch.dtype):
        self.params = params
        # Tensor-parallel (DTensor) parameters keep their local shard here.
        locals_ = [local_tensor(p) for p in params]
        numel = sum(p.numel() for p in locals_)
        self.buffer = torch.zeros(numel + len(params), dtype=dtype,
                                  device=params[0].device)
        *views, self.flags = self.buffer.split(
            [p.numel() for p in locals_] + [len(params)])
        self.views = [view.view_as(p) for view, p in zip(views, locals_)]
        # A parameter's dtype equals grad_dtype: `.grad` *is* the buffer
        # slice, so autograd's accumulation and in-place edits (clipping,
        # zero_grad(set_to_none=False)) land in the buffer with no copy.
        # A DTensor's `.grad` must be a DTensor: never the slice itself.
        self.aliased = [
            p.dtype == dtype and p is local for p, local in zip(params, locals_)
        ]
        self.used = [False] * len(params)  # slice holds gradient data
        # For the other parameters: the `.grad` we last wrote, to tell
        # whether the user replaced or changed it since.
        self.written = [None] * len(params)
        self.num_pending = len(params)
        self.handle = None


@MODEL_WRAPPERS.register_module()
class MMBucketDataParallel(PythonDataParallel):
    """Data parallelism with bucketed, overlapped, ``grad_dtype`` all-reduce.

    Args:
        module: the model (an MMEngine ``BaseModel`` for ``train_step``).
        bucket_cap_mb: the most MiB (of ``grad_dtype`` gradients) in one
            bucket, i.e. one all-reduce; > 0. Smaller buckets start
            communicating earlier, larger ones make fewer calls.
        grad_dtype: dtype of the main-gradient buffers that gradients
            accumulate and are reduced in: ``'float32'`` (default; bf16
            parameters then accumulate in fp32), ``'float64'`` or
            ``'bfloat16'`` (half the bytes, less precision), as a name or
            torch dtype.
        process_group: the data-parallel group; None is the whole world.
        sync_strategy: ``'single_auto_sync'``, ``'multi_auto_sync'`` or
            ``'forced_sync'`` (see ``MMNaiveDataParallel``).

    Raises:
        ValueError: a bad ``bucket_cap_mb``, ``grad_dtype`` or
            ``sync_strategy``, naming the allowed values.
    """

    tensor_parallel_wrapper = 'MMTensorParallelDDP'
    cfg_checks = dict(bucket_cap_mb=check_bucket_cap_mb,
                      grad_dtype=check_grad_dtype)

    def __init__(self,
                 module: nn.Module,
                 bucket_cap_mb: float = 25,
                 grad_dtype: Union[str, torch.dtype] = torch.float32,
                 process_group: Optional[dist.ProcessGroup] = None,
                 sync_strategy: str = 'single_auto_sync',
                 buffer_sync: Optional[str] = 'broadcast') -> None:
        # Validate before the constructor's collectives: a bad argument must
        # not leave the other ranks waiting in a broadcast.
        checked = self.check_cfg(
            dict(bucket_cap_mb=bucket_cap_mb, grad_dtype=grad_dtype))
        super().__init__(module, process_group, sync_strategy, buffer_sync)
        self.bucket_cap_mb = checked['bucket_cap_mb']
        self.grad_dtype = checked['grad_dtype']
        params = [p for p in module.parameters() if p.requires_grad]
        self._buckets = [
            _Bucket([params[i] for i in indices], self.grad_dtype)
            for indices in assign_buckets(params, self.bucket_cap_mb * 2**20,
                                          self.grad_dtype.itemsize)
        ]
        self._next_bucket = 0  # buckets launch strictly in index order
        self._absorbed = False  # `.grad`s moved into the buckets
        self._in_backward = False
        self._syncing = True
        self._all_computed = False  # this backward's last gradient is in
        # Held weakly, removed with the wrapper: else they keep the model
        # alive (mmpar.wrappers.weak_hooks).
        hooks = [torch.autograd.graph.register_multi_grad_hook(
            params, weak_hook(self, '_on_all_computed'))] if params else []
        self._hook_handles = remove_when_collected(self, hooks + [
            param.register_post_accumulate_grad_hook(
                weak_hook(self, '_on_accumulated', index, slot))
            for index, bucket in enumerate(self._buckets)
            for slot, param in enumerate(bucket.params)
        ])

    # -- forward: take over the gradients ------------------------------------
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and not self._absorbed:
            self._absorb_grads()
        # A torch.autograd.grad over the parameters since the last forward
        # ran the multi-grad hook but no parameter hook: not a backward.
        self._all_computed = False
        return self.module(*args, **kwargs)

    def _absorb_grads(self) -> None:
        for bucket in self._buckets:
            grads = [p.grad for p in bucket.params]
            if all(g is None for g in grads) and any(bucket.used):
                # The usual, after zero_grad: one fill, not one per slot.
                bucket.buffer.zero_()
                bucket.used = [False] * len(grads)
            for slot, (param, grad) in enumerate(zip(bucket.params, grads)):
                view = bucket.views[slot]
                if grad is view:  # edits, if any, are already in the bucket
                    continue
                if grad is None:
                    if bucket.used[slot]:
                        view.zero_()
                        bucket.used[slot] = False
                elif not _unchanged(grad, bucket.written[slot], view):
                    # In the parameter's layout (a tp gradient may come
                    # Partial or Replicate when backward ran unhooked).
                    view.copy_(local_grad(param))
                    bucket.used[slot] = True
                param.grad = view if bucket.aliased[slot] else None
        self._absorbed = True

    # -- backward ---------------------------------------------------------
    def _on_accumulated(self, index: int, slot: int,
                        param: torch.Tensor) -> None:
        # A post-accumulate hook receives the parameter; its gradient is
        # param.grad.
        bucket = self._buckets[index]
        if not self._absorbed:
            raise RuntimeError(
                'MMBucketDataParallel: backward ran without a forward '
                'through the wrapper since gradients were last written; '
                'call the wrapper, not wrapper.module, once per backward')
        if not self._in_backward:
            self._in_backward = True
            self._syncing = self.require_backward_grad_sync
        view = bucket.views[slot]
        if param.grad is not view:  # else autograd added into the bucket
            view.add_(local_grad(param))
            param.grad = view if bucket.aliased[slot] else None
        bucket.used[slot] = True
        if self._syncing:
            bucket.num_pending -= 1
            if bucket.num_pending == 0:
                self._launch_ready_buckets()
        if self._all_computed:
            self._all_computed = False
            self._end_backward()

    def _on_all_computed(self, grads) -> None:
        # Runs as the last parameter's gradient of this backward is computed,
        # before it is accumulated: every other parameter's hook has run, and
        # that parameter's hook ends the backward (torch's multi-grad hook,
        # not the engine's private end-of-backward callback).
        self._all_computed = True

    def _launch(self, bucket: _Bucket) -> None:
        bucket.flags.copy_(torch.tensor(bucket.used, dtype=self.grad_dtype))
        bucket.handle = dist.all_reduce(
            bucket.buffer, group=self.process_group, async_op=True)

    def _launch_ready_buckets(self) -> None:
        # Index order on every rank, so the ranks' collectives pair up even
        # when gradients arrive in a different order.
        while (self._next_bucket < len(self._buckets)
               and self._buckets[self._next_bucket].num_pending == 0):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _end_backward(self) -> None:
        self._in_backward = False
        if self._syncing:
            # Parameters that got no gradient never completed their bucket:
            # send what there is (zeros for them) rather than hang.
            for bucket in self._buckets[self._next_bucket:]:
                bucket.num_pending = 0
            self._launch_ready_buckets()
            self._wait_and_average()
        for bucket in self._buckets:
            bucket.num_pending = len(bucket.params)
        self._next_bucket = 0
        self._write_grads()

    def _wait_and_average(self) -> None:
        for bucket in self._buckets:
            bucket.handle.wait()
            bucket.handle = None
            bucket.buffer.div_(self.world_size)
            bucket.used = (bucket.flags > 0).tolist()

    def _write_grads(self) -> None:
        for bucket in self._buckets:
            for slot, param in enumerate(bucket.params):
                view = bucket.views[slot]
                if not bucket.used[slot]:  # no rank produced a gradient
                    param.grad = None
                elif bucket.aliased[slot]:
                    if param.grad is not view:
                        param.grad = view
                else:
                    grad = like_param(param, view.to(param.dtype))
                    param.grad = grad
                    bucket.written[slot] = grad
        self._absorbed = False

    def remove_grad_hooks(self) -> None:
        """Stop watching backward: gradients stay in ``.grad`` until
        :meth:`all_reduce_grads` averages them.

        For a module whose forward and backward something else runs, not
        through this wrapper (a pipeline schedule runs the plain stage):
        the hooks would refuse such a backward.
        """
        remove_hooks(self._hook_handles)

    def prepare_as_pipeline_stage(self) -> None:
        # Its gradients are averaged once per optimizer step instead
        # (finish_grad_sync, called by the pipeline).
        self.remove_grad_hooks()

    def all_reduce_grads(self) -> None:
        """Average all gradients now (``forced_sync``), in ``grad_dtype``."""
        if not self._absorbed:
            self._absorb_grads()
        for bucket in self._buckets:
            self._launch(bucket)
        self._wait_and_average()
        self._write_grads()
