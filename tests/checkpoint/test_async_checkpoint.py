"""Asynchronous checkpoints (``default_hooks.checkpoint.async_save=True``):
the saved state equals a synchronous save's bit for bit, in both formats and
on 2 FSDP2 ranks; a failing background write is raised at the next step;
nothing reads a checkpoint before its write is complete."""
import logging
import threading
import time

import pytest
import torch
from mmengine.logging import MMLogger

import mmpar.checkpoint.files as files
from mmpar.checkpoint.background import (BackgroundSave, CheckpointSaveError,
                                         stage)
from mmpar.checkpoint.latest import find_latest_complete_checkpoint
from mmpar.failures import ConfigError
from tests.e2e import assert_same_training_state, load_ckpt, read_dcp_checkpoint
from tests.trained import CONFIGS, small_cfg

# ---------------------------------------------------------------- units


def test_failed_write_is_raised_once_and_nothing_runs_after_it():
    saves, ran = BackgroundSave(), []

    def broken():
        raise OSError('disk full')

    saves.start('ckpt_1', broken)
    saves.then(lambda: ran.append('pointer'))
    with pytest.raises(CheckpointSaveError, match="'ckpt_1'.*disk full"):
        saves.wait()
    assert ran == []
    saves.check()  # reported once
    saves.then(lambda: ran.append('now'))  # nothing in flight: runs now
    assert ran == ['now']


def test_one_write_in_flight_and_then_runs_after_it():
    saves, order = BackgroundSave(), []
    release = threading.Event()

    def slow():
        release.wait(10)
        order.append('first')

    saves.start('a', slow)
    saves.then(lambda: order.append('pointer a'))
    assert saves.in_flight
    threading.Timer(0.2, release.set).start()
    saves.start('b', lambda: order.append('second'))  # waits for 'a'
    saves.wait()
    assert order == ['first', 'pointer a', 'second']
    assert not saves.in_flight


def test_write_duration_covers_what_follows_and_is_logged():
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    saves = BackgroundSave()
    assert saves.last_duration is None
    saves.start('ckpt_3', lambda: time.sleep(0.1))
    saves.then(lambda: time.sleep(0.1))  # e.g. the rename, the pointer
    saves.wait()
    logger.removeHandler(handler)
    assert 0.2 <= saves.last_duration < 5
    assert logged == [f'checkpoint ckpt_3 written in the background in '
                      f'{saves.last_duration:.2f} s']
    saves.start('ckpt_4', lambda: 1 / 0)
    with pytest.raises(CheckpointSaveError):
        saves.wait()
    assert 0.2 <= saves.last_duration  # a failed write leaves it


def test_stage_copies_cpu_tensors():
    weight = torch.ones(3)
    staged = stage(dict(w=weight, meta=dict(epoch=1), rng=[weight]))
    weight.add_(1)
    assert torch.equal(staged['w'], torch.ones(3))
    assert torch.equal(staged['rng'][0], torch.ones(3))
    assert staged['meta'] == dict(epoch=1)


def test_async_save_must_be_a_bool(tmp_path):
    from mmpar.config_check import check_config
    cfg = tiny_cfg(tmp_path, 'bad_async', 'full', launcher='none',
                   async_save='yes')
    with pytest.raises(ConfigError,
                       match=r"async_save='yes'.*allowed: True"):
        check_config(cfg)


def test_async_save_needs_mmengines_hook(tmp_path):
    from mmpar.runner.checkpoint_hook import with_async_hook
    with pytest.raises(ConfigError, match="type='MyHook' with async_save"):
        with_async_hook(dict(checkpoint=dict(type='MyHook', async_save=True)))
    given = dict(checkpoint=dict(type='CheckpointHook', async_save=True))
    assert with_async_hook(given)['checkpoint']['type'].__name__ == \
        'AsyncCheckpointHook'
    assert given['checkpoint']['type'] == 'CheckpointHook'  # not mutated


@pytest.mark.parametrize('hooks', [None, dict(checkpoint=dict(
    type='CheckpointHook', interval=2))], ids=['default', 'named'])
def test_mmengines_hook_without_async_save_saves_synchronously(hooks):
    # The hook that keeps the previous checkpoint until the next is complete
    # stands in for MMEngine's always; it saves in the background only when
    # the config asks (its own default, for a config naming it, is async).
    from mmpar.registry import HOOKS
    from mmpar.runner.checkpoint_hook import with_async_hook
    hook = HOOKS.build(with_async_hook(hooks)['checkpoint'])
    assert type(hook).__name__ == 'AsyncCheckpointHook'
    assert hook.async_save is False


# ------------------------------------------------------ runs (in-process)


