"""What a causal language model returns in each MMEngine mode.

Shared by :class:`mmpar.models.Llama` and :class:`mmpar.models.HFCausalLM`
so both feed :class:`mmpar.evaluation.LanguageModelMetric` the same way.
"""
from typing import Dict, List, Optional, Union

import torch
import torch.nn.functional as F


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``(B, T)`` of logits ``(B, T, V)`` (in fp32,
    whatever the logits' dtype)."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(),
        reduction='none').view_as(targets)


def lm_outputs(logits: torch.Tensor, targets: Optional[torch.Tensor],
               mode: str) -> Union[Dict, List, torch.Tensor]:
    """``'tensor'``: the logits; ``'loss'``: ``dict(loss=mean token
    cross-entropy)``; ``'predict'``: one ``dict(loss_sum, num_tokens)`` per
    sample.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == 'tensor':
        return logits
    if mode == 'loss':
        return dict(loss=token_loss(logits, targets).mean())
    if mode == 'predict':
        losses = token_loss(logits, targets).detach()
        return [
            dict(loss_sum=row.sum().item(), num_tokens=row.numel())
            for row in losses
        ]
    raise ValueError(f'mode={mode!r} is not supported; allowed: tensor, '
                     'loss, predict')


class LMPipelineOutputs:
    """The pipeline protocol's last-stage methods of a causal LM: the
    ``'loss'`` and ``'predict'`` outputs of :func:`lm_outputs`."""

    def pipeline_loss(self, logits: torch.Tensor,
                      data_samples: torch.Tensor) -> dict:
        return lm_outputs(logits, data_samples, 'loss')

    def pipeline_predict(self, logits: torch.Tensor,
                         data_samples: torch.Tensor) -> list:
        return lm_outputs(logits, data_samples, 'predict')


def transformer_flops_per_token(num_matmul_params: int, num_layers: int,
                                num_heads: int, head_dim: int,
                                seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6 N`` for the
    matmuls plus ``12 L H D T`` for attention scores and values (PaLM,
    appendix B; torchtitan's ``get_num_flop_per_token``)."""
    return 6.0 * num_matmul_params + (
        12.0 * num_layers * num_heads * head_dim * seq_len)
