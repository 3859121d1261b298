"""Optim wrappers for every parallel layout: the one global-norm clip, the
gradient-sync policy under accumulation and the non-finite guard; whole-matrix optimizers (Muon) under every layout."""
from mmpar.optim.clip import clip_grad_norm_, total_grad_norm
from mmpar.optim.matrix_constructor import (
    WholeMatrixOptimWrapperConstructor, whole_matrix_class)
from mmpar.optim.matrix_optimizer import WholeMatrixOptimizer
from mmpar.optim.muon import Muon
from mmpar.optim.nonfinite import NonFiniteGuard, NonFiniteLossError
from mmpar.optim.optim_wrapper import (AmpOptimWrapper, OptimWrapper,
                                       ParallelOptimMixin)

__all__ = [
    'AmpOptimWrapper', 'Muon', 'NonFiniteGuard', 'NonFiniteLossError',
    'OptimWrapper', 'ParallelOptimMixin', 'WholeMatrixOptimWrapperConstructor',
    'WholeMatrixOptimizer', 'clip_grad_norm_', 'total_grad_norm',
    'whole_matrix_class'
]
