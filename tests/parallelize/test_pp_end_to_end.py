"""Pipeline parallelism through the real launcher, as a user runs it.

``bash tools/dist_train.sh configs/vit_digits/vit_digits_pp.py 2`` trains
one epoch at pp=2; its checkpoint (every stage gathered) loads strictly into
the plain model; ``tools/dist_test.sh`` at pp=2 and ``tools/test.py`` in one
process both report the accuracy the run's own validation reported;
``--resume`` goes on from it with every stage's optimizer state.
"""
import re

from mmpar.models.vit import DigitsViT
from tests.e2e import load_ckpt, run_tool

CONFIG = 'configs/vit_digits/vit_digits_pp.py'
# Batches of 128 (32 per micro-batch): 12 steps per epoch keep it quick.
SHORT = ['train_dataloader.batch_size=128']


def _accuracy(result) -> float:
    output = result.stdout + result.stderr
    return float(re.findall(r'accuracy/top1: ([\d.]+)', output)[-1])


def test_dist_train_pp2_checkpoint_and_test_match_one_process(tmp_path):
    trained = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2,
                        '--work-dir', tmp_path, '--cfg-options',
                        'train_cfg.max_epochs=1', *SHORT])
    checkpoint = tmp_path / 'epoch_1.pth'
    plain = DigitsViT(embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)
    plain.load_state_dict(load_ckpt(checkpoint)['state_dict'], strict=True)
    accuracy = _accuracy(trained)
    tested = run_tool(['bash', 'tools/dist_test.sh', CONFIG, checkpoint, 2])
    assert _accuracy(tested) == accuracy
    one = run_tool(['python', 'tools/test.py',
                    'configs/vit_digits/vit_digits.py', checkpoint,
                    '--work-dir', tmp_path / 'one'])
    assert _accuracy(one) == accuracy
    resumed = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2,
                        '--work-dir', tmp_path, '--resume', '--cfg-options',
                        'train_cfg.max_epochs=2', 'train_cfg.val_interval=3',
                        *SHORT])
    assert 'resumed epoch: 1' in resumed.stdout + resumed.stderr
    saved = load_ckpt(checkpoint)['optimizer']['state']
    assert set(saved) == {n for n, _ in plain.named_parameters()}
    after = load_ckpt(tmp_path / 'epoch_2.pth')['optimizer']['state']
    # AdamW's step count goes on from the saved one: one more epoch of
    # 1,437 images in batches of 128 (pp peers read the same batches).
    steps = after['cls_token']['step'] - saved['cls_token']['step']
    assert int(steps) == 12
