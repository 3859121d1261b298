"""Verify a parallel layout against one process: train K steps at both on
the same global batches and seeds, compare each step's loss, grad norm and
per-module fingerprints of outputs and gradients (docs/verify.md)."""
from mmpar.verify.compare import Verdict, compare
from mmpar.verify.recorder import FingerprintHook
from mmpar.verify.run import (check_options, reference_config, run_layout,
                              run_reference, short_run)

__all__ = [
    'FingerprintHook', 'Verdict', 'check_options', 'compare',
    'reference_config', 'run_layout', 'run_reference', 'short_run'
]
