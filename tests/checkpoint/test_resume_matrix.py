"""Every wrapper resumes every other wrapper's checkpoints, full and sharded.

A checkpoint saved under one process, DDP, FSDP1 or FSDP2 (2 ranks) resumes
under each of the others: the optimizer state as loaded equals the saved one
exactly, and training goes on from the saved iteration. The savers are the
session's shared runs (``trained_run``): their epoch-1 checkpoints.
"""
import pytest

from tests.checkpoint.test_sharded_checkpoint import (_assert_resumed_state,
                                                      _CaptureLoaded,
                                                      _named_saved_state)
from tests.e2e import load_ckpt, read_dcp_checkpoint
from tests.trained import (CONFIGS, NO_VAL, ONE, checkpoint_path, config_of,
                           plain_model, small_cfg)

SAVERS = (ONE, *CONFIGS)


def _resume(wrapper, ckpt, work_dir, name):
    """Resume ``ckpt`` under ``wrapper`` for one more epoch (no validation:
    the matrix is about state, and 12 resumes must stay cheap).

    Returns:
        (epoch as loaded, optimizer state as loaded, iteration at the end).
    """
    from mmpar.runner import Runner
    cfg = small_cfg(config_of(wrapper), work_dir, 2, name, 'full',
                    resume=True, load_from=ckpt, **NO_VAL)
    if wrapper == ONE:
        cfg.launcher = 'none'
    runner = Runner.from_cfg(cfg)
    hook = _CaptureLoaded()
    runner._hooks.insert(0, hook)
    runner.train()
    return hook.epoch, hook.state, runner.iter


def _resume_all_dist(fmt, saved, out):
    results = {}
    for saver, ckpt in saved.items():
        for wrapper in CONFIGS:
            if wrapper != saver:
                results[saver, wrapper] = _resume(
                    wrapper, ckpt, f'{out}/{saver}_to_{wrapper}',
                    f'{fmt}_{saver}_{wrapper}')
    return results


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_every_wrapper_resumes_every_other(run_dist, trained_run, tmp_path,
                                           fmt):
    paths = {saver: str(checkpoint_path(trained_run(saver, fmt), 1, fmt))
             for saver in SAVERS}
    saved = {}
    for saver, path in paths.items():
        ckpt = load_ckpt(path) if fmt == 'full' else read_dcp_checkpoint(
            path)
        saved[saver] = (_named_saved_state(ckpt, plain_model()),
                        ckpt['meta']['iter'])

    results = dict(run_dist(_resume_all_dist, fmt, paths,
                            str(tmp_path / 'resumed'))[0])
    for saver in CONFIGS:  # 2-rank checkpoints on one process
        results[saver, ONE] = _resume(ONE, paths[saver],
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
