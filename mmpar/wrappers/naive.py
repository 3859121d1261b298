"""``MMNaiveDataParallel``: one blocking all-reduce per gradient.

The simplest correct data parallelism, for reading and as a benchmark
baseline: no buckets, no overlap. Use :class:`MMBucketDataParallel` or
``MMDistributedDataParallel`` to train.
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from mmpar.parallelize.tensor import local_grad
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.dp_base import PythonDataParallel


@MODEL_WRAPPERS.register_module()
class MMNaiveDataParallel(PythonDataParallel):
    """Average each gradient over the group as soon as it is accumulated.

    Every rank must produce gradients for the same parameters in the same
    order in each synchronised backward (a parameter used on one rank only
    leaves the other rank's all-reduces mismatched); use
    :class:`MMBucketDataParallel` when some parameters may go unused.

    Args:
        module: the model (an MMEngine ``BaseModel`` for ``train_step``).
        process_group: the data-parallel group; None uses the default group.
        sync_strategy: ``'single_auto_sync'`` (sync on the last micro-batch
            of an accumulation only), ``'multi_auto_sync'`` (every
            micro-batch) or ``'forced_sync'`` (all-reduce all gradients once,
            after the last micro-batch's backward).

    Raises:
        ValueError: an unknown ``sync_strategy``.
    """

    def __init__(self,
                 module: nn.Module,
                 process_group: Optional[dist.ProcessGroup] = None,
                 sync_strategy: str = 'single_auto_sync') -> None:
        super().__init__(module, process_group, sync_strategy)
        self._hook_handles = [
            param.register_post_accumulate_grad_hook(self._average_grad)
            for param in module.parameters() if param.requires_grad
        ]

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