def tiny_cfg(work_dir, name, fmt, wrapper='MMFullyShard', iters=2,
             launcher='pytorch', **hook):
    """The small ViT, iteration-based, no validation, saving every
    iteration."""
    cfg = small_cfg(CONFIGS[wrapper], work_dir, 1, name, fmt)
    cfg.train_cfg = dict(by_epoch=False, max_iters=iters)
    cfg.val_dataloader = cfg.val_cfg = cfg.val_evaluator = None
    hook.setdefault('interval', 1)
    cfg.default_hooks.checkpoint = dict(
        type='CheckpointHook', by_epoch=False, **hook)
    cfg.launcher = launcher
    return cfg


def _read(path, fmt):
    return load_ckpt(path) if fmt == 'full' else read_dcp_checkpoint(path)


def _save_sync_then_async(work_dir, fmt):
    """On every rank: 1 iteration, then the same state saved synchronously
    and asynchronously; the model is changed while the background write
    waits, which a staged copy must not see."""
    from mmpar.runner import Runner
    runner = Runner.from_cfg(
        tiny_cfg(work_dir / 'run', f'async_{fmt}', fmt, iters=1))
    runner.train()
    runner.checkpoint_format = fmt
    name = 'iter_1.pth' if fmt == 'full' else 'iter_1'
    for out in ('sync', 'async'):
        (work_dir / out).mkdir(exist_ok=True)
    runner.save_checkpoint(str(work_dir / 'sync'), name, by_epoch=False)
    release = threading.Event()
    original = files.atomic_save

    def held_write(*args, **kwargs):  # the full file and the plain part
        release.wait(30)
        original(*args, **kwargs)

    import mmpar.checkpoint.sharded as sharded
    import mmpar.runner.runner as runner_module
    runner_module.ckpt.atomic_save = sharded.atomic_save = held_write
    try:
        runner.save_checkpoint(str(work_dir / 'async'), name,
                               by_epoch=False, async_save=True)
        with torch.no_grad():
            for param in runner.model.parameters():
                param.add_(1.0)
        release.set()
        runner.checkpoint_writes.close()
    finally:
        runner_module.ckpt.atomic_save = sharded.atomic_save = original


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_async_save_equals_sync_save_on_fsdp2(fmt, run_dist, tmp_path):
    run_dist(_save_sync_then_async, tmp_path, fmt)
    name = 'iter_1.pth' if fmt == 'full' else 'iter_1'
    sync = _read(tmp_path / 'sync' / name, fmt)
    assert_same_training_state(_read(tmp_path / 'async' / name, fmt), sync)
    assert not list((tmp_path / 'async').glob('*.tmp'))


def test_failed_background_write_is_raised_at_next_step(tmp_path,
                                                        monkeypatch):
    """A writer that fails at the first save (iteration 2 of 4): training
    stops at the next iteration (not at the next save) with the failure;
    last_checkpoint was never moved to it."""
    from mmpar.runner import Runner
    import mmpar.runner.runner as runner_module

    def broken(checkpoint, path):
        raise OSError(f'no space left writing {path}')

    monkeypatch.setattr(runner_module.ckpt, 'atomic_save', broken)
    runner = Runner.from_cfg(
        tiny_cfg(tmp_path, 'async_fail', 'full', iters=4, launcher='none',
                 async_save=True, interval=2))
    with pytest.raises(CheckpointSaveError, match='iter_2.pth.*no space'):
        runner.train()
    assert runner.iter == 2  # stopped in the step after the save
    assert not (tmp_path / 'last_checkpoint').exists()
    assert not (tmp_path / 'iter_2.pth').exists()


def test_no_partial_checkpoint_is_visible_during_the_write(tmp_path,
                                                           monkeypatch):
    """While iteration 2's write is held, its file does not exist and both
    last_checkpoint and auto-resume name iteration 1's; once it finishes,
    iteration 2's."""
    from mmpar.runner import Runner
    import mmpar.runner.runner as runner_module
    original, seen = files.atomic_save, []
    release = threading.Event()

    def held(checkpoint, path):
        if path.endswith('iter_2.pth'):
            seen.append((
                (tmp_path / 'iter_2.pth').exists(),
                (tmp_path / 'last_checkpoint').read_text(),
                find_latest_complete_checkpoint(str(tmp_path))))
            release.wait(30)
        original(checkpoint, path)

    monkeypatch.setattr(runner_module.ckpt, 'atomic_save', held)
    runner = Runner.from_cfg(
        tiny_cfg(tmp_path, 'async_hold', 'full', iters=2, launcher='none',
                 async_save=True))
    threading.Timer(1.0, release.set).start()
    runner.train()
    first = str(tmp_path / 'iter_1.pth')
    assert seen == [(False, first, first)]
    assert (tmp_path / 'last_checkpoint').read_text() == str(
        tmp_path / 'iter_2.pth')
    assert load_ckpt(tmp_path / 'iter_2.pth')['meta']['iter'] == 2
