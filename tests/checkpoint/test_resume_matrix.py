"""Every wrapper resumes every other wrapper's checkpoints, full and sharded.

A checkpoint saved under one process, DDP, FSDP1 or FSDP2 (2 ranks) resumes
under each of the others: the optimizer state as loaded equals the saved one
exactly, and training goes on from the saved iteration.
"""
import pytest

from tests.e2e import load_ckpt
from tests.checkpoint.test_sharded_checkpoint import (CONFIGS, _assert_resumed_state,
                                           _CaptureLoaded, _named_saved_state,
                                           _plain_model, _small_cfg, _train)

ONE = 'one process'
SAVERS = (ONE, *CONFIGS)
# No validation: the matrix is about state, and 24 resumes must stay cheap.
NO_VAL = dict(val_cfg=None, val_dataloader=None, val_evaluator=None)


def _config(wrapper):
    return CONFIGS['MMDistributedDataParallel' if wrapper == ONE else wrapper]


def _ckpt_path(work_dir, fmt):
    return f'{work_dir}/epoch_1' + ('.pth' if fmt == 'full' else '')


def _save(wrapper, fmt, work_dir):
    extra = dict(NO_VAL, launcher='none') if wrapper == ONE else NO_VAL
    _train(_config(wrapper), work_dir, 1, f'save_{wrapper}_{fmt}', fmt,
           **extra)


def _save_all_dist(fmt, root):
    for wrapper in CONFIGS:
        _save(wrapper, fmt, f'{root}/{wrapper}')


def _resume(wrapper, ckpt, work_dir, name):
    """Resume ``ckpt`` under ``wrapper`` for one more epoch.

    Returns:
        (epoch as loaded, optimizer state as loaded, iteration at the end).
    """
    from mmpar.runner import Runner
    cfg = _small_cfg(_config(wrapper), work_dir, 2, name, 'full', resume=True,
                     load_from=ckpt, **NO_VAL)
    if wrapper == ONE:
        cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    hook = _CaptureLoaded()
    runner._hooks.insert(0, hook)
    runner.train()
    return hook.epoch, hook.state, runner.iter


def _resume_all_dist(fmt, root, out):
    results = {}
    for saver in SAVERS:
        for wrapper in CONFIGS:
            if wrapper != saver:
                results[saver, wrapper] = _resume(
                    wrapper, _ckpt_path(f'{root}/{saver}', fmt),
                    f'{out}/{saver}_to_{wrapper}', f'{fmt}_{saver}_{wrapper}')
    return results


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_every_wrapper_resumes_every_other(run_dist, tmp_path, fmt):
    from mmpar.checkpoint.sharded import sharded_to_full
    root = tmp_path / 'saved'
    _save(ONE, fmt, f'{root}/{ONE}')
    run_dist(_save_all_dist, fmt, str(root))

    saved = {}
    for saver in SAVERS:
        path = _ckpt_path(f'{root}/{saver}', fmt)
        ckpt = load_ckpt(path) if fmt == 'full' else sharded_to_full(path)
        saved[saver] = (_named_saved_state(ckpt, _plain_model()),
                        ckpt['meta']['iter'])

    results = dict(run_dist(_resume_all_dist, fmt, str(root),
                            str(tmp_path / 'resumed'))[0])
    for saver in CONFIGS:  # 2-rank checkpoints on one process
        results[saver, ONE] = _resume(ONE, _ckpt_path(f'{root}/{saver}', fmt),
                                      f'{tmp_path}/one/{saver}',
                                      f'{fmt}_{saver}_one')
    assert len(results) == 12
    for (saver, wrapper), (epoch, loaded, end_iter) in results.items():
        state, saved_iter = saved[saver]
        assert epoch == 1, (saver, wrapper)
        _assert_resumed_state(loaded, state)
        # One more epoch: 1,437 images over 2 x 256 (3 steps) or 1 x 256.
        steps = 6 if wrapper == ONE else 3
        assert end_iter == saved_iter + steps, (saver, wrapper)
