"""``MMDistributedDataParallel``: torch DDP with MMEngine's step contract."""
from typing import Optional

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mmpar.device import uses_accelerator
from mmpar.dist import local_rank
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.base import StepMixin


@MODEL_WRAPPERS.register_module()
class MMDistributedDataParallel(StepMixin, DistributedDataParallel):
    """DDP plus ``train_step``/``val_step``/``test_step``.

    Args:
        module: the model (an MMEngine ``BaseModel``).
        sync_strategy: gradient sync under gradient accumulation:
            ``'single_auto_sync'`` (sync on the last micro-batch only),
            ``'multi_auto_sync'`` (every micro-batch) or ``'forced_sync'``
            (no automatic sync; average after the last micro-batch's
            backward, in flattened buckets of ``bucket_cap_mb`` that start
            their all-reduce while that backward still runs).
        device_ids: as DDP's; None picks ``[LOCAL_RANK]`` on CUDA and nothing
            on CPU (DDP rejects device ids for CPU modules).
        process_group: the data-parallel group; None is the whole world.
            The Runner passes the layout's data axis.
        buffer_sync: ``'broadcast'`` (default), ``'average'`` or None: how
            buffers (BatchNorm statistics) are made equal before evaluation
            and checkpoints (:mod:`mmpar.wrappers.buffers`). DDP broadcasts
            rank 0's buffers *before* each training forward, so after the
            last one every rank holds its own update; without a sync the
            ranks evaluate with different statistics and a sharded
            checkpoint (DCP spreads replicated tensors over ranks) holds a
            mixture.
        **kwargs: any other ``DistributedDataParallel`` argument.

    Raises:
        ValueError: an unknown ``sync_strategy``.
    """

    tensor_parallel_wrapper = 'MMTensorParallelDDP'
    pipeline_stage_args = {}

    def __init__(self,
                 module: nn.Module,
                 sync_strategy: str = 'single_auto_sync',
                 device_ids: Optional[list] = None,
                 process_group: Optional[dist.ProcessGroup] = None,
                 buffer_sync: Optional[str] = 'broadcast',
                 **kwargs) -> None:
        self._init_steps(sync_strategy, buffer_sync)
        if device_ids is None and uses_accelerator():
            device_ids = [local_rank()]
        super().__init__(
            module,
            device_ids=device_ids,
            process_group=process_group,
            **kwargs)
        self.buffer_groups = (process_group, )
        # forced_sync buckets as big as DDP's own (bucket_cap_mb, 25 MiB by
        # default).
        self._init_forced_sync(self.bucket_bytes_cap / 2**20)

    @property
    def eval_forward_module(self) -> nn.Module:
        return self.module
