"""Pipeline parallelism through the real launcher, as a user runs it.

``bash tools/dist_train.sh configs/vit_digits/vit_digits_pp.py 2`` trains
one epoch at pp=2; its checkpoint (every stage gathered) loads strictly into
the plain model; ``tools/dist_test.sh`` at pp=2 and ``tools/test.py`` in one
process both report the accuracy the run's own validation reported.
"""
import re

from mmpar.models.vit import DigitsViT
from tests.e2e import load_ckpt, run_tool

CONFIG = 'configs/vit_digits/vit_digits_pp.py'


def _accuracy(result) -> float:
    output = result.stdout + result.stderr
    return float(re.findall(r'accuracy/top1: ([\d.]+)', output)[-1])


def test_dist_train_pp2_checkpoint_and_test_match_one_process(tmp_path):
    trained = run_tool(['bash', 'tools/dist_train.sh', CONFIG, 2,
                        '--work-dir', tmp_path, '--cfg-options',
                        'train_cfg.max_epochs=1'])
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
