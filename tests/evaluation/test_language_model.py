"""LanguageModelMetric: token-weighted loss, perplexity and bits per byte,
the same gathered over two data-parallel ranks as on one process."""
import math

import pytest

from mmpar.evaluation import LanguageModelMetric
from mmpar.registry import METRICS

SAMPLES = [dict(loss_sum=float(3 * i + 1), num_tokens=i + 1)
           for i in range(5)]


def _expected():
    loss = sum(s['loss_sum'] for s in SAMPLES) / sum(
        s['num_tokens'] for s in SAMPLES)
    return loss


def test_one_process():
    metric = METRICS.build(dict(type='LanguageModelMetric'))
    metric.process(None, SAMPLES)
    out = metric.evaluate(len(SAMPLES))
    loss = _expected()
    assert out['lm/cross_entropy'] == pytest.approx(loss)
    assert out['lm/perplexity'] == pytest.approx(math.exp(loss))
    assert out['lm/bits_per_byte'] == pytest.approx(loss / math.log(2))


def test_bytes_per_token():
    metric = LanguageModelMetric(bytes_per_token=4.0)
    metric.process(None, SAMPLES)
    assert metric.evaluate(5)['lm/bits_per_byte'] == pytest.approx(
        _expected() / math.log(2) / 4)
    with pytest.raises(ValueError, match='bytes_per_token=0'):
        LanguageModelMetric(bytes_per_token=0)


def test_uncounted_targets_stand_for_no_bytes():
    import torch
    metric = LanguageModelMetric()
    metric.dataset_meta = dict(token_bytes=[1] * 255 + [3])
    # A masked boundary / prompt target (-100) is neither a token nor a
    # byte; indexing the table with it read the table from the end.
    targets = torch.tensor([[255, 7, -100, -100]])
    metric.process(dict(data_samples=targets),
                   [dict(loss_sum=2.0, num_tokens=2)])
    assert metric.evaluate(1)['lm/bits_per_byte'] == pytest.approx(
        2.0 / math.log(2) / 4)


def _evaluate_on_rank():
    from mmengine.dataset import DefaultSampler
    sampler = DefaultSampler(list(range(len(SAMPLES))), shuffle=False)
    metric = LanguageModelMetric()
    # 5 samples on 2 ranks: the sampler repeats one; collect_results drops it.
    metric.process(None, [SAMPLES[i] for i in sampler])
    return metric.evaluate(len(SAMPLES))


def test_gathered_over_two_ranks(run_dist):
    results = run_dist(_evaluate_on_rank)
    for out in results:
        assert out['lm/cross_entropy'] == pytest.approx(_expected())


def test_names_escape_mmengine_log_smoothing():
    """MMEngine's LogProcessor logs keys matching its mean_pattern (any
    'loss') as a mean over past validations; the metric's must be current."""
    import re

    from mmengine.runner import LogProcessor
    metric = LanguageModelMetric()
    metric.process(None, SAMPLES)
    pattern = LogProcessor().mean_pattern
    for key in metric.evaluate(len(SAMPLES)):
        assert not re.search(pattern, key), key
