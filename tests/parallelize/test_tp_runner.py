"""Tensor parallelism under mmpar's Runner (inside the shared gloo pools):
full and sharded checkpoints of a tp=2 run resume on another layout (tp=1 x
dp=2, and one process), FSDP2 x TP trains at 4 ranks, and start-up checks
name the key and value."""
import shutil

import pytest
from mmengine.config import Config

from mmpar.config_check import check_config
from mmpar.failures import ConfigError
from mmpar.models import DigitsViT
from tests.e2e import ROOT, load_ckpt
from tests.trained import SMALL_MODEL
from tests.trained import train as _train

CONFIG = 'configs/vit_digits/vit_digits.py'
FSDP2_CONFIG = 'configs/vit_digits/vit_digits_fsdp2.py'
TP2 = dict(tp=2, tp_plan='digits_vit')
CHECKPOINT = dict(full='epoch_1.pth', sharded='epoch_1')


def _wrapper_name(config, work_dir, max_epochs, name, fmt, **extra):
    runner = _train(config, work_dir, max_epochs, name, fmt, **extra)
    # _has_loaded: the checkpoint was loaded (resume), not silently skipped.
    return type(runner.model).__name__, runner.iter, runner._has_loaded


def _assert_plain_checkpoint(path):
    state = load_ckpt(path)['state_dict']
    DigitsViT(**SMALL_MODEL).load_state_dict(state, strict=True)


@pytest.mark.parametrize('fmt', ['full', 'sharded'])
def test_tp2_checkpoint_resumes_on_other_layouts(run_dist, tmp_path, fmt):
    first = tmp_path / 'tp2'
    names = run_dist(_wrapper_name, CONFIG, str(first), 1, f'tp2_{fmt}', fmt,
                     parallel=TP2)
    assert [n for n, _, _ in names] == ['MMTensorParallelDDP'] * 2
    saved = first / CHECKPOINT[fmt]
    for layout, runner_world in (('dp2', 2), ('one', 1)):
        work = tmp_path / layout
        work.mkdir()
        copy = work / CHECKPOINT[fmt]
        (shutil.copytree if fmt == 'sharded' else shutil.copy)(saved, copy)
        resume = dict(resume=True, load_from=str(copy))
        if runner_world == 2:  # tp=1 x dp=2, the default DDP
            results = run_dist(_wrapper_name, CONFIG, str(work), 2,
                               f'{layout}_{fmt}', 'full', **resume)
            assert [n for n, _, _ in results] == ['MMDistributedDataParallel'] * 2
        else:  # this process, unsplit
            runner = _train(CONFIG, work, 2, f'{layout}_{fmt}', 'full',
                            launcher='none', **resume)
            results = [(type(runner.model).__name__, runner.iter,
                        runner._has_loaded)]
        # Resumed after epoch 1 and trained epoch 2.
        assert all(loaded and it > names[0][1]
                   for _, it, loaded in results), (results, names)
        _assert_plain_checkpoint(work / 'epoch_2.pth')


def test_fsdp2_x_tp2_at_4_ranks_saves_a_plain_checkpoint(run_dist, tmp_path):
    names = run_dist(_wrapper_name, FSDP2_CONFIG, str(tmp_path), 1,
                     'fsdp2_tp2', 'full', parallel=TP2, world_size=4)
    assert [n for n, _, _ in names] == ['MMFullyShard'] * 4
    _assert_plain_checkpoint(tmp_path / 'epoch_1.pth')


# -- start-up checks, before any process group ---------------------------------
def _cfg(**extra):
    cfg = Config.fromfile(str(ROOT / CONFIG))
    cfg.launcher = 'pytorch'
    cfg.update(extra)
    return cfg


@pytest.mark.parametrize('parallel,wrapper,named', [
    (dict(tp=2, tp_plan='nope'), None,
     ["parallel.tp_plan='nope'", 'registered: digits_vit, hf, llama, ',
      'module_plan']),
    (dict(tp=2, tp_plan=dict(type='module_plan', plan={'x': 'diag'})), None,
     ["parallel.tp_plan.plan['x'] style='diag'", 'allowed: colwise']),
    (dict(tp=3, tp_plan='digits_vit'), None,
     ['world size 4', 'tp=3']),
    (dict(tp=2, tp_plan='digits_vit'),
     dict(type='MMFullyShardedDataParallel'),
     ["model_wrapper_cfg.type='MMFullyShardedDataParallel'",
      "type='MMFullyShard'"]),
    (dict(tp=2, tp_plan='digits_vit', use_fsdp=True), None,
     ["'MMFullyShardedDataParallel'", "type='MMFullyShard'"]),
])
def test_bad_tp_config_fails_at_start_naming_key(monkeypatch, parallel,
                                                 wrapper, named):
    monkeypatch.setenv('WORLD_SIZE', '4')
    monkeypatch.setenv('RANK', '0')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setenv('MASTER_ADDR', '127.0.0.1')
    monkeypatch.setenv('MASTER_PORT', '29999')
    extra = dict(parallel=parallel)
    if wrapper is not None:
        extra['model_wrapper_cfg'] = wrapper
    with pytest.raises(ConfigError) as err:
        check_config(_cfg(**extra))
    for text in named:
        assert text in str(err.value), str(err.value)


def _refused_split(config, work_dir):
    from mmpar.runner import Runner
    cfg = Config.fromfile(str(ROOT / config))
    cfg.work_dir = work_dir
    cfg.experiment_name = 'refused_split'
    cfg.model.update(embed_dim=12, num_heads=2, mlp_ratio=1.5)  # 18 wide
    cfg.launcher = 'pytorch'
    cfg.parallel = dict(tp=4, tp_plan='digits_vit')
    with pytest.raises(ValueError) as err:
        Runner.from_cfg(cfg)
    return str(err.value)


def test_tp_not_dividing_a_split_dim_fails_before_training(run_dist,
                                                           tmp_path):
    messages = run_dist(_refused_split, CONFIG, str(tmp_path), world_size=4)
    assert all("tp=4 does not divide 'blocks.0.mlp.0'" in m and
               'size 18' in m for m in messages), messages
