"""Checkpoints of pipelined runs (``parallel.pp > 1``), full and sharded.

Every stage's model *and optimizer* state goes into one checkpoint under
the plain model's names: a pp=2 run resumes bit-exactly on the same layout,
and on other layouts (one process, DDP dp=2) with the optimizer state as
saved; pp x FSDP2 writes DTensor shards that resume elsewhere too. Runners
run inside the shared gloo pools; one straight pp=2 run per format (a module
fixture, read-only) serves every test that starts from a pp checkpoint.
"""
import pytest

from tests.checkpoint.test_sharded_checkpoint import (_assert_resumed_state,
                                                      _named_saved_state,
                                                      _resume_and_capture)
from tests.dist_harness import pool_runner
from tests.e2e import (assert_same_training_state, load_ckpt,
                       read_dcp_checkpoint)
from tests.trained import CONFIGS, NO_VAL
from tests.trained import plain_model as _plain_model
from tests.trained import small_cfg as _small_cfg
from tests.trained import train as _train

PP_CONFIG = 'configs/vit_digits/vit_digits_pp.py'
# The small model has 2 blocks: one per stage.
PIPELINE = dict(
    pp=2,
    pipeline=dict(split_points=['blocks.1'], schedule='1F1B',
                  num_microbatches=4))


def _pp_train(work_dir, max_epochs, name, fmt, parallel=PIPELINE, **extra):
    _train(PP_CONFIG, work_dir, max_epochs, name, fmt, parallel=parallel,
           **NO_VAL, **extra)


def _ckpt(work_dir, epoch, fmt):
    path = work_dir / f'epoch_{epoch}'
    if fmt == 'sharded':
        return path, read_dcp_checkpoint(path)
    return path.with_suffix('.pth'), load_ckpt(path.with_suffix('.pth'))


def _ckpt_exists(work_dir, epoch, fmt):
    path = work_dir / f'epoch_{epoch}'
    return (path if fmt == 'sharded' else path.with_suffix('.pth')).exists()


def _check_resumed(results, saved, epoch=1):
    saved_state = _named_saved_state(saved, _plain_model())
    for resumed_epoch, loaded in results:
        assert resumed_epoch == epoch
        _assert_resumed_state(loaded, saved_state)


@pytest.fixture(scope='module')
def pp_run(_pools, tmp_path_factory):
    """``pp_run(fmt)``: 2 epochs at pp=2 saving ``fmt`` checkpoints of both
    epochs, trained on first use. Read-only: resume into your own dir."""
    done = {}

    def get(fmt):
        if fmt not in done:
            work_dir = tmp_path_factory.mktemp(f'pp_{fmt}')
            pool_runner(_pools)(_pp_train, work_dir, 2, f'pp_{fmt}_2', fmt)
            done[fmt] = work_dir
        return done[fmt]

    return get


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_pp_resume_is_exact(run_dist, pp_run, tmp_path, fmt):
    straight, resumed = pp_run(fmt), tmp_path / 'resumed'
    path, _ = _ckpt(straight, 1, fmt)
    run_dist(_pp_train, resumed, 2, f'pp_{fmt}_resume', fmt, resume=True,
             load_from=str(path))
    assert not _ckpt_exists(resumed, 1, fmt)  # resumed, not trained again
    _, a = _ckpt(resumed, 2, fmt)
    _, b = _ckpt(straight, 2, fmt)
    # Every stage's weights and optimizer state, under the plain names.
    assert a['state_dict'].keys() == _plain_model().state_dict().keys()
    assert set(a['optimizer']['state']) == {
        n for n, _ in _plain_model().named_parameters()}
    assert_same_training_state(a, b)
    assert a['meta']['epoch'] == 2


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_pp_checkpoint_resumes_on_one_process_and_dp2(run_dist, pp_run,
                                                      tmp_path, fmt):
    path, saved = _ckpt(pp_run(fmt), 1, fmt)
    config = CONFIGS['MMDistributedDataParallel']
    one = _resume_and_capture(config, tmp_path / 'one', path, 2,
                              f'pp_{fmt}_to_one', fmt, **NO_VAL)
    _check_resumed([one], saved)
    dp2 = run_dist(_resume_and_capture, config, tmp_path / 'dp2', path, 2,
                   f'pp_{fmt}_to_dp2', fmt, **NO_VAL)
    _check_resumed(dp2, saved)
    # Training went on: 1,437 images / 256 = 6 steps on one process.
    _, after = _ckpt(tmp_path / 'one', 2, fmt)
    assert after['meta']['iter'] == saved['meta']['iter'] + 6


