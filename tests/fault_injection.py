"""Test-only faults, loaded into a run with ``custom_imports``.

Each fault fires on one rank (``rank``) at one point of training, so tests can
check what the other ranks and the launcher do about it.
"""
import os
import time

from mmengine.dist import get_rank
from mmengine.hooks import Hook

from mmpar.datasets import DigitsDataset
from mmpar.models import DigitsViT
from mmpar.registry import DATASETS, HOOKS, MODELS


class InjectedFault(RuntimeError):
    """The error a fault raises, so tests can find it in the output."""


def _fires(rank: int) -> bool:
    return get_rank() == rank


@HOOKS.register_module()
class RaiseInHook(Hook):
    """Raise in ``after_train_iter`` of iteration ``at_iter`` (1-based)."""

    def __init__(self, rank: int = 1, at_iter: int = 3):
        self.rank, self.at_iter = rank, at_iter

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        if _fires(self.rank) and runner.iter + 1 == self.at_iter:
            raise InjectedFault(f'hook fault on rank {self.rank} at '
                                f'iteration {self.at_iter}')


@HOOKS.register_module()
class HangInHook(Hook):
    """Sleep ``seconds`` in ``after_train_iter`` of iteration ``at_iter``: a
    rank that hangs without closing its connections."""

    def __init__(self, rank: int = 1, at_iter: int = 3, seconds=3600):
        self.rank, self.at_iter, self.seconds = rank, at_iter, seconds

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None):
        if _fires(self.rank) and runner.iter + 1 == self.at_iter:
            time.sleep(self.seconds)


@HOOKS.register_module()
class ExitOnFirstAttempt(Hook):
    """``os._exit(1)`` at the start of epoch ``at_epoch`` (1-based), on the
    first torchrun attempt only (``TORCHELASTIC_RESTART_COUNT=0``): a rank
    that dies without a traceback, as when killed."""

    def __init__(self, rank: int = 1, at_epoch: int = 2):
        self.rank, self.at_epoch = rank, at_epoch

    def before_train_epoch(self, runner):
        first_attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT',
                                       '0') == '0'
        if (first_attempt and _fires(self.rank)
                and runner.epoch + 1 == self.at_epoch):
            os._exit(1)


@MODELS.register_module()
class FaultyViT(DigitsViT):
    """DigitsViT whose training forward raises, or whose loss becomes NaN,
    on rank ``fault_rank`` at forward call ``fault_at`` (1-based)."""

    def __init__(self, fault_rank=1, fault_at=3, fault='raise', **kwargs):
        super().__init__(**kwargs)
        self.fault_rank, self.fault_at, self.fault = (fault_rank, fault_at,
                                                      fault)
        self._calls = 0

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = super().forward(inputs, data_samples, mode)
        if mode != 'loss':
            return out
        self._calls += 1
        if _fires(self.fault_rank) and self._calls == self.fault_at:
            if self.fault == 'raise':
                raise InjectedFault(f'forward fault on rank {get_rank()} '
                                    f'at call {self._calls}')
            out = dict(out, loss=out['loss'] * float('nan'))
        return out


@DATASETS.register_module()
class FaultyDigits(DigitsDataset):
    """DigitsDataset that raises on rank ``fault_rank`` at item read
    ``fault_at`` (1-based)."""

    def __init__(self, fault_rank=1, fault_at=100, **kwargs):
        super().__init__(**kwargs)
        self.fault_rank, self.fault_at = fault_rank, fault_at
        self._reads = 0

    def __getitem__(self, idx):
        self._reads += 1
        if _fires(self.fault_rank) and self._reads == self.fault_at:
            raise InjectedFault(f'data fault on rank {get_rank()} at read '
                                f'{self._reads}')
        return super().__getitem__(idx)
