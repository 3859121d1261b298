"""Stop on, or skip, a non-finite loss: the same decision on every rank.

mmpar's optim wrapper checks every loss before backward when it holds a
:class:`NonFiniteGuard` (``NonFiniteLossHook`` gives it one for the run).
Each rank checks its own loss and the ranks exchange one flag each (an
all-reduce), so all ranks see the same list of bad ranks and take the same
decision: with DDP one rank's NaN reaches every rank's gradients, and with
``no_sync`` or forced sync a rank that stepped alone would drift from the
others.
"""
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

ACTIONS = ('stop', 'skip')


class NonFiniteLossError(RuntimeError):
    """A loss was NaN or infinite and the guard's action is ``'stop'``."""


def nonfinite_ranks(is_bad: bool, device: torch.device) -> List[int]:
    """Ranks whose loss is non-finite; one all-reduce of a 0/1 vector."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if is_bad else []
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(is_bad)
    dist.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def check_guard_args(action: str, max_skips: Optional[int]) -> None:
    """Raises ValueError naming a bad ``action`` or ``max_skips``."""
    if action not in ACTIONS:
        raise ValueError(f'NonFiniteLossHook action={action!r} is not '
                         f'supported; allowed: {", ".join(ACTIONS)}')
    if max_skips is not None and (isinstance(max_skips, bool)
                                  or not isinstance(max_skips, int)
                                  or max_skips < 1):
        raise ValueError(f'NonFiniteLossHook max_skips={max_skips!r} '
                         'must be a positive int or None')


class NonFiniteGuard:
    """The decisions: raise, or skip the optimizer step ending the window.

    * ``action='stop'``: :meth:`check` raises :class:`NonFiniteLossError` on
      every rank, naming the iteration, the ranks and this rank's loss terms.
    * ``action='skip'``: backward still runs (DDP and FSDP expect a backward
      after every training forward), but the next optimizer step, the one at
      the end of the accumulation window, is skipped (:meth:`allow_step`);
      the gradients are then zeroed as usual.

    Args:
        action: ``'stop'`` or ``'skip'``.
        max_skips: with ``'skip'``, how many steps in a row may be
            skipped: the next non-finite loss after them stops the run
            (None: never stops).
        where: says where training is (``'iteration 3 (epoch 1)'``).
        warn: logs a skipped step.
    """

    def __init__(self, action: str = 'stop', max_skips: Optional[int] = None,
                 where: Callable[[], str] = lambda: 'this step',
                 warn: Callable[[str], None] = print):
        check_guard_args(action, max_skips)
        self.action = action
        self.max_skips = max_skips
        self.where = where
        self.warn = warn
        self.num_skipped = 0
        self._skips_in_a_row = 0
        self._skip_next_step = False
        self._bad_ranks: List[int] = []

    def check(self, loss: torch.Tensor,
              terms: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Check this rank's loss against every rank's (collective).

        Raises:
            NonFiniteLossError: some rank's loss is not finite and the
                action is ``'stop'`` (or ``max_skips`` is reached).
        """
        is_bad = not bool(torch.isfinite(loss.detach()).all())
        bad_ranks = nonfinite_ranks(is_bad, loss.device)
        if not bad_ranks:
            return
        self._bad_ranks = bad_ranks
        reason = ''
        if self.action == 'skip':
            if (self.max_skips is None
                    or self._skips_in_a_row < self.max_skips):
                self._skip_next_step = True
                return
            reason = (f' ({self._skips_in_a_row} steps in a row skipped '
                      f'already, max_skips={self.max_skips})')
        terms = terms if terms else {'loss': loss}
        values = ', '.join(
            f'{name}={float(torch.as_tensor(value).detach()):.6g}'
            for name, value in terms.items())
        raise NonFiniteLossError(
            f'non-finite loss at {self.where()} on rank(s) {bad_ranks}'
            f'{reason}; this rank\'s loss terms: {values}. Lower the '
            'learning rate, enable clip_grad, or set '
            "NonFiniteLossHook(action='skip').")

    def allow_step(self) -> bool:
        """False (once, with a warning) when the step must be skipped."""
        if not self._skip_next_step:
            self._skips_in_a_row = 0
            return True
        self._skip_next_step = False
        self.num_skipped += 1
        self._skips_in_a_row += 1
        self.warn(f'NonFiniteLossHook: skipped the optimizer step at '
                  f'{self.where()}: non-finite loss on rank(s) '
                  f'{self._bad_ranks} ({self.num_skipped} skipped so far)')
        return False
