"""Keep module buffers (BatchNorm running statistics) equal on data ranks.

DDP broadcasts rank 0's buffers before every training forward
(``broadcast_buffers``), so after the last one each rank holds its own
update. FSDP1, FSDP2 and the naive and bucketed wrappers never broadcast, so
each rank's running statistics drift towards its own shard of the data.
Left alone, ranks evaluate with different statistics, a full checkpoint
holds rank 0's buffers and a sharded one a mixture (DCP saves each replicated
tensor from one rank, spread over the ranks). Every data-parallel wrapper
therefore syncs buffers over the data axis before the first evaluation step
after training and before a checkpoint is built (``buffer_sync``):

- ``'broadcast'`` (default): data rank 0's buffers, DDP's result;
- ``'average'``: the mean of floating-point buffers over data ranks (integer
  buffers such as ``num_batches_tracked`` are broadcast);
- ``None``: leave every rank's own.
"""
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

BUFFER_SYNC = ('broadcast', 'average', None)


def check_buffer_sync(buffer_sync) -> Optional[str]:
    """Return ``buffer_sync`` if allowed.

    Raises:
        ValueError: naming the value and the allowed ones.
    """
    if buffer_sync not in BUFFER_SYNC:
        raise ValueError(f'model_wrapper_cfg.buffer_sync={buffer_sync!r} is '
                         "not allowed; allowed: 'broadcast', 'average', None")
    return buffer_sync


def sync_buffers(module: nn.Module, mode: Optional[str],
                 group: Optional[dist.ProcessGroup] = None) -> None:
    """Make ``module``'s buffers equal over ``group`` (None: the world).

    Collective over ``group``: one broadcast or all-reduce per dtype.
    """
    if mode is None or not dist.is_initialized() or \
            dist.get_world_size(group) == 1:
        return
    by_dtype = {}
    for buffer in module.buffers():
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    size = dist.get_world_size(group)
    with torch.no_grad():
        for dtype, buffers in by_dtype.items():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            if mode == 'average' and dtype.is_floating_point:
                dist.all_reduce(flat, group=group)
                flat.div_(size)
            else:
                dist.broadcast(flat, src=src, group=group)
            synced = flat.split([b.numel() for b in buffers])
            for buffer, values in zip(buffers, synced):
                buffer.copy_(values.view_as(buffer))
