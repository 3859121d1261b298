"""A resumed run goes on with the LR schedule of the run it resumes; the
checkpoints go to CheckpointHook's ``out_dir``, made at the first save."""
from collections import Counter

from tests.e2e import DEFAULT_CONFIG, ROOT, load_ckpt, run_tool

CONFIG = f'''_base_ = ['{ROOT / DEFAULT_CONFIG}']
custom_imports = dict(imports=['tests.sample_recording'],
                      allow_failed_imports=False)
model = dict(depth=1, embed_dim=16, num_heads=2)
train_dataloader = dict(batch_size=8, dataset=dict(
    type='RecordedDigits', num_samples=16, split='train'))
train_cfg = dict(by_epoch=True, max_epochs=3, val_interval=1000)
val_dataloader = None
val_cfg = None
val_evaluator = None
# The OpenMMLab classic: the LR steps down 10x after epoch 2 (its end given:
# MMEngine's default, max_epochs, would be the first, shorter run's).
param_scheduler = [dict(type='MultiStepLR', by_epoch=True, milestones=[2],
                        gamma=0.1, end=3)]
default_hooks = dict(checkpoint=dict(interval=1, max_keep_ckpts=-1,
                                     out_dir='{{out_dir}}'))
'''


def test_multistep_lr_steps_down_after_a_resume(tmp_path):
    """MMEngine's MultiStepLR keeps its milestones in a ``Counter``: the
    checkpoint must keep them as one, or the resumed run never steps down."""
    config = tmp_path / 'multistep.py'
    # MMEngine's CheckpointHook saves to out_dir/<work dir's name>/.
    config.write_text(CONFIG.replace('{out_dir}', str(tmp_path / 'out')))
    work, saved = tmp_path / 'work', tmp_path / 'out' / 'work'
    run_tool(['python', 'tools/train.py', config, '--work-dir', work,
              '--cfg-options', 'train_cfg.max_epochs=1'])
    first = load_ckpt(saved / 'epoch_1.pth')
    assert first['param_schedulers'][0]['milestones'] == Counter({2: 1})
    base_lr = first['optimizer']['param_groups'][0]['initial_lr']
    run_tool(['python', 'tools/train.py', config, '--work-dir', work,
              '--resume', saved / 'epoch_1.pth'])
    lrs = [load_ckpt(saved / f'epoch_{e}.pth')['optimizer']['param_groups'][0]
           ['lr'] for e in (2, 3)]
    assert lrs == [base_lr * 0.1, base_lr * 0.1], (base_lr, lrs)
