"""Tensor parallelism through the real launcher, as a user runs it.

``bash tools/dist_train.sh CFG 2`` with ``parallel=dict(tp=2,
tp_plan=...)``: it trains, saves, resumes bit-exactly, its checkpoint loads
strictly into the plain model, ``tools/dist_test.sh`` evaluates it with the
accuracy the run's own validation reported, and a bad plan is refused before
training.
"""
import re

from mmpar.models.vit import DigitsViT
from tests.e2e import assert_same_training_state, load_ckpt, run_tool

CONFIG = 'configs/vit_digits/vit_digits_iter.py'
TP = ['parallel.tp=2', 'parallel.tp_plan=digits_vit']
SHORT = ['train_cfg.val_interval=8', 'default_hooks.checkpoint.interval=4']


def _train(work_dir, iters, *extra):
    return run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                     work_dir, *extra, '--cfg-options', *TP,
                     f'train_cfg.max_iters={iters}', *SHORT])


def _last_accuracy(output: str) -> float:
    return float(re.findall(r'accuracy/top1: ([\d.]+)', output)[-1])


def test_dist_train_tp2_resumes_bit_exactly_and_loads_into_plain_model(
        tmp_path):
    straight = _train(tmp_path / 'straight', 8)
    _train(tmp_path / 'resumed', 4)
    resumed = _train(tmp_path / 'resumed', 8, '--resume')
    log = resumed.stdout + resumed.stderr
    assert 'resumed epoch: 0, iter: 4' in log
    final = load_ckpt(tmp_path / 'straight' / 'iter_8.pth')
    assert_same_training_state(
        load_ckpt(tmp_path / 'resumed' / 'iter_8.pth'), final)
    # Gathered: the plain model's keys and shapes, loadable strictly.
    plain = DigitsViT(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)
    plain.load_state_dict(final['state_dict'], strict=True)
    assert {k: v.shape for k, v in final['state_dict'].items()} == {
        k: v.shape for k, v in plain.state_dict().items()}
    # tools/test.py on the TP checkpoint, itself at tp=2, agrees with the
    # validation the run did on the same weights.
    tested = run_tool(['bash', 'tools/dist_test.sh', CONFIG,
                       tmp_path / 'straight' / 'iter_8.pth', 2,
                       '--cfg-options', *TP])
    accuracy = _last_accuracy(straight.stdout + straight.stderr)
    assert _last_accuracy(tested.stdout + tested.stderr) == accuracy
    # And on one process, unsplit.
    one = run_tool(['python', 'tools/test.py', CONFIG,
                    tmp_path / 'straight' / 'iter_8.pth'])
    assert _last_accuracy(one.stdout + one.stderr) == accuracy


def test_dist_train_refuses_a_plan_matching_nothing(tmp_path):
    proc = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2, '--work-dir',
                     tmp_path, '--cfg-options', 'parallel.tp=2',
                     'parallel.tp_plan.type=module_plan',
                     'parallel.tp_plan.plan.blocks*ffn=colwise'],
                    timeout=300, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "pattern 'blocks*ffn' matches no module" in output, output[-3000:]
    assert 'blocks.0.mlp.0' in output  # the model's module names, listed
    assert 'Iter(train)' not in output
    assert not list(tmp_path.glob('*.pth'))

