"""EMAHook under mmpar's Runner, inside the shared gloo pools.

At 4 ranks: HSDP (full checkpoint), FSDP2 x tp=2 and FSDP2 x pp=2 (sharded
checkpoints) train ``tests/data/ema_digits.py`` for 6 iterations (momentum
0.2, so each step shows) and their ``ema_state_dict`` equals one process on
the same global batch; on every rank the averaged copy holds as many
elements as the rank's own part of the model and shares no memory with it.
A sharded checkpoint resumes under FSDP1 and on one process with the
average going on, and a test run under FSDP1 evaluates the averaged
weights. A downstream hook and averaging class (an mmpretrain-like
``EMAHook`` subclass and an mmdet-like ``ExpMomentumEMA``, registered in
their own scope; parameters only, ``begin_iter=2``, ``interval=2``) train
under FSDP2 as on one process. Start-up checks name
the key. The end-to-end runs through ``tools/dist_train.sh`` are in
``tests/tools/test_ema_end_to_end.py``.
"""
import itertools
import math
import shutil

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import EMAHook
from mmengine.model import ExponentialMovingAverage
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import Registry

from mmpar.checkpoint import sharded_to_full
from mmpar.checkpoint.refs import (REFS_KEY, StoredTensor, pack_refs,
                                   stand_ins, unpack_refs)
from mmpar.config_check import check_hooks
from mmpar.failures import ConfigError
from tests.e2e import ROOT, VIT_FSDP1, VIT_FSDP2, load_ckpt
from tests.toy import assert_states_close

CONFIG = 'tests/data/ema_digits.py'
MODEL = dict(embed_dim=32, depth=4, num_heads=2)
FSDP2, FSDP1 = VIT_FSDP2, VIT_FSDP1
PP = dict(pp=2, pipeline=dict(split_points=['blocks.2'], schedule='1F1B',
                              num_microbatches=4))
# (parallel, wrapper, checkpoint_format, per-rank batch of the global 64)
LAYOUTS = {
    'hsdp': (dict(dp_replicate=2, dp_shard=2), FSDP2, 'full', 16),
    'fsdp2_tp2': (dict(tp=2, tp_plan='digits_vit'), FSDP2, 'sharded', 32),
    'fsdp2_pp2': (PP, FSDP2, 'sharded', 32),
}
CHECKPOINT = dict(full='iter_6.pth', sharded='iter_6')

# A downstream library's classes, in their own scope (as mmpretrain's
# EMAHook and mmdet's ExpMomentumEMA are, with MMEngine's registries as
# parents).
DOWNSTREAM_HOOKS = Registry('hook', parent=MMENGINE_HOOKS, scope='emadown')
DOWNSTREAM_MODELS = Registry('model', parent=MMENGINE_MODELS,
                             scope='emadown')


