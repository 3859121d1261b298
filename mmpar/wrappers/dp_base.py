"""What mmpar's Python data-parallel wrappers share.

:class:`MMNaiveDataParallel` and :class:`MMBucketDataParallel` differ only in
how gradients move; wrapping, the start-up broadcast, ``no_sync`` and forward
live here so the two cannot drift apart.
"""
import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from mmpar.parallel.dtensor import local_tensor
from mmpar.wrappers.base import StepMixin


def broadcast_module_state(module: nn.Module,
                           process_group: Optional[dist.ProcessGroup] = None
                           ) -> None:
    """Copy ``module``'s parameters and buffers from group rank 0 to all ranks.

    Seeds differ between ranks, so without this every rank would start from
    its own initialisation and the averaged gradients would update different
    models.
    """
    src = 0 if process_group is None else dist.get_global_rank(
        process_group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            # A tensor-parallel parameter: its shard, from the rank at the
            # same tp coordinate.
            dist.broadcast(local_tensor(tensor.detach()), src=src,
                           group=process_group)


class PythonDataParallel(StepMixin, nn.Module):
    """Base of the wrappers that move gradients in Python.

    Args:
        module: the model (an MMEngine ``BaseModel`` for ``train_step``).
        process_group: the data-parallel group; None is the whole world.
            The Runner passes the layout's data axis.
        sync_strategy: see :data:`mmpar.wrappers.base.SYNC_STRATEGIES`.
        buffer_sync: ``'broadcast'``, ``'average'`` or None: how buffers
            (BatchNorm statistics) are made equal before evaluation and
            checkpoints (:mod:`mmpar.wrappers.buffers`).

    Attributes:
        require_backward_grad_sync: False inside :meth:`no_sync`; subclasses
            read it during backward (DDP's name for the same flag).
    """

    def __init__(self,
                 module: nn.Module,
                 process_group: Optional[dist.ProcessGroup] = None,
                 sync_strategy: str = 'single_auto_sync',
                 buffer_sync: Optional[str] = 'broadcast') -> None:
        super().__init__()
        self._init_steps(sync_strategy, buffer_sync)
        self.module = module
        self.process_group = process_group
        self.buffer_groups = (process_group, )
        self.world_size = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        broadcast_module_state(module, process_group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: backward inside it communicates
        nothing."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def eval_forward_module(self) -> nn.Module:
        # Evaluation needs no gradient bookkeeping: skip the wrapper.
        return self.module
