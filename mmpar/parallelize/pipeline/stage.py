"""A pipeline stage whose FSDP2 module frees its gathered state after every
micro-batch, as FSDP2 does outside a pipeline.

torch 2.13's ``PipelineStage.backward_maybe_with_nosync`` turns an FSDP
stage's resharding after backward and its gradient sync off for every
micro-batch; only ``perform_reduce_grad``, after the last micro-batch,
reduce-scatters and reshards. So the whole stage's parameters stay gathered
and its gradients unsharded through the schedule: a stage of ``P`` bytes
holds ``2 P`` besides its shards (a 0.8 B Llama at pp=2 x FSDP2 on 8 ranks
ran out of 24 GiB that way; FSDP2 alone trains it at 2.5 GiB a rank).

:class:`MicrobatchReshardStage` runs each micro-batch's whole backward with
both on: each FSDP unit reduce-scatters its gradients as its backward ends
(FSDP2 adds them to the sharded ``.grad`` the earlier micro-batches left)
and frees its gathered parameters; the next micro-batch gathers them again.
torch's ``perform_reduce_grad`` after the last micro-batch then finds no
unsharded gradient to reduce (FSDP2's ``post_backward`` reduces only the
gradients an unsharded parameter holds) and runs FSDP's final callback,
which waits on the reductions. Gradient scaling stays torch's: once, there
(mmpar passes ``scale_grads=False``: the loss carries the weights).

The split backward of the zero-bubble schedules (``"input"`` then
``"weight"``) keeps torch's behaviour: the weight pass runs later without
FSDP's pre-backward hook, on parameters that must still be gathered.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage


class MicrobatchReshardStage(PipelineStage):
    """``PipelineStage`` with FSDP2 resharding and gradient reduction after
    every micro-batch's (whole) backward; see the module doc."""

    def backward_maybe_with_nosync(self, backward_type: str,
                                   bwd_kwargs: Dict[str, Any],
                                   last_backward: bool = False):
        if backward_type != 'full' or not isinstance(self.submod,
                                                     FSDPModule):
            return super().backward_maybe_with_nosync(
                backward_type, bwd_kwargs, last_backward)
        # As FSDP2 with gradient accumulation outside a pipeline: reduce and
        # reshard as each unit's backward ends. Not the last backward: the
        # final callback that waits on every reduction runs once, in
        # perform_reduce_grad after the last micro-batch.
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(True)
        self.submod.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs['stage_output'],
                               bwd_kwargs['output_grads'],
                               bwd_kwargs['input_values'])
        return grads, None


def _outputs_with_grads(output, grad, pairs: List[tuple]) -> None:
    """Append ``(tensor, gradient)`` for each tensor of ``output`` (nested
    tuples, lists and dicts, as ``grad`` is) that autograd can reach."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad or output.grad_fn is not None:
            pairs.append((output, grad))
    elif isinstance(output, (tuple, list)) and grad is not None:
        for out, out_grad in zip(output, grad, strict=True):
            _outputs_with_grads(out, out_grad, pairs)
    elif isinstance(output, dict) and grad is not None:
        for key in output:
            _outputs_with_grads(output[key], grad[key], pairs)


def stage_backward(stage_output, output_grads, input_values
                   ) -> Tuple[Optional[torch.Tensor], ...]:
    """A stage's whole backward, as torch's pipeline runs it: gradients
    into the parameters, and the inputs' gradients returned (and dropped
    from the inputs, so the next micro-batch's send frees them)."""
    pairs: List[tuple] = []
    _outputs_with_grads(stage_output, output_grads, pairs)
    torch.autograd.backward([out for out, _ in pairs],
                            grad_tensors=[grad for _, grad in pairs])
    grads = []
    for value in input_values:
        is_tensor = isinstance(value, torch.Tensor)
        grads.append(value.grad if is_tensor else None)
        if is_tensor:
            value.grad = None
    return tuple(grads)