@DOWNSTREAM_HOOKS.register_module(name='EMAHook')
class DownstreamEMAHook(EMAHook):
    """mmpretrain 1.2's EMAHook, in short: evaluates on the averaged
    weights (its own swap), loads them from any checkpoint that has them."""

    def __init__(self, evaluate_on_ema: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.evaluate_on_ema = evaluate_on_ema

    def before_val_epoch(self, runner) -> None:
        if self.evaluate_on_ema:
            self._swap()

    def after_val_epoch(self, runner, metrics=None) -> None:
        if self.evaluate_on_ema:
            self._swap()

    def _swap(self) -> None:
        ema = itertools.chain(self.ema_model.module.parameters(),
                              self.ema_model.module.buffers())
        src = itertools.chain(self.src_model.parameters(),
                              self.src_model.buffers())
        for p_ema, p_src in zip(ema, src):
            held = p_ema.data.clone()
            p_ema.data.copy_(p_src.data)
            p_src.data.copy_(held)


@DOWNSTREAM_MODELS.register_module()
class ExpMomentumEMA(ExponentialMovingAverage):
    """mmdet 3's: momentum decays from 1 towards ``momentum``."""

    def __init__(self, model, momentum=0.0002, gamma=2000, interval=1,
                 device=None, update_buffers=False):
        super().__init__(model, momentum, interval, device, update_buffers)
        self.gamma = gamma

    def avg_func(self, averaged_param, source_param, steps) -> None:
        momentum = (1 - self.momentum) * math.exp(
            -float(1 + steps) / self.gamma) + self.momentum
        averaged_param.lerp_(source_param, momentum)


# Also MMEngine's other paths: parameters only, a start after iteration 2
# (the copy follows the weights until then), every second iteration.
DOWNSTREAM_HOOK = dict(type='emadown.EMAHook',
                       ema_type='emadown.ExpMomentumEMA', momentum=0.1,
                       gamma=4, update_buffers=False, begin_iter=2,
                       interval=2)


def _cfg(work_dir, name, parallel=None, wrapper=None, fmt='full',
         batch_size=64, launcher='pytorch', **extra):
    cfg = Config.fromfile(str(ROOT / CONFIG))
    cfg.train_cfg.update(max_iters=6, val_interval=3)
    cfg.param_scheduler[0].end = 6
    cfg.default_hooks.checkpoint.interval = 3
    cfg.custom_hooks[0].momentum = 0.2
    cfg.train_dataloader.batch_size = batch_size
    cfg.update(work_dir=str(work_dir), experiment_name=name,
               launcher=launcher, checkpoint_format=fmt, **extra)
    if parallel is not None:
        cfg.parallel = parallel
    if wrapper is not None:
        cfg.model_wrapper_cfg = wrapper
    return cfg


def _train(*args, **kwargs) -> dict:
    """Train; returns the last validation accuracy, the hook's and the
    averaging classes, and what this rank holds: elements of the averaged
    copy, of the rank's part of the model, of the whole model, and whether
    the copy shares memory with the model."""
    from mmpar.runner import Runner
    from mmpar.wrappers.local_state import local_module, named_tensors
    runner = Runner.from_cfg(_cfg(*args, **kwargs))
    runner.train()
    hook = next(h for h in runner.hooks if isinstance(h, EMAHook))
    averaged = hook.ema_model.module.state_dict()
    local = local_module(runner.model)
    storages = {t.untyped_storage().data_ptr()
                for t in named_tensors(local).values() if t.numel()}
    from mmpar.models import DigitsViT
    return dict(
        accuracy=runner.message_hub.get_scalar('val/accuracy/top1').current(),
        classes=(type(hook).__name__, type(hook.ema_model).__name__),
        averaged=sum(t.numel() for t in averaged.values()),
        local=sum(t.numel() for t in local.state_dict().values()),
        whole=sum(t.numel() for t in DigitsViT(**MODEL).state_dict()
                  .values()),
        shared=any(t.untyped_storage().data_ptr() in storages
                   for t in averaged.values() if t.numel()))


def _checkpoint(path) -> dict:
    return sharded_to_full(str(path)) if path.is_dir() else load_ckpt(path)


def _assert_same_average(actual: dict, expected: dict) -> None:
    for key in ('state_dict', 'ema_state_dict'):
        assert_states_close(actual[key], expected[key])


def _assert_holds_own_part(ranks: list, sharded: bool = True) -> None:
    for rank in ranks:
        assert rank['averaged'] == rank['local'], rank
        assert not rank['shared'], rank
        if sharded:
            assert rank['local'] < rank['whole'], rank


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """One process, 6 iterations of the global batch (this process): its
    work dir and last validation accuracy."""
    work = tmp_path_factory.mktemp('ema_one')
    return work, _train(work, 'ema_one', launcher='none')['accuracy']


@pytest.fixture(scope='module')
def runs_at_4() -> dict:
    return {}


@pytest.fixture
def trained_at_4(run_dist, runs_at_4, tmp_path_factory):
    """``trained_at_4(layout)``: that 4-rank run (once per module)."""

    def train(layout):
        if layout not in runs_at_4:
            parallel, wrapper, fmt, batch = LAYOUTS[layout]
            work = tmp_path_factory.mktemp(f'ema_{layout}')
            ranks = run_dist(_train, work, f'ema_{layout}', parallel,
                             wrapper, fmt, batch, world_size=4)
            runs_at_4[layout] = work, fmt, ranks
        return runs_at_4[layout]

    return train


@pytest.mark.parametrize('layout', list(LAYOUTS))
def test_ema_at_4_ranks_equals_one_process(reference, trained_at_4, layout):
    work, fmt, ranks = trained_at_4(layout)
    _assert_holds_own_part(ranks)
    _assert_same_average(_checkpoint(work / CHECKPOINT[fmt]),
                         load_ckpt(reference[0] / 'iter_6.pth'))
    assert {r['accuracy'] for r in ranks} == {reference[1]}


@pytest.mark.parametrize('source', ['hsdp', 'fsdp2_pp2'])
def test_checkpoint_resumes_the_average_elsewhere(
        reference, trained_at_4, run_dist, tmp_path, source):
    """HSDP's full and FSDP2 x pp=2's sharded iteration-3 checkpoints,
    resumed under FSDP1 (2 ranks) and on one process."""
    work, fmt, _ = trained_at_4(source)
    saved = 'iter_3.pth' if fmt == 'full' else 'iter_3'
    expected = load_ckpt(reference[0] / 'iter_6.pth')
    for where in ('fsdp1', 'one'):
        resumed = tmp_path / where
        resumed.mkdir()
        (shutil.copytree if fmt == 'sharded' else shutil.copy)(
            work / saved, resumed / saved)
        resume = dict(resume=True, load_from=str(resumed / saved))
        if where == 'one':
            _train(resumed, f'ema_{source}_one', launcher='none', **resume)
        else:
            _assert_holds_own_part(run_dist(
                _train, resumed, f'ema_{source}_fsdp1', None, FSDP1, 'full',
                32, **resume))
        _assert_same_average(load_ckpt(resumed / 'iter_6.pth'), expected)


def _test(checkpoint, work_dir, name, wrapper) -> float:
    """``runner.test()`` of ``checkpoint`` (EMAHook in the config)."""
    from mmpar.runner import Runner
    cfg = _cfg(work_dir, name, wrapper=wrapper, load_from=str(checkpoint))
    return Runner.from_cfg(cfg).test()['accuracy/top1']


def test_fsdp1_test_run_evaluates_the_averaged_weights(
        reference, run_dist, tmp_path):
    """The last validation of the one-process run, on its checkpoint under
    FSDP1: the averaged copy is loaded through the model (a collective) and
    swapped in for the test."""
    work, accuracy = reference
    assert run_dist(_test, work / 'iter_6.pth', tmp_path, 'ema_test_fsdp1',
                    FSDP1) == [accuracy] * 2


def test_downstream_hook_and_averaging_class_under_fsdp2(
        run_dist, tmp_path):
    extra = dict(custom_hooks=[DOWNSTREAM_HOOK],
                 custom_imports=dict(imports=['tests.runner.test_ema'],
                                     allow_failed_imports=False))
    one = _train(tmp_path / 'one', 'ema_down_one', launcher='none', **extra)
    ranks = run_dist(_train, tmp_path / 'fsdp2', 'ema_down_fsdp2', None,
                     FSDP2, 'full', 32, **extra)
    _assert_holds_own_part(ranks)
    assert {r['classes'] for r in ranks + [one]} == {
        ('DownstreamEMAHook', 'ExpMomentumEMA')}
    _assert_same_average(load_ckpt(tmp_path / 'fsdp2' / 'iter_6.pth'),
                         load_ckpt(tmp_path / 'one' / 'iter_6.pth'))


# -- start-up checks and the stand-ins, in this process ------------------------
@pytest.mark.parametrize('hooks,named', [
    ([dict(type='EMAHook', ema_type='DigitsViT')],
     ["custom_hooks[0].ema_type='DigitsViT'", 'BaseAveragedModel',
      'allowed: ExponentialMovingAverage']),
    ([dict(type='EMAHook', ema_type='NoSuchAverage')],
     ["custom_hooks[0].ema_type='NoSuchAverage'", 'not registered',
      'MomentumAnnealingEMA']),
    ([dict(type='EMAHook'), dict(type='EMAHook')],
     ["custom_hooks[1]='EMAHook'", 'allowed: one EMAHook']),
])
def test_bad_ema_hook_fails_at_start_naming_key(hooks, named):
    with pytest.raises(ConfigError) as err:
        check_hooks(dict(custom_hooks=hooks), 'mmpar')
    for text in named:
        assert text in str(err.value), str(err.value)


def test_stand_ins_round_trip_as_plain_data():
    keys = ['a.weight', 'b']
    plain = dict(state_dict=stand_ins('ema', keys),
                 ema_state_dict=dict(steps=torch.tensor(3),
                                     **stand_ins('model', keys, 'module.')))
    pack_refs(plain)
    assert plain[REFS_KEY] == dict(
        state_dict=dict(part='ema', prefix=''),
        ema_state_dict=dict(part='model', prefix='module.'))
    assert 'state_dict' not in plain and list(plain['ema_state_dict']) == [
        'steps']
    unpack_refs(plain, '/ckpt', keys)
    assert plain['state_dict'] == {
        k: StoredTensor('/ckpt', 'ema', k) for k in keys}
    assert list(plain['ema_state_dict']) == ['steps', 'module.a.weight',
                                             'module.b']
