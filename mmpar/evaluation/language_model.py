"""Validation loss, perplexity and bits per byte of a language model."""
import math
from typing import List, Sequence

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
    ``lm/perplexity`` (``exp`` of it) and ``lm/bits_per_byte``
    (``cross_entropy / ln 2 / bytes_per_token``). No name contains "loss":
    MMEngine's LogProcessor averages every scalar matching its
    ``mean_pattern`` (``loss|time|...``) over the last validations, so a
    ``lm/loss`` key would be logged as a running mean, not this value.

    Args:
        bytes_per_token: mean UTF-8 bytes per token (1 for the byte-level
            tokenizer).
        collect_device: ``'gpu'`` (default) gathers with
            ``all_gather_object``, which runs on gloo too; ``'cpu'`` writes
            temporary files.
        prefix: metric-name prefix.
    """

    default_prefix = 'lm'

    def __init__(self,
                 bytes_per_token: float = 1.0,
                 collect_device: str = 'gpu',
                 prefix: str = None):
        super().__init__(collect_device=collect_device, prefix=prefix)
        if bytes_per_token <= 0:
            raise ValueError(f'bytes_per_token={bytes_per_token} must be > 0')
        self.bytes_per_token = bytes_per_token

    def process(self, data_batch, data_samples: Sequence[dict]) -> None:
        for sample in data_samples:
            self.results.append(
                (float(sample['loss_sum']), int(sample['num_tokens'])))

    def compute_metrics(self, results: List[tuple]) -> dict:
        total = math.fsum(loss for loss, _ in results)
        tokens = sum(n for _, n in results)
        loss = total / max(tokens, 1)
        return dict(
            cross_entropy=loss,
            perplexity=math.exp(min(loss, 700.0)),
            bits_per_byte=loss / math.log(2) / self.bytes_per_token)