def test_pp_x_fsdp2_checkpoints_move_to_and_from_pp2(run_dist, pp_run,
                                                     tmp_path):
    """A full pp=2 checkpoint resumes at pp=2 x FSDP2 dp=2 (4 ranks: each
    stage takes its shard of every tensor), which writes DTensor shards
    per stage (sharded format) that resume at pp=2 without FSDP."""
    path, saved = _ckpt(pp_run('full'), 1, 'full')
    fsdp2 = dict(parallel=PIPELINE,
                 model_wrapper_cfg=dict(type='MMFullyShard'))
    results = run_dist(_resume_and_capture, PP_CONFIG, tmp_path / 'fsdp2',
                       path, 2, 'pp_to_fsdp2', 'sharded', **fsdp2, **NO_VAL,
                       world_size=4)
    _check_resumed(results, saved)
    path, saved = _ckpt(tmp_path / 'fsdp2', 2, 'sharded')
    results = run_dist(_resume_and_capture, PP_CONFIG, tmp_path / 'back',
                       path, 3, 'fsdp2_to_pp', 'sharded', parallel=PIPELINE,
                       **NO_VAL)
    _check_resumed(results, saved, epoch=2)


def test_pp_x_tp_sharded_checkpoint_resumes_on_one_process(run_dist,
                                                          tmp_path):
    """pp=2 x tp=2 (4 ranks): each stage writes its tensor-parallel shards;
    one process resumes with the optimizer state as saved."""
    pp_tp = dict(PIPELINE, tp=2, tp_plan='digits_vit')
    run_dist(_pp_train, tmp_path / 'pp_tp', 1, 'pp_tp_save', 'sharded',
             parallel=pp_tp, world_size=4)
    path, saved = _ckpt(tmp_path / 'pp_tp', 1, 'sharded')
    assert saved['state_dict'].keys() == _plain_model().state_dict().keys()
    one = _resume_and_capture(CONFIGS['MMDistributedDataParallel'],
                              tmp_path / 'one', path, 2, 'pp_tp_to_one',
                              'sharded', **NO_VAL)
    _check_resumed([one], saved)


def _resume_pp(work_dir, ckpt, name):
    from mmpar.failures import ConfigError
    from mmpar.runner import Runner
    load = dict(load_from=str(ckpt)) if ckpt else {}
    cfg = _small_cfg(PP_CONFIG, work_dir, 2, name, 'full', resume=True,
                     parallel=PIPELINE, **load, **NO_VAL)
    with pytest.raises(ConfigError) as err:
        Runner.from_cfg(cfg).train()
    return str(err.value)


@pytest.mark.parametrize('how', ['path', 'auto'])
def test_index_keyed_optimizer_state_is_refused_under_pp(run_dist,
                                                         tmp_path, how):
    # A one-process checkpoint keys the optimizer state by index: which
    # index is which stage's parameter cannot be known under pp. Refused,
    # not taken for a corrupt file: resume='auto' then went back through
    # the older checkpoints and said "training starts from scratch" with
    # the last one's weights already loaded.
    _train(CONFIGS['MMDistributedDataParallel'], tmp_path / 'one', 1,
           'one_for_pp', 'full', launcher='none', **NO_VAL)
    ckpt = tmp_path / 'one' / 'epoch_1.pth' if how == 'path' else None
    messages = run_dist(_resume_pp, tmp_path / ('pp' if ckpt else 'one'),
                        ckpt, 'one_to_pp')
    for message in messages:
        assert 'parallel.pp > 1' in message and 'keyed by index' in message
        assert "checkpoint_format='sharded'" in message
