"""Stop on, or skip, a non-finite loss: the hook that turns the guard on.

The decisions live in :mod:`mmpar.optim.nonfinite`: mmpar's optim wrapper
checks every loss before backward (on every rank, with one all-reduce of a
flag per rank, so all ranks decide alike) and skips the step that ends the
window when told to. A hook's ``after_train_iter`` runs after the optimizer
has stepped, too late to skip anything, so this hook only hands the optim
wrapper a guard for the run.
"""
from typing import Optional

from mmengine.hooks import Hook
from mmengine.optim import OptimWrapperDict

from mmpar.optim.nonfinite import (NonFiniteGuard, NonFiniteLossError,
                                   check_guard_args)
from mmpar.optim.optim_wrapper import ParallelOptimMixin
from mmpar.registry import HOOKS
from mmpar.wrappers.base import StepMixin

__all__ = ['NonFiniteLossHook', 'NonFiniteLossError']


@HOOKS.register_module()
class NonFiniteLossHook(Hook):
    """Check every loss before backward; stop the run or skip the step.

    * ``action='stop'``: every rank raises :class:`NonFiniteLossError` naming
      the iteration, the ranks and this rank's loss terms.
    * ``action='skip'``: backward still runs (DDP and FSDP expect a backward
      after every training forward), but the next optimizer step, the one at
      the end of the accumulation window, is skipped; the gradients are then
      zeroed as usual. Parameters, optimizer state and the optimizer's step
      count are unchanged by a skipped step.

    Works with an unwrapped model (world size 1) and every layout.

    Args:
        action: ``'stop'`` or ``'skip'``.
        max_skips: with ``'skip'``, how many steps in a row may be
            skipped: the next non-finite loss after them stops the run
            (None: never stops).
    """

    priority = 'VERY_HIGH'

    @classmethod
    def check_cfg(cls, kwargs: dict) -> None:
        """Validate hook arguments from a config (before the run starts)."""
        allowed = ('action', 'max_skips', 'priority')
        for key in kwargs:
            if key not in allowed:
                raise ValueError(f'NonFiniteLossHook takes no argument '
                                 f'{key!r}; allowed: {", ".join(allowed)}')
        check_guard_args(kwargs.get('action', 'stop'),
                         kwargs.get('max_skips'))

    def __init__(self, action: str = 'stop', max_skips: Optional[int] = None):
        check_guard_args(action, max_skips)
        self.action = action
        self.max_skips = max_skips
        self.guard: Optional[NonFiniteGuard] = None

    @property
    def num_skipped(self) -> int:
        """Optimizer steps skipped so far in this run."""
        return self.guard.num_skipped if self.guard is not None else 0

    def before_train(self, runner) -> None:
        self.guard = NonFiniteGuard(
            self.action, self.max_skips,
            # runner.iter counts finished iterations; logs count from 1.
            where=lambda: (f'iteration {runner.iter + 1} '
                           f'(epoch {runner.epoch + 1})'),
            warn=runner.logger.warning)
        for optim_wrapper in self._optim_wrappers(runner):
            optim_wrapper.set_nonfinite_guard(self.guard)

    def after_train(self, runner) -> None:
        for optim_wrapper in self._optim_wrappers(runner):
            optim_wrapper.set_nonfinite_guard(None)

    @staticmethod
    def _optim_wrappers(runner) -> list:
        optim_wrapper = runner.optim_wrapper
        wrappers = (list(optim_wrapper.values()) if isinstance(
            optim_wrapper, OptimWrapperDict) else [optim_wrapper])
        if isinstance(runner.model, StepMixin):
            # An MMEngine optim wrapper: the adapter the model steps with.
            return [runner.model.parallel_optim_wrapper(wrapper)
                    for wrapper in wrappers]
        for wrapper in wrappers:
            if not isinstance(wrapper, ParallelOptimMixin):
                raise TypeError(
                    'NonFiniteLossHook on an unwrapped model (world size 1) '
                    'needs an mmpar optim wrapper (mmpar.optim.OptimWrapper); '
                    f'got {type(wrapper).__name__}. mmpar.Runner builds one '
                    'for OptimWrapper configs')
        return wrappers
