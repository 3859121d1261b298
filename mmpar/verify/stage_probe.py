"""torch's pipeline stages run each stage's forward once more at their
first step, to infer the shapes they send (torch 2.13's ``PipelineStage``
runs the first stage on the first micro-batch, later stages on empty
tensors). A fingerprint of that call is of no micro-batch the reference
saw: :class:`StageProbe` marks it so the recorder holds it apart."""
from typing import Dict, Sequence

from torch import nn


class StageProbe:
    """Watch this rank's stage modules through the first optimizer step.

    Args:
        stage_modules: the modules torch's stages run.
        num_microbatches: micro-batches a batch runs through each stage.

    :attr:`active` is True while a stage's first call of the run is
    running. :meth:`was_probe` says, after the first optimizer step,
    whether those calls were torch's extra ones (each stage ran one more
    time than the micro-batches of the step's batches, :meth:`batch_done`
    counts them: more than one under gradient accumulation); a torch that
    infers no shapes at run time leaves every call counted.
    """

    def __init__(self, stage_modules: Sequence[nn.Module],
                 num_microbatches: int):
        self.num_microbatches = num_microbatches
        self.active = False
        self.calls: Dict[int, int] = {}
        self.first_step = True
        self.num_batches = 0
        for index, stage in enumerate(stage_modules):
            stage.register_forward_pre_hook(self._entered(index))
            stage.register_forward_hook(self._left)

    def _entered(self, index: int):
        def hook(module, args):
            if self.first_step:
                self.active = index not in self.calls
                self.calls[index] = self.calls.get(index, 0) + 1
        return hook

    def _left(self, module, args, output) -> None:
        self.active = False

    def batch_done(self) -> None:
        """A batch of the first optimizer step has run."""
        self.num_batches += 1

    def was_probe(self) -> bool:
        """Ends the first step; True when its first calls were extra."""
        self.first_step = False
        expected = self.num_batches * self.num_microbatches + 1
        return bool(self.calls) and all(
            n == expected for n in self.calls.values())
