"""Hand-written torch loops that mmpar's wrappers are measured against.

Each is the plainest loop a torch user would write for the technique, on the
same module, optimizer and clipping as the mmpar row it is the baseline of:
forward, ``loss.backward()``, clip by the global norm, AdamW step. FSDP1 and
FSDP2 shard per ``TransformerBlock``, as the shipped FSDP configs do; tensor
parallelism splits mmpar's ``Llama`` with torch's ``parallelize_module`` and
torchtitan's Llama plan, written out in torch styles.
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

    def step(self, batch: dict) -> torch.Tensor:
        """One step; returns the loss (detached)."""
        losses = self.wrapped(batch['inputs'], batch['data_samples'],
                              mode='loss')
        losses['loss'].backward()
        if self.max_norm is not None:
            self.clip(self.wrapped.parameters(), self.max_norm)
        self.optimizer.step()
        if not self.keep_grads:
            self.optimizer.zero_grad()
        return losses['loss'].detach()


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


def llama_tp_plan(model: nn.Module) -> dict:
    """torchtitan's Llama plan with sequence parallelism for mmpar's
    ``Llama``, in torch styles: ``{module name: ParallelStyle}`` for
    ``parallelize_module``.

    Column-split q/k/v and gate/up, row-split output projections, the norms
    on sequence shards, the attention's and the MLP's input gathered once
    (``PrepareModuleInput`` ``Shard(1)`` -> ``Replicate()``, the rotary
    tables left alone), the vocabulary-split logits gathered whole.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel,
                                                   PrepareModuleInput,
                                                   RowwiseParallel,
                                                   SequenceParallel)
    between = Shard(1)
    plan = {
        'tok_embeddings': RowwiseParallel(input_layouts=Replicate(),
                                          output_layouts=between),
        'norm': SequenceParallel(),
        'output': ColwiseParallel(input_layouts=between,
                                  output_layouts=Replicate()),
    }
    for name in model.layers:
        block = f'layers.{name}'
        plan.update({
            f'{block}.attn_norm': SequenceParallel(),
            f'{block}.attn': PrepareModuleInput(
                input_layouts=(between, None, None),
                desired_input_layouts=(Replicate(), None, None)),
            f'{block}.attn.wq': ColwiseParallel(),
            f'{block}.attn.wk': ColwiseParallel(),
            f'{block}.attn.wv': ColwiseParallel(),
            f'{block}.attn.wo': RowwiseParallel(output_layouts=between),
            f'{block}.mlp_norm': SequenceParallel(),
            f'{block}.mlp': PrepareModuleInput(
                input_layouts=(between, ), desired_input_layouts=(
                    Replicate(), )),
            f'{block}.mlp.w1': ColwiseParallel(),
            f'{block}.mlp.w3': ColwiseParallel(),
            f'{block}.mlp.w2': RowwiseParallel(output_layouts=between),
        })
    return plan


def hand_written_tp(model, optim_cfg: dict, device) -> HandWrittenLoop:
    """torch ``parallelize_module`` with :func:`llama_tp_plan` over all
    ranks (tp = world size), torch's ``clip_grad_norm_`` (every parameter
    is a DTensor on the one mesh) and AdamW."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh(device.type, (dist.get_world_size(), ))
    parallelize_module(model, mesh, llama_tp_plan(model))
    return HandWrittenLoop(model, optim_cfg, torch.nn.utils.clip_grad_norm_)


BASELINES = {
    'ddp': hand_written_ddp,
    'fsdp1': hand_written_fsdp1,
    'fsdp2': hand_written_fsdp2,
    'tp': hand_written_tp,
}
