"""OpenMMLab's usual tools/train.py flags: they parse and they act."""
from types import SimpleNamespace

import pytest

from mmpar.cli import parse_train_args, train_config
from tests.e2e import DEFAULT_CONFIG


def _cfg(tmp_path, *flags):
    return train_config(
        parse_train_args([DEFAULT_CONFIG, '--work-dir',
                          str(tmp_path), *flags]))


def test_no_flags_leave_the_config_alone(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.val_dataloader is not None and cfg.val_cfg is not None
    assert 'pin_memory' not in cfg.train_dataloader
    assert cfg.get('auto_scale_lr') is None


def test_no_validate_drops_validation(tmp_path):
    from mmpar.runner import Runner
    cfg = _cfg(tmp_path, '--no-validate')
    assert cfg.val_cfg is None and cfg.val_dataloader is None
    assert cfg.val_evaluator is None
    cfg.train_cfg.max_epochs = 1
    runner = Runner.from_cfg(cfg)
    assert runner._val_loop is None  # MMEngine then never validates


def test_no_pin_memory_and_no_persistent_workers_reach_every_loader(
        tmp_path):
    cfg = _cfg(tmp_path, '--no-pin-memory', '--no-persistent-workers')
    for name in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        assert cfg[name].pin_memory is False, name
        assert cfg[name].persistent_workers is False, name


def test_auto_scale_lr_needs_base_batch_size(tmp_path):
    with pytest.raises(ValueError, match='auto_scale_lr.base_batch_size'):
        _cfg(tmp_path, '--auto-scale-lr')


def _scaled_lr(tmp_path, world_size=1, dp_size=None):
    from mmpar.runner import Runner
    cfg = _cfg(tmp_path, '--auto-scale-lr', '--cfg-options',
               'auto_scale_lr.base_batch_size=64')
    assert cfg.auto_scale_lr.enable is True
    cfg.train_cfg.max_epochs = 1
    runner = Runner.from_cfg(cfg)
    runner._world_size = world_size
    if dp_size is not None:
        runner.topology = SimpleNamespace(dp_size=dp_size)
    optim_wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
    runner.scale_lr(optim_wrapper, runner.auto_scale_lr)
    return optim_wrapper.optimizer.param_groups[0]['lr']


def test_auto_scale_lr_scales_by_the_global_batch(tmp_path):
    # batch 32 per process, base 64: one process halves lr=2e-3.
    assert _scaled_lr(tmp_path) == pytest.approx(1e-3)


def test_auto_scale_lr_counts_data_parallel_ranks_only(tmp_path):
    # 4 ranks of which 2 are data-parallel (tp=2): the global batch is
    # 2 x 32 = 64 = base, so the lr stays; MMEngine alone would double it.
    assert _scaled_lr(tmp_path, world_size=4, dp_size=2) == pytest.approx(
        2e-3)
    assert _scaled_lr(tmp_path, world_size=4, dp_size=4) == pytest.approx(
        4e-3)
