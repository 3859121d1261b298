"""Muon for the hidden matrices, AdamW for the rest, under every layout.

The same arithmetic as ``torch.optim.Muon`` (torch 2.13), operation for
operation, so that one process gives bit-identical weights: Nesterov
momentum on the gradient (elementwise, on this rank's shard), Newton–Schulz
orthogonalisation in bfloat16 on the **whole** matrix (gathered by
:func:`mmpar.optim.whole_matrix.apply_to_whole`, never a shard), decoupled
weight decay and the shape-adjusted learning rate. torch's functions are
private (``torch.optim._muon``), so the few lines are written out here.

A config names it ``type='Muon'`` (torch's name: mmpar's Runner routes the
parameters, see :mod:`mmpar.optim.matrix_constructor`) or ``'MuonWithAdamW'``.
"""
import math
from typing import Iterable, Optional, Tuple

import torch

from mmpar.optim import bf16_matmul
from mmpar.optim.matrix_optimizer import WholeMatrixOptimizer
from mmpar.parallel.dtensor import local_tensor
from mmpar.registry import OPTIMIZERS

# Keller Jordan's coefficients, torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_FNS = (None, 'original', 'match_rms_adamw')


def newton_schulz(matrix: torch.Tensor, coefficients: Tuple[float, float,
                                                            float],
                  steps: int, eps: float) -> torch.Tensor:
    """The quintic Newton–Schulz iteration torch.optim.Muon runs: roughly
    ``U V^T`` of ``matrix = U S V^T``, in bfloat16 (torch's products, bit
    for bit: :mod:`mmpar.optim.bf16_matmul`)."""
    a, b, c = coefficients
    # A copy even of a bfloat16 matrix: without nesterov it is the momentum
    # buffer, which the in-place division below would rescale where it is
    # the buffer itself (one process, DDP) but not where it is a gathered
    # copy (FSDP2, tp), so the layouts would train apart. torch 2.13's Muon
    # rescales it (pytorch/pytorch#194664 copies as here).
    ortho = matrix.to(torch.bfloat16, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        ortho = ortho.T
    ortho.div_(ortho.norm().clamp(min=eps))
    for _ in range(steps):
        gram = ortho @ ortho.T
        poly = bf16_matmul.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = bf16_matmul.addmm(ortho, poly, ortho, beta=a)
    return ortho.T if tall else ortho


def adjusted_lr(lr: float, adjust_lr_fn: Optional[str],
                shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for a matrix of ``shape``: Keller's
    ``sqrt(max(1, rows / cols))`` ('original', the default) or Moonshot's
    ``0.2 sqrt(max(rows, cols))`` ('match_rms_adamw')."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, 'original'):
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


@OPTIMIZERS.register_module(name='MuonWithAdamW')
class Muon(WholeMatrixOptimizer):
    """torch.optim.Muon's rule on the ``matrix`` groups, exact under every
    layout, and AdamW on the others.

    Args:
        params: parameters or groups (a group's ``matrix`` key says its
            rule; without it, 2-D parameters go to Muon).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps,
            ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s, same defaults.
        adamw: the AdamW groups' settings (``torch.optim.AdamW``'s keyword
            arguments, e.g. ``dict(lr=3e-4, betas=(0.9, 0.95),
            weight_decay=0.01)``); torch's AdamW defaults for the rest.

    Raises:
        ValueError: a setting torch.optim.Muon refuses, naming it.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True,
                 ns_coefficients: Tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, ns_steps: int = 5,
                 adjust_lr_fn: Optional[str] = None,
                 adamw: Optional[dict] = None):
        for name, value in (('lr', lr), ('momentum', momentum),
                            ('weight_decay', weight_decay)):
            if not value >= 0:
                raise ValueError(f'Muon: {name}={value}; allowed: >= 0')
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f'Muon: adjust_lr_fn={adjust_lr_fn!r}; allowed: '
                             f'{ADJUST_LR_FNS}')
        if not 0 < ns_steps < 100 or len(ns_coefficients) != 3:
            raise ValueError(
                f'Muon: ns_steps={ns_steps}, ns_coefficients='
                f'{ns_coefficients}; allowed: 0 < ns_steps < 100, three '
                'coefficients')
        super().__init__(
            params,
            dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                 nesterov=nesterov, ns_coefficients=tuple(ns_coefficients),
                 eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn),
            adamw)

    def prepare(self, param, grad, state, group):
        if 'momentum_buffer' not in state:
            # Laid out as the gradient (a DTensor under FSDP2 / TP), as
            # torch's Muon makes it, so checkpoints see its layout.
            state['momentum_buffer'] = torch.zeros_like(
                param.grad, memory_format=torch.preserve_format)
        buf = local_tensor(state['momentum_buffer'])
        momentum = group['momentum']
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group['nesterov'] else buf

    def transform(self, matrix, group):
        return newton_schulz(matrix, group['ns_coefficients'],
                             group['ns_steps'], group['eps'])

    def apply(self, param, local, update, state, group):
        lr = group['lr']
        local.mul_(1 - lr * group['weight_decay'])
        local.add_(update, alpha=-adjusted_lr(lr, group['adjust_lr_fn'],
                                              param.shape))
