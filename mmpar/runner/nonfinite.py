"""Stop on, or skip, a non-finite loss: the same decision on every rank."""
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper
from mmengine.optim import OptimWrapperDict

from mmpar.registry import HOOKS

ACTIONS = ('stop', 'skip')


class NonFiniteLossError(RuntimeError):
    """A loss was NaN or infinite and the hook's action is ``'stop'``."""


def _nonfinite_ranks(is_bad: bool, device: torch.device) -> List[int]:
    """Ranks whose loss is non-finite; one all-reduce of a 0/1 vector."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0] if is_bad else []
    flags = torch.zeros(dist.get_world_size(), device=device)
    flags[dist.get_rank()] = float(is_bad)
    dist.all_reduce(flags)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


@HOOKS.register_module()
class NonFiniteLossHook(Hook):
    """Check every loss before backward; stop the run or skip the step.

    A hook's ``after_train_iter`` runs after the optimizer has stepped, too
    late to skip anything, so at ``before_train`` this hook wraps the optim
    wrapper's ``backward`` (which every update path calls, once per
    micro-batch, on every rank: plain ``update_params`` and mmpar's forced
    sync alike) and ``step``. In ``backward`` each rank's loss is checked and
    the ranks exchange one flag each (an all-reduce), so all ranks see the
    same list of bad ranks and take the same decision: with DDP one rank's
    NaN reaches every rank's gradients, and with ``no_sync`` or forced sync a
    rank that stepped alone would drift from the others.

    * ``action='stop'``: every rank raises :class:`NonFiniteLossError` naming
      the iteration, the ranks and this rank's loss terms.
    * ``action='skip'``: backward still runs (DDP and FSDP expect a backward
      after every training forward), but the next optimizer step, the one at
      the end of the accumulation window, is skipped; the gradients are then
      zeroed as usual. Parameters, optimizer state and the optimizer's step
      count are unchanged by a skipped step.

    Works with an unwrapped model (world size 1) and with every mmpar wrapper.

    Args:
        action: ``'stop'`` or ``'skip'``.
        max_skips: with ``'skip'``, stop once this many steps in a row were
            skipped (None: never).
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
        cls(**{k: v for k, v in kwargs.items() if k != 'priority'})

    def __init__(self, action: str = 'stop', max_skips: Optional[int] = None):
        if action not in ACTIONS:
            raise ValueError(f'NonFiniteLossHook action={action!r} is not '
                             f'supported; allowed: {", ".join(ACTIONS)}')
        if max_skips is not None and (not isinstance(max_skips, int)
                                      or max_skips < 1):
            raise ValueError(f'NonFiniteLossHook max_skips={max_skips!r} '
                             'must be a positive int or None')
        self.action = action
        self.max_skips = max_skips
        self.num_skipped = 0
        self._skips_in_a_row = 0
        self._skip_next_step = False
        self._bad_ranks: List[int] = []
        self._terms: Optional[Dict[str, torch.Tensor]] = None
        self._patched: list = []

    # -- installation ------------------------------------------------------
    def before_train(self, runner) -> None:
        optim_wrapper = runner.optim_wrapper
        wrappers = (list(optim_wrapper.values()) if isinstance(
            optim_wrapper, OptimWrapperDict) else [optim_wrapper])
        for wrapper in wrappers:
            self._patch(wrapper, 'backward',
                        self._checked_backward(runner, wrapper.backward))
            self._patch(wrapper, 'step', self._guarded_step(runner,
                                                            wrapper.step))
        model = runner.model
        module = model.module if is_model_wrapper(model) else model
        if hasattr(module, 'parse_losses'):
            self._patch(module, 'parse_losses',
                        self._recording_parse_losses(module.parse_losses))

    def after_train(self, runner) -> None:
        for obj, name in reversed(self._patched):
            delattr(obj, name)
        self._patched.clear()

    def _patch(self, obj, name: str, func) -> None:
        # An instance attribute shadows the method for this object only.
        setattr(obj, name, func)
        self._patched.append((obj, name))

    # -- the wrapped methods -----------------------------------------------
    def _recording_parse_losses(self, parse_losses):

        def wrapped(losses):
            loss, log_vars = parse_losses(losses)
            self._terms = log_vars  # read only if a loss is non-finite
            return loss, log_vars

        return wrapped

    def _checked_backward(self, runner, backward):

        def wrapped(loss: torch.Tensor, **kwargs):
            is_bad = not bool(torch.isfinite(loss.detach()).all())
            bad_ranks = _nonfinite_ranks(is_bad, loss.device)
            if bad_ranks:
                self._on_nonfinite(runner, bad_ranks, loss)
            return backward(loss, **kwargs)

        return wrapped

    def _guarded_step(self, runner, step):

        def wrapped(**kwargs):
            if not self._skip_next_step:
                self._skips_in_a_row = 0
                return step(**kwargs)
            self._skip_next_step = False
            self.num_skipped += 1
            self._skips_in_a_row += 1
            runner.logger.warning(
                f'NonFiniteLossHook: skipped the optimizer step at '
                f'{self._where(runner)}: non-finite loss on rank(s) '
                f'{self._bad_ranks} ({self.num_skipped} skipped so far)')
            return None

        return wrapped

    # -- decisions ----------------------------------------------------------
    def _on_nonfinite(self, runner, bad_ranks: List[int],
                      loss: torch.Tensor) -> None:
        self._bad_ranks = bad_ranks
        if self.action == 'skip':
            if (self.max_skips is None
                    or self._skips_in_a_row + 1 < self.max_skips):
                self._skip_next_step = True
                return
            reason = (f' ({self.max_skips} steps in a row skipped, '
                      f'max_skips={self.max_skips})')
        else:
            reason = ''
        raise NonFiniteLossError(
            f'non-finite loss at {self._where(runner)} on rank(s) '
            f'{bad_ranks}{reason}; this rank\'s loss terms: '
            f'{self._format_terms(loss)}. Lower the learning rate, enable '
            "clip_grad, or set NonFiniteLossHook(action='skip').")

    @staticmethod
    def _where(runner) -> str:
        # runner.iter counts finished iterations; logs count from 1.
        return f'iteration {runner.iter + 1} (epoch {runner.epoch + 1})'

    def _format_terms(self, loss: torch.Tensor) -> str:
        terms = self._terms if self._terms else {'loss': loss}
        values = {k: float(torch.as_tensor(v).detach()) for k, v in
                  terms.items()}
        return ', '.join(f'{name}={value:.6g}'
                         for name, value in values.items())
