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
from typing import Any, Dict

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
# torch 2.13 has no public name for the stage's own whole backward.
from torch.distributed.pipelining._backward import stage_backward


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
