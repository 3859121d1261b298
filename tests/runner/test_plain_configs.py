"""Plain MMEngine configs run on CPU: no env_cfg picks gloo; an OpenMMLab
runtime's explicit backend='nccl' warns once and uses gloo; one process
never looks at the backend."""
import re

import pytest
import torch

from mmpar.dist import default_backend, usable_backend
from tests.e2e import ROOT, load_ckpt, run_tool

BASES = [str(ROOT / 'configs' / '_base_' / 'datasets' / 'digits.py'),
         str(ROOT / 'configs' / '_base_' / 'schedules' / 'adamw_30e.py')]
WARNING = "env_cfg.dist_cfg.backend='nccl' needs CUDA"
PLAIN = f'''_base_ = {BASES!r}
default_scope = 'mmpar'
model = dict(type='DigitsViT', image_size=8, patch_size=2, embed_dim=32,
             depth=2, num_heads=2, mlp_ratio=2.0)
train_cfg = dict(by_epoch=True, max_epochs=1, val_interval=1)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1),
                     logger=dict(type='LoggerHook', interval=10))
'''
OPENMMLAB_RUNTIME = "env_cfg = dict(cudnn_benchmark=False, " \
    "dist_cfg=dict(backend='nccl'))\n"


@pytest.fixture
def plain_config(tmp_path):
    path = tmp_path / 'plain.py'
    path.write_text(PLAIN)
    return path


def _accuracy(proc) -> float:
    found = re.findall(r'accuracy/top1: ([\d.]+)', proc.stdout + proc.stderr)
    assert found, (proc.stdout + proc.stderr)[-3000:]
    return float(found[-1])


def test_usable_backend():
    assert usable_backend(None) == default_backend()
    assert usable_backend('gloo') == 'gloo'


@pytest.mark.skipif(torch.cuda.is_available(), reason='needs a CPU-only '
                    'machine')
def test_nccl_without_cuda_warns_once_and_uses_gloo(monkeypatch):
    # Recorded at the source: MMEngine's current logger may write to a
    # stream an earlier test owns (the real output is checked below).
    import mmengine.logging
    logged = []
    monkeypatch.setattr(mmengine.logging, 'print_log',
                        lambda msg, **kwargs: logged.append(msg))
    monkeypatch.setenv('RANK', '0')
    assert usable_backend('nccl') == 'gloo'
    monkeypatch.setenv('RANK', '1')  # one warning per job: rank 0's
    assert usable_backend('nccl') == 'gloo'
    assert len(logged) == 1 and WARNING in logged[0]


def test_config_without_env_cfg_trains_resumes_and_tests_on_two_ranks(
        plain_config, tmp_path):
    work_dir = tmp_path / 'work'
    train = ['bash', 'tools/dist_train.sh', plain_config, 2, '--work-dir',
             work_dir]
    first = run_tool(train)
    assert (work_dir / 'epoch_1.pth').is_file()
    assert WARNING not in first.stdout + first.stderr  # gloo picked quietly
    resumed = run_tool(train + ['--resume', '--cfg-options',
                                'train_cfg.max_epochs=2'])
    assert 'resumed epoch: 1' in resumed.stdout + resumed.stderr
    assert load_ckpt(work_dir / 'epoch_2.pth')['meta']['epoch'] == 2
    tested = run_tool(['bash', 'tools/dist_test.sh', plain_config,
                       work_dir / 'epoch_2.pth', 2, '--work-dir',
                       tmp_path / 'test'])
    # The same weights on the same 2-rank split as the epoch-2 validation.
    assert _accuracy(tested) == _accuracy(resumed)


def test_openmmlab_runtime_with_nccl_trains_on_one_and_two_ranks(
        plain_config, tmp_path):
    plain_config.write_text(PLAIN + OPENMMLAB_RUNTIME)
    one = run_tool(['python', 'tools/train.py', plain_config, '--work-dir',
                    tmp_path / 'one'])
    # One process starts no process group: the backend is never checked.
    assert WARNING not in one.stdout + one.stderr
    assert (tmp_path / 'one' / 'epoch_1.pth').is_file()
    two = run_tool(['bash', 'tools/dist_train.sh', plain_config, 2,
                    '--work-dir', tmp_path / 'two'])
    output = two.stdout + two.stderr
    if not torch.cuda.is_available():
        assert output.count(WARNING) == 1, output[-3000:]
    assert (tmp_path / 'two' / 'epoch_1.pth').is_file()
