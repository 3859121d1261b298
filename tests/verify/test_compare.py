"""verify's pieces without training: which dimension of a tp module's local
output it gathers, and the largest relative difference it reports."""
import subprocess
import sys

import torch

from mmpar.verify import compare
from mmpar.verify.fingerprint import tensor_fingerprint
from mmpar.verify.recorder import tp_split_dim
from tests.e2e import ROOT


def test_tp_split_dim_never_takes_the_batch():
    # dp=2 x tp=2: the local batch is half the reference's, as a colwise
    # split halves the last dimension; the split is the last.
    assert tp_split_dim((4, 16, 8), (8, 16, 16), 2) == 2
    # A whole (replicated) output: its batch is only a data rank's part.
    assert tp_split_dim((4, 16, 16), (8, 16, 16), 2) is None
    # Sequence parallel: the sequence, not the batch.
    assert tp_split_dim((4, 8, 16), (8, 16, 16), 2) == 1
    assert tp_split_dim((4, 8), (8, 8, 1), 2) is None


def _step(grad: torch.Tensor) -> dict:
    entry = (tensor_fingerprint(grad), float(grad.shape[0]), grad.numel())
    return dict(outputs={}, order=[], grads={'attn.wk.bias': entry},
                grad_order=['attn.wk.bias'], loss=2.0, grad_norm=1.0)


def test_rounding_noise_within_atol_is_no_relative_difference():
    # A key bias's gradient is zero in exact arithmetic (softmax ignores a
    # shift shared by every key): both layouts hold rounding noise.
    ref = torch.full((8, ), 3e-10, dtype=torch.float64)
    verdict = compare([_step(ref)], [_step(-ref)], rtol=1e-3, atol=1e-7,
                      touches={})
    assert verdict.agree, verdict.text
    assert verdict.max_relative == 0.0, verdict.text
    # Beyond atol the relative difference is reported, and decides.
    ref = torch.ones(8, dtype=torch.float64)
    verdict = compare([_step(ref)], [_step(ref * 1.0002)], rtol=1e-3,
                      atol=1e-7, touches={})
    assert verdict.agree and 1e-4 < verdict.max_relative < 6e-4
    verdict = compare([_step(ref)], [_step(ref * 1.01)], rtol=1e-3,
                      atol=1e-7, touches={})
    assert not verdict.agree
    assert 'module `attn.wk` (gradient of bias)' in verdict.text


def test_reference_batch_of_shipped_configs():
    # The verify tool checks the config before any Runner exists: mmpar's
    # own samplers must be registered (a fresh process, as the tool's).
    # Expert ranks read different samples, as data ranks do: at ep=2 the
    # reference reads 2 ranks' batches.
    code = (
        'from mmengine.config import Config\n'
        'from mmpar.verify import reference_config\n'
        "for name in ('llama_sft', 'llama_shakespeare_moe_ep'):\n"
        "    cfg = Config.fromfile(f'configs/llama_shakespeare/{name}.py')\n"
        '    print(cfg.train_dataloader.batch_size,\n'
        '          reference_config(cfg, 2).train_dataloader.batch_size)\n')
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == ['16 32', '32 64']
