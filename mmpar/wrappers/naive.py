"""``MMNaiveDataParallel``: one blocking all-reduce per gradient.

The simplest correct data parallelism, for reading and as a benchmark
baseline: no buckets, no overlap (except under ``forced_sync``, whose one
averaging per step runs in buckets, see :mod:`mmpar.wrappers.forced_sync`).
Use :class:`MMBucketDataParallel` or
``MMDistributedDataParallel`` to train.
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from mmpar.parallel.dtensor import local_grad
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.bucketing import check_bucket_cap_mb
from mmpar.wrappers.dp_base import PythonDataParallel
from mmpar.wrappers.forced_sync import DEFAULT_BUCKET_CAP_MB
from mmpar.wrappers.weak_hooks import remove_when_collected, weak_hook


@MODEL_WRAPPERS.register_module()
class MMNaiveDataParallel(PythonDataParallel):
    """Average each gradient over the group as soon as it is accumulated.

    Every rank must produce gradients for the same parameters in the same
    order in each synchronised backward (a parameter used on one rank only
    leaves the other rank's all-reduces mismatched); use
    :class:`MMBucketDataParallel` when some parameters may go unused.

    Args:
        module: the model (an MMEngine ``BaseModel`` for ``train_step``).
        process_group: the data-parallel group; None is the whole world.
        sync_strategy: ``'single_auto_sync'`` (sync on the last micro-batch
            of an accumulation only), ``'multi_auto_sync'`` (every
            micro-batch) or ``'forced_sync'`` (average all gradients once,
            after the last micro-batch's backward, in flattened buckets).
        buffer_sync: ``'broadcast'`` (default), ``'average'`` or None: how
            buffers are made equal before evaluation and checkpoints
            (:mod:`mmpar.wrappers.buffers`).
        bucket_cap_mb: the most MiB of gradients in one ``forced_sync``
            bucket (one all-reduce); > 0. Unused by the other strategies.

    Raises:
        ValueError: an unknown ``sync_strategy`` or a bad ``bucket_cap_mb``.
    """

    cfg_checks = dict(bucket_cap_mb=check_bucket_cap_mb)

    def __init__(self,
                 module: nn.Module,
                 process_group: Optional[dist.ProcessGroup] = None,
                 sync_strategy: str = 'single_auto_sync',
                 buffer_sync: Optional[str] = 'broadcast',
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        # Validate before the constructor's collectives (a bad argument must
        # not leave the other ranks waiting in a broadcast).
        bucket_cap_mb = self.check_cfg(
            dict(bucket_cap_mb=bucket_cap_mb))['bucket_cap_mb']
        super().__init__(module, process_group, sync_strategy, buffer_sync)
        self._init_forced_sync(bucket_cap_mb)
        # Held weakly, removed with the wrapper: else they keep the model
        # alive (mmpar.wrappers.weak_hooks).
        self._hook_handles = remove_when_collected(self, [
            param.register_post_accumulate_grad_hook(
                weak_hook(self, '_average_grad'))
            for param in module.parameters() if param.requires_grad
        ])

    def _average_grad(self, param: torch.Tensor) -> None:
        # This hook receives the *parameter*, not its gradient. Reducing
        # `param` itself (picotron's naive DP did) averages values the ranks
        # already share and leaves every gradient local: training silently
        # diverges. Reduce `param.grad`.
        if not self.require_backward_grad_sync:
            return
        grad = local_grad(param)  # a TP parameter: its shard
        dist.all_reduce(grad, group=self.process_group)
        grad.div_(self.world_size)
