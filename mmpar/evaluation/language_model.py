"""Validation loss, perplexity and bits per byte of a language model."""
import math
from typing import List, Optional, Sequence

import torch
from mmengine.evaluator import BaseMetric

from mmpar.registry import METRICS


@METRICS.register_module()
class LanguageModelMetric(BaseMetric):
    """Token-weighted mean cross-entropy over the validation set.

    Consumes predictions ``dict(loss_sum, num_tokens)`` (one per sample, as
    :class:`mmpar.models.Llama` returns in ``'predict'`` mode). Sums are
    gathered from every data-parallel rank (MMEngine's ``collect_results``,
    which drops the samples a sampler repeated to even out the ranks) before
    the division, so the result is the one-process value.

    Reports ``lm/cross_entropy`` (the validation loss, nats per token),
    ``lm/perplexity`` (``exp`` of it) and ``lm/bits_per_byte`` (total nats
    over ``ln 2`` times the bytes of text the targets stand for: the
    dataset's ``token_bytes`` per token id, summed over each sample's
    targets; without it, ``bytes_per_token`` per token). No name contains "loss":
    MMEngine's LogProcessor averages every scalar matching its
    ``mean_pattern`` (``loss|time|...``) over the last validations, so a
    ``lm/loss`` key would be logged as a running mean, not this value.

    Args:
        bytes_per_token: mean UTF-8 bytes per token, when the dataset's
            ``metainfo`` has no ``token_bytes`` (``None``: 1, bytes).
        collect_device: ``'gpu'`` (default) gathers with
            ``all_gather_object``, which runs on gloo too; ``'cpu'`` writes
            temporary files.
        prefix: metric-name prefix.
    """

    default_prefix = 'lm'

    def __init__(self,
                 bytes_per_token: Optional[float] = None,
                 collect_device: str = 'gpu',
                 prefix: str = None):
        super().__init__(collect_device=collect_device, prefix=prefix)
        if bytes_per_token is not None and bytes_per_token <= 0:
            raise ValueError(f'bytes_per_token={bytes_per_token} must be > 0')
        self.bytes_per_token = bytes_per_token

    def _sample_bytes(self, data_batch, count: int) -> List[float]:
        token_bytes = (self.dataset_meta or {}).get('token_bytes')
        targets = data_batch.get('data_samples') \
            if isinstance(data_batch, dict) else None
        if self.bytes_per_token is not None or token_bytes is None or \
                not isinstance(targets, torch.Tensor):
            return [None] * count
        table = torch.as_tensor(token_bytes, dtype=torch.float64)
        targets = targets.cpu().long()
        # An uncounted target (-100: a masked boundary or prompt) stands
        # for no text.
        counted = targets >= 0
        return (table[targets.clamp(min=0)] * counted).sum(-1).tolist()

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        num_bytes = self._sample_bytes(data_batch, len(data_samples))
        for sample, nbytes in zip(data_samples, num_bytes):
            tokens = int(sample['num_tokens'])
            if nbytes is None:
                nbytes = tokens * (self.bytes_per_token or 1.0)
            self.results.append((float(sample['loss_sum']), tokens, nbytes))

    def compute_metrics(self, results: List[tuple]) -> dict:
        total = math.fsum(loss for loss, _, _ in results)
        tokens = sum(n for _, n, _ in results)
        num_bytes = math.fsum(b for _, _, b in results)
        loss = total / max(tokens, 1)
        return dict(
            cross_entropy=loss,
            perplexity=math.exp(min(loss, 700.0)),
            bits_per_byte=total / math.log(2) / max(num_bytes, 1))
