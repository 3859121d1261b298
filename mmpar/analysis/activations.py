"""How much memory one micro-batch's activations take, without computing.

The model runs forward on the meta device (no memory, no arithmetic) with
autograd on; every tensor autograd saves for backward is counted once (by
storage), and attributed to the block (a module activation checkpointing
would wrap) running when it was saved. Activation checkpointing then
changes each chosen block's share:

* ``full``: the block keeps only its inputs; in backward its activations
  come back, one block at a time;
* ``selective``: the block keeps its inputs and the outputs of the expensive
  ops (matrix multiplications, attention: :data:`~mmpar.parallelize.
  activation.SAVE_OPS`); the rest comes back in backward.

:func:`activation_bytes` is the estimate the plan tool reports: what is
saved at the end of forward plus the largest block recomputed in backward.
"""
from typing import Any, Dict, List, Optional

import torch
from torch import nn
# Private module: torch 2.13 has no public home for TorchDispatchMode.
from torch.utils._python_dispatch import TorchDispatchMode

from mmpar.parallel.dtensor import local_tensor
from mmpar.parallelize.activation import (SAVE_OPS, _op,
                                          check_activation_checkpointing)
from mmpar.parallelize.meta import storage_key
from mmpar.wrappers.policies import resolve_module_classes


class _SaveOpOutputs(TorchDispatchMode):
    """Bytes of the outputs of the ops selective checkpointing keeps, by
    the block running when they ran."""

    def __init__(self, keep, current):
        super().__init__()
        self.keep, self.current = keep, current
        self.bytes: Dict[Optional[int], int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.keep:
            for value in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(value, torch.Tensor):
                    block = self.current[0]
                    # A tp model's DTensor: this rank's shard.
                    value = local_tensor(value)
                    self.bytes[block] = self.bytes.get(block, 0) + \
                        value.numel() * value.element_size()
        return out


def activation_profile(model: nn.Module, data: Any,
                       ac_cfg: Any = None) -> Dict[str, Any]:
    """Saved bytes of one forward of ``data`` through ``model`` (on the meta
    device; ``data`` as the model's ``forward`` takes it, real or meta), by
    block of ``ac_cfg``'s classes.

    Returns:
        ``outside`` (saved outside any block), ``saved`` (per block),
        ``inputs`` (each block's input bytes), ``kept`` (per block, outputs
        of the ops selective checkpointing keeps).
    """
    ac_cfg = check_activation_checkpointing(ac_cfg)
    blocks = []
    if ac_cfg is not None:
        classes = resolve_module_classes(model, ac_cfg['module_classes'],
                                         key='activation_checkpointing')
        blocks = [m for m in model.modules() if isinstance(m, classes)]
    current: List[Optional[int]] = [None]
    saved: Dict[Optional[int], int] = {}
    inputs: Dict[int, int] = {}
    # Parameters (and views of them, such as a transposed weight) are saved
    # too, but are no activations.
    seen = {storage_key(local_tensor(t))
            for t in [*model.parameters(), *model.buffers()]}
    handles = []
    for index, block in enumerate(blocks):

        def enter(module, args, index=index):
            current[0] = index
            inputs[index] = sum(a.numel() * a.element_size() for a in args
                                if isinstance(a, torch.Tensor))

        def leave(module, args, output):
            current[0] = None

        handles += [block.register_forward_pre_hook(enter),
                    block.register_forward_hook(leave)]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = local_tensor(tensor).untyped_storage()
        key = storage_key(local_tensor(tensor))  # views share a storage
        if key not in seen:
            seen.add(key)
            saved[current[0]] = saved.get(current[0], 0) + storage.nbytes()
        return tensor

    keep = set()
    for name in SAVE_OPS:
        try:
            keep.add(_op(name, 'activation_checkpointing'))
        except ValueError:
            pass
    ops = _SaveOpOutputs(keep, current)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
            if isinstance(data, dict):
                model(**data, mode='loss')
            else:
                model(*data, mode='loss')
    finally:
        for handle in handles:
            handle.remove()
    return dict(outside=saved.get(None, 0),
                saved=[saved.get(i, 0) for i in range(len(blocks))],
                inputs=[inputs.get(i, 0) for i in range(len(blocks))],
                kept=[ops.bytes.get(i, 0) for i in range(len(blocks))])


def estimate_from_profile(profile: Dict[str, Any], ac_cfg: Any) -> int:
    """Peak activation bytes of a micro-batch under ``ac_cfg``: what forward
    leaves saved, plus the largest checkpointed block brought back in
    backward."""
    ac_cfg = check_activation_checkpointing(ac_cfg)
    total = profile['outside']
    recomputed = 0
    for index, block_saved in enumerate(profile['saved']):
        chosen = ac_cfg is not None and index % ac_cfg['every'] == 0
        if not chosen:
            total += block_saved
            continue
        kept = profile['inputs'][index]
        if ac_cfg['mode'] == 'selective':
            kept += min(profile['kept'][index], block_saved)
        total += kept
        recomputed = max(recomputed, block_saved - kept)
    return total + recomputed


def activation_bytes(model_cfg: dict, batch: int, seq: int,
                     ac_cfg: Any = None) -> int:
    """The estimate for a language model config (token batches of
    ``batch x seq``), built on the meta device."""
    from mmpar.parallelize.meta import build_on_meta
    from mmpar.registry import MODELS
    model, _ = build_on_meta(lambda: MODELS.build(dict(model_cfg)),
                             init_weights=False, shapes_only=True)
    model.to('meta')  # buffers too: nothing is computed
    tokens = torch.zeros(batch, seq, dtype=torch.long, device='meta')
    data = dict(inputs=tokens, data_samples=tokens)
    ac = check_activation_checkpointing(ac_cfg)
    return estimate_from_profile(activation_profile(
        model, data, ac or dict(module_classes=_block_class(model))), ac)


def _block_class(model: nn.Module) -> List[str]:
    # Without checkpointing, blocks only split the count; any class works.
    layers = getattr(model, 'layers', None)
    if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) and len(layers):
        return [type(next(iter(layers.values() if isinstance(
            layers, nn.ModuleDict) else layers))).__name__]
    return [type(model).__name__]
