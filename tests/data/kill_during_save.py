"""Test-only hook: the process dies while writing a chosen epoch's checkpoint."""
import os

import torch
from mmengine.hooks import Hook

from mmpar.registry import HOOKS


@HOOKS.register_module()
class KillDuringSaveHook(Hook):
    """At ``epoch``, replace ``torch.save`` with one that writes a few bytes
    of the archive and then kills the process (no clean-up runs)."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def before_train_epoch(self, runner) -> None:
        if runner.epoch + 1 != self.epoch:
            return

        def dying_save(obj, file, *args, **kwargs):
            file.write(b'PK\x03\x04' + b'\0' * 1024)
            file.flush()
            os._exit(9)

        torch.save = dying_save
