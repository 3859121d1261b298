"""Tokens per second, achieved FLOP/s and model FLOPs utilisation in the log.

Logged as MMEngine training scalars, so they appear in the text log and in
the ``scalars.json`` that ``tools/analyze_logs.py`` reads:

* ``tokens_per_s``: tokens this rank's model replica consumed per second:
  input tokens over wall time (data loading included), both summed over the
  last ``window`` iterations, so one slow iteration weighs by its time (a
  mean of per-iteration rates would hide it);
* ``tokens_per_s_total``: the same times the data-parallel size (replicas
  run in lock-step);
* ``flops_per_s``: achieved model FLOP/s per device, ``tokens_per_s_total x
  flops_per_token / world_size`` (tensor and pipeline ranks share a
  replica's work);
* ``mfu``: ``flops_per_s`` over the device's peak, when the peak is known
  (given, or looked up for a CUDA device by name); not logged on CPU.

FLOPs per token come from the model's ``flops_per_token(seq_len)``
(:meth:`mmpar.models.Llama.flops_per_token`: 6 N plus attention); a model
without it gets tokens per second only.
"""
import collections
import time
from typing import Optional

import torch
import torch.distributed as dist
from mmengine.hooks import Hook

from mmpar import device
from mmpar.registry import HOOKS
from mmpar.wrappers.base import describe

# Dense bf16 tensor-core peaks (FLOP/s) by substring of the CUDA device name.
PEAK_BF16_FLOPS = {
    'H200': 989e12,
    'H100': 989e12,
    'A100': 312e12,
    'L40S': 362e12,
    'A10G': 70e12,
    'L4': 121e12,
}


def device_peak_flops() -> Optional[float]:
    """bf16 peak FLOP/s of this process's accelerator, or ``None``."""
    name = device.device_name()
    if name is None:
        return None
    for key, peak in PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


@HOOKS.register_module()
class ThroughputHook(Hook):
    """Log ``tokens_per_s``, ``tokens_per_s_total``, ``flops_per_s`` and
    ``mfu`` every training iteration (the log shows their window mean).

    Args:
        peak_flops: the device's peak FLOP/s for ``mfu``; ``None`` looks it
            up for CUDA devices (bf16 dense) and leaves ``mfu`` out on CPU.
        tokens_key: the batch entry whose ``numel`` is the token count.
        window: iterations the rates are measured over.
    """

    # Before LoggerHook (BELOW_NORMAL), so an iteration logs its own rate.
    priority = 'NORMAL'

    def __init__(self, peak_flops: Optional[float] = None,
                 tokens_key: str = 'inputs', window: int = 10):
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f'ThroughputHook peak_flops={peak_flops} must '
                             'be > 0 or None')
        self.peak_flops = peak_flops
        if window < 1:
            raise ValueError(f'ThroughputHook window={window} must be >= 1')
        self.tokens_key = tokens_key
        self._recent = collections.deque(maxlen=window)
        self._start = None

    def before_train(self, runner) -> None:
        if self.peak_flops is None:
            self.peak_flops = device_peak_flops()
        # The user's model (for a pipeline, this rank's stage copy); models
        # without flops_per_token log tokens per second only.
        model = describe(runner.model).model
        self._flops_per_token = getattr(model, 'flops_per_token', None)
        # Model replicas: the data axis of the runner's layout.
        topology = getattr(runner, 'topology', None)
        self._dp_size = topology.dp_size if topology is not None else 1
        self._world_size = dist.get_world_size() if dist.is_initialized() \
            else 1

    def before_val(self, runner) -> None:
        # Validation is not training time: restart the clock after it.
        self._start = None

    def before_train_iter(self, runner, batch_idx, data_batch=None) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None,
                         outputs=None) -> None:
        now = time.perf_counter()
        elapsed, self._start = now - self._start, now
        tokens = data_batch[self.tokens_key] if isinstance(
            data_batch, dict) else None
        if not isinstance(tokens, torch.Tensor):
            return
        self._recent.append((tokens.numel(), elapsed))
        per_rank = sum(n for n, _ in self._recent) / sum(
            t for _, t in self._recent)
        total = per_rank * self._dp_size
        scalars = dict(tokens_per_s=per_rank, tokens_per_s_total=total)
        if self._flops_per_token is not None:
            flops = total * self._flops_per_token(
                tokens.shape[-1]) / self._world_size
            scalars['flops_per_s'] = flops
            if self.peak_flops:
                scalars['mfu'] = flops / self.peak_flops
        for name, value in scalars.items():
            runner.message_hub.update_scalar(f'train/{name}', value)
