"""FSDP under mmpar.Runner: full checkpoints, plain-model loading, exact
resume, weight init before sharding. Runners run inside the shared gloo pool
(no torchrun start-up per run)."""
import pytest
import torch
from mmengine.config import Config

from mmpar.models import DigitsViT
from tests.e2e import ROOT, assert_same_training_state, load_ckpt

CONFIGS = {
    'MMFullyShardedDataParallel': 'configs/vit_digits/vit_digits_fsdp.py',
    'MMFullyShard': 'configs/vit_digits/vit_digits_fsdp2.py',
}
# Small enough for seconds per epoch on 2 CPU ranks: 3 iterations per epoch.
SMALL_MODEL = dict(embed_dim=16, depth=2, num_heads=2)


def _small_cfg(config: str, work_dir: str, max_epochs: int, **extra):
    cfg = Config.fromfile(str(ROOT / config))
    cfg.model.update(SMALL_MODEL)
    cfg.train_dataloader.batch_size = 256
    cfg.val_dataloader.batch_size = 180
    cfg.train_cfg.max_epochs = max_epochs
    cfg.default_hooks.logger.interval = 1
    cfg.launcher = 'pytorch'
    cfg.work_dir = work_dir
    cfg.update(extra)
    return cfg


def _train(config, work_dir, max_epochs, name, **extra):
    from mmpar.runner import Runner
    cfg = _small_cfg(config, work_dir, max_epochs, **extra)
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    Runner.from_cfg(cfg).train()


@pytest.mark.parametrize('wrapper_type', list(CONFIGS))
def test_checkpoints_are_full_and_resume_is_exact(run_dist, tmp_path,
                                                  wrapper_type):
    config = CONFIGS[wrapper_type]
    resumed, straight = tmp_path / 'resumed', tmp_path / 'straight'
    run_dist(_train, config, str(resumed), 2, f'{wrapper_type}_2ep')
    run_dist(_train, config, str(resumed), 3, f'{wrapper_type}_resume',
             resume=True)
    run_dist(_train, config, str(straight), 3, f'{wrapper_type}_3ep')

    resumed_ckpt = load_ckpt(resumed / 'epoch_3.pth')
    assert_same_training_state(resumed_ckpt,
                               load_ckpt(straight / 'epoch_3.pth'))

    cfg = _small_cfg(config, str(tmp_path), 1)
    model = DigitsViT(**{k: v for k, v in cfg.model.items() if k != 'type'})
    assert list(resumed_ckpt['state_dict']) == list(model.state_dict())
    model.load_state_dict(resumed_ckpt['state_dict'], strict=True)
    # Full tensors, not shards, and trained.
    untrained = load_ckpt(resumed / 'epoch_2.pth')['state_dict']
    for key, value in model.state_dict().items():
        assert value.shape == untrained[key].shape
    assert not torch.equal(resumed_ckpt['state_dict']['head.weight'],
                           untrained['head.weight'])
    # Optimizer state for every trainable parameter, full-sized.
    optim_state = resumed_ckpt['optimizer']['state']
    for name, param in model.named_parameters():
        assert optim_state[name]['exp_avg'].shape == param.shape, name

    # The same checkpoint resumes on one process, unwrapped.
    runner = _resume_single_process(config, resumed / 'epoch_3.pth',
                                    tmp_path / 'single', wrapper_type)
    params = dict(runner.model.named_parameters())
    state = runner.optim_wrapper.optimizer.state
    for name, saved in optim_state.items():
        torch.testing.assert_close(
            state[params[name]]['exp_avg'], saved['exp_avg'], atol=0, rtol=0)
    assert runner.epoch == 3


def _resume_single_process(config, ckpt, work_dir, name):
    from mmpar.runner import Runner
    cfg = _small_cfg(config, str(work_dir), 3, resume=True,
                     load_from=str(ckpt))
    cfg.launcher = 'none'
    cfg.experiment_name = f'{name}_single'
    runner = Runner.from_cfg(cfg)
    runner.train()  # already at epoch 3: loads, trains nothing
    return runner


def _resumed_full_optim_state(config, ckpt, work_dir):
    from mmpar.runner import Runner
    cfg = _small_cfg(config, work_dir, 2, resume=True, load_from=ckpt)
    cfg.experiment_name = 'ddp_to_fsdp_resume'
    runner = Runner.from_cfg(cfg)
    runner.train()  # already at epoch 2: loads, trains nothing
    return runner.model.full_optim_state_dict(runner.optim_wrapper.optimizer)


def test_ddp_checkpoint_resumes_sharded(run_dist, tmp_path):
    ddp_dir = tmp_path / 'ddp'
    run_dist(_train, 'configs/vit_digits/vit_digits.py', str(ddp_dir), 2,
             'ddp_2ep')
    ckpt = load_ckpt(ddp_dir / 'epoch_2.pth')
    cfg = _small_cfg(CONFIGS['MMFullyShardedDataParallel'], '', 1)
    model = DigitsViT(**{k: v for k, v in cfg.model.items() if k != 'type'})
    names = [name for name, _ in model.named_parameters()]
    results = run_dist(_resumed_full_optim_state,
                       CONFIGS['MMFullyShardedDataParallel'],
                       str(ddp_dir / 'epoch_2.pth'), str(tmp_path / 'fsdp'))
    for full in results:
        for index, saved in ckpt['optimizer']['state'].items():
            torch.testing.assert_close(
                full['state'][names[index]]['exp_avg'], saved['exp_avg'],
                atol=0, rtol=0)
