"""Context parallelism through the real launcher, as a user runs it:
``bash tools/dist_train.sh <Llama config> 2 --cfg-options parallel.cp=2``
trains each sequence split over 2 ranks and ends with the weights, logged
losses and validation of ``tools/train.py`` on one process; ``tools/test.py``
on its checkpoint (one process, unsplit) agrees with its validation; a
sequence length that does not divide by 2 x cp is refused before training.
"""
import re

import torch

from tests.configs.test_llama_configs import SHRINK
from tests.e2e import load_ckpt, run_tool

CONFIG = 'configs/llama_shakespeare/llama_shakespeare.py'
OPTIONS = [f'{k}={v}' for k, v in SHRINK.items()] + [
    'train_cfg.max_iters=4', 'train_cfg.val_interval=4',
    'default_hooks.checkpoint.interval=4']
# tools/test.py reads test_dataloader, shrunk like the validation.
TEST_OPTIONS = [o.replace('val_dataloader', 'test_dataloader')
                for o in OPTIONS if o.startswith('val_dataloader')]


def _losses(output: str) -> list:
    return [float(v) for v in re.findall(r'Iter\(train\).*? loss: ([\d.]+)',
                                         output)]


def _val(output: str) -> float:
    return float(re.findall(r'lm/cross_entropy: ([\d.]+)', output)[-1])


def test_dist_train_cp2_matches_one_process(tmp_path):
    cp = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                   tmp_path / 'cp', '--cfg-options', 'parallel.cp=2',
                   *OPTIONS])
    one = run_tool(['python', 'tools/train.py', CONFIG, '--work-dir',
                    tmp_path / 'one', '--cfg-options', *OPTIONS])
    cp_log, one_log = cp.stdout + cp.stderr, one.stdout + one.stderr
    assert 'parallel = dict(cp=2)' in cp_log
    assert len(_losses(cp_log)) == 4
    assert _losses(cp_log) == _losses(one_log)  # as logged: 4 decimals
    assert _val(cp_log) == _val(one_log)
    a = load_ckpt(tmp_path / 'cp' / 'iter_4.pth')['state_dict']
    b = load_ckpt(tmp_path / 'one' / 'iter_4.pth')['state_dict']
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=1e-5, rtol=1e-4,
                                   msg=key)
    tested = run_tool(['python', 'tools/test.py', CONFIG,
                       tmp_path / 'cp' / 'iter_4.pth', '--work-dir',
                       tmp_path / 'test', '--cfg-options', *OPTIONS,
                       *TEST_OPTIONS])
    assert _val(tested.stdout + tested.stderr) == _val(cp_log)


def test_dist_train_refuses_a_length_not_divisible_by_2cp(tmp_path):
    proc = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                     tmp_path, '--cfg-options', 'parallel.cp=2',
                     *OPTIONS, 'train_dataloader.dataset.context_length=30'],
                    timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert 'train_dataloader.dataset.context_length=30 is not allowed; ' \
        'with parallel.cp=2 each sequence is cut into 2 x cp = 4 equal ' \
        'chunks' in output, output[-3000:]
    assert 'Iter(train)' not in output
