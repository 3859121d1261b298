"""What a causal language model returns in each MMEngine mode.

Shared by :class:`mmpar.models.Llama` and :class:`mmpar.models.HFCausalLM`
so both feed :class:`mmpar.evaluation.LanguageModelMetric` the same way.
"""
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmpar.optim.tokens import TOKENS_KEY
from mmpar.parallel.sequence import ContextParallel

IGNORE_INDEX = -100  # torch's cross_entropy default


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   ignore_index: int = IGNORE_INDEX
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy summed over the counted tokens, and their number.

    The building block for a loss over tokens split between ranks (context
    parallelism, and data parallelism with uneven padding): each rank sums
    its own tokens, and the sum is divided by the count over all of them
    (:func:`normalise_loss`), so the gradient is the one-process gradient of
    the mean over counted tokens.

    Args:
        logits: ``(B, T, V)``.
        targets: ``(B, T)`` token ids; ``ignore_index`` marks a token that
            is not counted (padding, a masked prompt).
        ignore_index: the target id of an uncounted token.

    Returns:
        ``(loss_sum, num_tokens)``: a scalar fp32 tensor with a gradient,
        and the number of counted tokens as a scalar int64 tensor (ready to
        all-reduce).
    """
    losses = F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(),
        ignore_index=ignore_index, reduction='sum')
    return losses, (targets != ignore_index).sum()


def normalise_loss(loss_sum: torch.Tensor,
                   num_tokens: Union[torch.Tensor, int]) -> torch.Tensor:
    """``loss_sum`` divided by the global count of counted tokens (at least
    1: a batch with no counted token gives a zero loss, not NaN)."""
    if isinstance(num_tokens, torch.Tensor):
        return loss_sum / num_tokens.clamp(min=1).to(loss_sum.dtype)
    return loss_sum / max(int(num_tokens), 1)


def lm_outputs(logits: torch.Tensor, targets: Optional[torch.Tensor],
               mode: str, cp: Optional[ContextParallel] = None,
               ignore_index: int = IGNORE_INDEX
               ) -> Union[Dict, List, torch.Tensor]:
    """What a causal LM returns in each MMEngine mode.

    ``'tensor'``: the logits. ``'loss'``: ``dict(loss=mean cross-entropy
    over the counted tokens, num_tokens=their number)``; the count
    (:data:`~mmpar.optim.tokens.TOKENS_KEY`, a float tensor so MMEngine
    logs it) lets mmpar's step normalise by the count over every
    micro-batch and rank of an optimizer step (docs/context_parallel.md).
    ``'predict'``: one ``dict(loss_sum, num_tokens)`` per sample, over its
    counted tokens (:class:`mmpar.evaluation.LanguageModelMetric`).

    Args:
        logits: ``(B, T, V)``.
        targets: ``(B, T)`` token ids; ``ignore_index`` marks a token that
            is not counted (padding, a masked prompt).
        mode: ``'tensor'``, ``'loss'`` or ``'predict'``.
        cp: the model's context-parallel setting: ``logits`` and
            ``targets`` are this rank's chunks; predictions are summed over
            the cp group, so every cp rank returns the whole sequence's.
        ignore_index: the target id of an uncounted token.

    Raises:
        ValueError: an unknown mode.
    """
    if mode == 'tensor':
        return logits
    if mode == 'loss':
        loss_sum, num_tokens = token_loss_sum(logits, targets, ignore_index)
        return {'loss': normalise_loss(loss_sum, num_tokens),
                TOKENS_KEY: num_tokens.to(loss_sum.dtype)}
    if mode == 'predict':
        losses = F.cross_entropy(
            logits.detach().flatten(0, 1).float(), targets.flatten(),
            ignore_index=ignore_index, reduction='none').view_as(targets)
        sums = torch.stack([losses.double().sum(1),
                            (targets != ignore_index).sum(1).double()])
        if cp is not None and cp.size > 1:
            dist.all_reduce(sums, group=cp.group)
        return [
            dict(loss_sum=loss_sum, num_tokens=int(num_tokens))
            for loss_sum, num_tokens in sums.t().tolist()
        ]
    raise ValueError(f'mode={mode!r} is not supported; allowed: tensor, '
                     'loss, predict')


class LMPipelineOutputs:
    """The pipeline protocol's last-stage methods of a causal LM: the
    ``'loss'`` and ``'predict'`` outputs of :func:`lm_outputs` (a model
    using it has a ``context_parallel`` setting)."""

    def pipeline_loss(self, logits: torch.Tensor,
                      data_samples: torch.Tensor) -> dict:
        return lm_outputs(logits, data_samples, 'loss')

    def pipeline_predict(self, logits: torch.Tensor,
                         data_samples: torch.Tensor) -> list:
        return lm_outputs(logits, data_samples, 'predict',
                          self.context_parallel)


def transformer_flops_per_token(num_matmul_params: int, num_layers: int,
                                num_heads: int, head_dim: int,
                                seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6 N`` for the
    matmuls plus ``12 L H D T`` for attention scores and values (PaLM,
    appendix B; torchtitan's ``get_num_flop_per_token``)."""
    return 6.0 * num_matmul_params + (
        12.0 * num_layers * num_heads * head_dim * seq_len)
