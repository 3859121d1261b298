"""Hand-written torch loops that mmpar's wrappers are measured against.

Each is the plainest loop a torch user would write for the technique, on the
same module, optimizer and clipping as the mmpar row it is the baseline of:
forward, ``loss.backward()``, clip by the global norm, AdamW step. FSDP1 and
FSDP2 shard per ``TransformerBlock``, as the shipped FSDP configs do.
"""
import torch
from torch import nn

BLOCK = 'TransformerBlock'


def _blocks(model: nn.Module):
    return [m for m in model.modules() if type(m).__name__ == BLOCK]


class HandWrittenLoop:
    """forward, backward, clip, AdamW step around an already wrapped model.

    Args:
        wrapped: what forward runs through (DDP, FSDP1 root, the FSDP2 model).
        optim_cfg: the config's ``optim_wrapper`` (AdamW, ``clip_grad``).
        clip: ``clip(params, max_norm)`` by the global norm.
    """

    def __init__(self, wrapped: nn.Module, optim_cfg: dict, clip) -> None:
        self.wrapped = wrapped
        opt = dict(optim_cfg['optimizer'])
        assert opt.pop('type') == 'AdamW', opt
        # After wrapping: FSDP replaces the parameters with sharded ones.
        self.optimizer = torch.optim.AdamW(wrapped.parameters(), **opt)
        self.max_norm = (optim_cfg.get('clip_grad') or {}).get('max_norm')
        self.clip = clip
        self.keep_grads = False

    def step(self, batch: dict) -> None:
        losses = self.wrapped(batch['inputs'], batch['data_samples'],
                              mode='loss')
        losses['loss'].backward()
        if self.max_norm is not None:
            self.clip(self.wrapped.parameters(), self.max_norm)
        self.optimizer.step()
        if not self.keep_grads:
            self.optimizer.zero_grad()


def hand_written_ddp(model, optim_cfg: dict, device) -> HandWrittenLoop:
    """torch ``DistributedDataParallel`` with its defaults."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == 'cuda' else None)
    return HandWrittenLoop(ddp, optim_cfg, torch.nn.utils.clip_grad_norm_)


def hand_written_fsdp1(model, optim_cfg: dict, device) -> HandWrittenLoop:
    """torch ``FullyShardedDataParallel``, FULL_SHARD, one unit per block."""
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    classes = {type(b) for b in _blocks(model)}
    root = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(classes),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                use_orig_params=True, device_id=device)

    def clip(params, max_norm):
        # FSDP1's own clip all-reduces the shard norms: the global norm.
        return root.clip_grad_norm_(max_norm)

    return HandWrittenLoop(root, optim_cfg, clip)


def hand_written_fsdp2(model, optim_cfg: dict, device) -> HandWrittenLoop:
    """torch ``fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard
    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
    # clip_grad_norm_ on DTensor gradients reduces the norm over the mesh.
    return HandWrittenLoop(model, optim_cfg, torch.nn.utils.clip_grad_norm_)


BASELINES = {
    'ddp': hand_written_ddp,
    'fsdp1': hand_written_fsdp1,
    'fsdp2': hand_written_fsdp2,
}
