"""ThroughputHook: tokens/s over a window of iterations, FLOP/s from the
model's flops_per_token, MFU when the peak is known."""
import types

import pytest
import torch
from mmengine.logging import MessageHub

from mmpar.models import Llama
from mmpar.runner import ThroughputHook
from mmpar.runner import throughput


def _runner(model):
    return types.SimpleNamespace(
        model=model, message_hub=MessageHub.get_instance('throughput_test'))


def test_rates_flops_and_mfu(monkeypatch):
    model = Llama(vocab_size=64, dim=32, num_layers=2, num_heads=2,
                  max_seq_len=16)
    runner = _runner(model)
    hook = ThroughputHook(peak_flops=1e9, window=2)
    hook.before_train(runner)
    clock = iter([0.0, 1.0, 3.0, 10.0, 12.0, 15.0])
    monkeypatch.setattr(throughput.time, 'perf_counter', lambda: next(clock))
    batch = dict(inputs=torch.zeros(4, 16, dtype=torch.long))
    hook.before_train_iter(runner, 0, batch)       # t=0
    hook.after_train_iter(runner, 0, batch)        # t=1: 64 tokens in 1 s
    hub = runner.message_hub
    assert hub.get_scalar('train/tokens_per_s').current() == 64
    hook.after_train_iter(runner, 1, batch)        # t=3: 128 tokens in 3 s
    rate = hub.get_scalar('train/tokens_per_s').current()
    assert rate == pytest.approx(128 / 3)
    assert hub.get_scalar('train/tokens_per_s_total').current() == rate
    flops = rate * model.flops_per_token(16)
    assert hub.get_scalar('train/flops_per_s').current() == \
        pytest.approx(flops)
    assert hub.get_scalar('train/mfu').current() == \
        pytest.approx(flops / 1e9)
    # Validation time is not training time: the clock restarts after it.
    # Validation ran from t=3 to t=10; without the restart the next
    # iteration would count 9 s instead of 2.
    hook.before_val(runner)
    hook.before_train_iter(runner, 2, batch)       # t=10 (new start)
    hook.after_train_iter(runner, 2, batch)        # t=12: 64 tokens in 2 s
    # The window (2) holds iterations 1 and 2: 128 tokens in 2 + 2 s.
    assert hub.get_scalar('train/tokens_per_s').current() == \
        pytest.approx(128 / 4)
    # The clock runs on from the end of iteration 2 (no second restart).
    hook.before_train_iter(runner, 3, batch)
    hook.after_train_iter(runner, 3, batch)        # t=15: 64 tokens in 3 s
    assert hub.get_scalar('train/tokens_per_s').current() == \
        pytest.approx(128 / 5)


def test_model_without_flops_logs_tokens_only():
    runner = _runner(torch.nn.Linear(2, 2))
    runner.message_hub = MessageHub.get_instance('throughput_plain')
    hook = ThroughputHook()
    hook.before_train(runner)
    batch = dict(inputs=torch.zeros(2, 8))
    hook.before_train_iter(runner, 0, batch)
    hook.after_train_iter(runner, 0, batch)
    scalars = runner.message_hub.log_scalars
    assert 'train/tokens_per_s' in scalars
    assert 'train/flops_per_s' not in scalars and 'train/mfu' not in scalars


@pytest.mark.parametrize('kwargs,match', [
    (dict(peak_flops=0), 'peak_flops=0'),
    (dict(window=0), 'window=0'),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ThroughputHook(**kwargs)


def test_peak_lookup_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip('CPU-only check')
    assert throughput.device_peak_flops() is None
