"""Optim wrappers for every parallel layout: the one global-norm clip, the
gradient-sync policy under accumulation and the non-finite guard."""
from mmpar.optim.clip import clip_grad_norm_, total_grad_norm
from mmpar.optim.nonfinite import NonFiniteGuard, NonFiniteLossError
from mmpar.optim.optim_wrapper import (AmpOptimWrapper, OptimWrapper,
                                       ParallelOptimMixin)

__all__ = [
    'AmpOptimWrapper', 'NonFiniteGuard', 'NonFiniteLossError', 'OptimWrapper',
    'ParallelOptimMixin', 'clip_grad_norm_', 'total_grad_norm'
]
