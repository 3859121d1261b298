"""FSDP under mmpar.Runner: full checkpoints, plain-model loading, exact
resume (weight init: tests/runner/test_init_order.py). Runners run inside
the shared gloo pool (no torchrun start-up per run); the straight runs are
the session's shared ones (``trained_run``, tests/trained.py)."""
import pytest
import torch

from tests.e2e import assert_same_training_state, load_ckpt
from tests.trained import CONFIGS, plain_model, small_cfg
from tests.trained import train_dist as _train

FSDP_WRAPPERS = ('MMFullyShardedDataParallel', 'MMFullyShard')


def _small_cfg(config, work_dir, max_epochs, **extra):
    return small_cfg(config, work_dir, max_epochs, 'fsdp_runner', 'full',
                     **extra)


@pytest.mark.parametrize('wrapper_type', FSDP_WRAPPERS)
def test_checkpoints_are_full_and_resume_is_exact(run_dist, trained_run,
                                                  tmp_path, wrapper_type):
    """Resume from the straight run's epoch 2 to 3: its epoch 3 exactly."""
    config = CONFIGS[wrapper_type]
    straight, resumed = trained_run(wrapper_type, 'full'), tmp_path / 'resumed'
    run_dist(_train, config, str(resumed), 3, f'{wrapper_type}_resume',
             'full', resume=True, load_from=str(straight / 'epoch_2.pth'))
    assert not (resumed / 'epoch_2.pth').exists()  # resumed, not retrained

    resumed_ckpt = load_ckpt(resumed / 'epoch_3.pth')
    assert_same_training_state(resumed_ckpt,
                               load_ckpt(straight / 'epoch_3.pth'))

    model = plain_model()
    assert list(resumed_ckpt['state_dict']) == list(model.state_dict())
    model.load_state_dict(resumed_ckpt['state_dict'], strict=True)
    # Full tensors, not shards, and trained.
    untrained = load_ckpt(straight / 'epoch_2.pth')['state_dict']
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
                     load_from=str(ckpt), experiment_name=f'{name}_single')
    cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    runner.train()  # already at epoch 3: loads, trains nothing
    return runner


def _resumed_full_optim_state(config, ckpt, work_dir):
    from mmpar.runner import Runner
    cfg = _small_cfg(config, work_dir, 2, resume=True, load_from=ckpt,
                     experiment_name='ddp_to_fsdp_resume')
    runner = Runner.from_cfg(cfg)
    runner.train()  # already at epoch 2: loads, trains nothing
    return runner.model.full_optim_state_dict(runner.optim_wrapper.optimizer)


def test_ddp_checkpoint_resumes_sharded(run_dist, trained_run, tmp_path):
    ddp_dir = trained_run('MMDistributedDataParallel', 'full')
    ckpt = load_ckpt(ddp_dir / 'epoch_2.pth')
    names = [name for name, _ in plain_model().named_parameters()]
    results = run_dist(_resumed_full_optim_state,
                       CONFIGS['MMFullyShardedDataParallel'],
                       str(ddp_dir / 'epoch_2.pth'), str(tmp_path / 'fsdp'))
    for full in results:
        for index, saved in ckpt['optimizer']['state'].items():
            torch.testing.assert_close(
                full['state'][names[index]]['exp_avg'], saved['exp_avg'],
                atol=0, rtol=0)
