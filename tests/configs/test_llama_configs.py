"""Every config under configs/llama_shakespeare/ trains and validates on gloo
ranks, shrunk; resume is bit-exact for the one-process, FSDP2 and FSDP2 Muon
configs (resumed from the straight run's own iteration-2 checkpoint); tokens/s and
FLOP/s reach the log and the scalars file."""
import json
import math
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.dist_harness import pool_runner
from tests.e2e import (assert_same_training_state, load_ckpt,
                       read_dcp_checkpoint)

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / 'configs' / 'llama_shakespeare'
CONFIGS = sorted(str(p.relative_to(ROOT)) for p in CONFIG_DIR.glob('*.py'))
# HSDP needs 2 shard groups of 2 ranks to replicate anything; 2-D layouts
# need 2 ranks on each axis (pp x tp at 4 leaves the data axis 1: the 3-D
# layout at 8 is proven by tests/parallelize/test_pipeline_tp_parity.py).
WORLD_SIZES = {'llama_shakespeare_hsdp': 4, 'llama_shakespeare_tp_fsdp2': 4,
               'llama_shakespeare_pp_fsdp2': 4, 'llama_shakespeare_pp_tp': 4,
               'llama_shakespeare_cp': 4}
# What --cfg-options would pass: a 2-block model, 32-byte windows, 8 val
# windows, a checkpoint at the end.
SHRINK = {
    'model.dim': 32,
    'model.num_layers': 2,
    'model.num_heads': 2,
    'train_dataloader.batch_size': 4,
    'train_dataloader.dataset.context_length': 32,
    'val_dataloader.batch_size': 4,
    'val_dataloader.dataset.context_length': 32,
    'val_dataloader.dataset.num_windows': 8,
    'default_hooks.logger.interval': 1,
}
HF_SHRINK = {
    **{k: v for k, v in SHRINK.items() if not k.startswith('model.')},
    'model.config.hidden_size': 32,
    'model.config.intermediate_size': 64,
    'model.config.num_hidden_layers': 2,
    'model.config.num_attention_heads': 2,
    'model.config.num_key_value_heads': 2,
}


def shrink_options(config: str) -> dict:
    """The --cfg-options that shrink ``config`` for a test."""
    return HF_SHRINK if Path(config).stem.endswith(
        ('_hf', '_hf_fsdp2')) else SHRINK


def _shrunk_cfg(config, work_dir, name, max_iters, **extra):
    from mmengine.config import Config
    cfg = Config.fromfile(str(ROOT / config))
    cfg.merge_from_dict(shrink_options(config))
    cfg.merge_from_dict({
        'train_cfg.max_iters': max_iters,
        'train_cfg.val_interval': max_iters,
        'default_hooks.checkpoint.interval': 2,
        'default_hooks.checkpoint.max_keep_ckpts': 10,
    })
    cfg.launcher = 'pytorch' if dist.is_initialized() else 'none'
    cfg.work_dir = str(work_dir)
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    cfg.update(extra)
    return cfg


def _train(config, work_dir, name, max_iters=4, **extra):
    from mmpar.runner import Runner
    runner = Runner.from_cfg(
        _shrunk_cfg(config, work_dir, name, max_iters, **extra))
    runner.train()
    hub = runner.message_hub
    return dict(
        world_size=dist.get_world_size() if dist.is_initialized() else 1,
        wrapper=type(runner.model).__name__,
        val_loss=hub.get_scalar('val/lm/cross_entropy').current(),
        bits_per_byte=hub.get_scalar('val/lm/bits_per_byte').current(),
        tokens_per_s=hub.get_scalar('train/tokens_per_s').current(),
        tokens_per_s_total=hub.get_scalar(
            'train/tokens_per_s_total').current(),
        flops_per_s=hub.get_scalar('train/flops_per_s').current())


# The configs test_fsdp2_sharded_resume_is_bit_exact resumes from their
# shared run's iteration 2 to its iteration 4.
RESUMED = ('configs/llama_shakespeare/llama_shakespeare_fsdp2.py',
           'configs/llama_shakespeare/llama_shakespeare_muon.py')


def shared_iters(config: str) -> int:
    """Iterations of ``config``'s shared run: 4 where a resume starts from
    its iteration 2, else 2 (training, validation, speed and the final
    checkpoint show after 2 as after 4; the 4-rank layouts took ~0.3 s an
    iteration more)."""
    return 4 if config in RESUMED else 2


@pytest.fixture(scope='module')
def llama_run(_pools, tmp_path_factory):
    """``llama_run(config)``: ``(per-rank results, work dir)`` of the config
    trained :func:`shared_iters` iterations (a checkpoint every 2) on its
    world size; trained on first use. Read-only: resume into your own
    dir."""
    done = {}

    def get(config):
        if config not in done:
            stem = Path(config).stem
            work_dir = tmp_path_factory.mktemp(stem)
            results = pool_runner(_pools)(
                _train, config, work_dir, f'{stem}_shared',
                max_iters=shared_iters(config),
                world_size=WORLD_SIZES.get(stem, 2))
            done[config] = results, work_dir
        return done[config]

    return get


@pytest.mark.parametrize('config', CONFIGS)
def test_llama_config_trains(llama_run, config):
    from mmengine.config import Config
    stem = Path(config).stem
    world_size = WORLD_SIZES.get(stem, 2)
    results, tmp_path = llama_run(config)
    cfg = Config.fromfile(str(ROOT / config))
    named = (cfg.get('model_wrapper_cfg') or {}).get(
        'type', 'MMDistributedDataParallel')
    tp = (cfg.get('parallel') or {}).get('tp', 1)
    if tp > 1:  # DDP replicates a TP model as MMTensorParallelDDP
        from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
        named = data_parallel_cfg_for_tp(dict(type=named), tp)['type']
    pp = (cfg.get('parallel') or {}).get('pp', 1)
    cp = (cfg.get('parallel') or {}).get('cp', 1)
    if pp > 1:  # the stages' wrappers sit inside the pipeline's
        named = 'MMPipelineParallel'
    assert [r['world_size'] for r in results] == [world_size] * world_size
    assert {r['wrapper'] for r in results} == {named}
    # Every rank evaluated the same model on the same windows.
    assert len({r['val_loss'] for r in results}) == 1
    loss = results[0]['val_loss']
    assert 0 < loss < 1.5 * math.log(256)
    assert results[0]['bits_per_byte'] == pytest.approx(loss / math.log(2))
    for r in results:
        # Tensor-, pipeline- and context-parallel peers read the same
        # tokens: data ranks only.
        assert r['tokens_per_s_total'] == pytest.approx(
            r['tokens_per_s'] * (world_size // tp // pp // cp))
        assert r['flops_per_s'] > 0
    sharded = cfg.get('checkpoint_format', 'full') == 'sharded'
    last = f'iter_{shared_iters(config)}'
    saved = tmp_path / (last if sharded else f'{last}.pth')
    assert saved.exists(), sorted(p.name for p in tmp_path.iterdir())


def test_one_process_resume_is_bit_exact_and_logs_speed(tmp_path):
    config = 'configs/llama_shakespeare/llama_shakespeare.py'
    straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
    _train(config, straight, 'llama_straight', max_iters=4)
    _train(config, resumed, 'llama_resumed', max_iters=4, resume=True,
           load_from=str(straight / 'iter_2.pth'))
    assert not (resumed / 'iter_2.pth').exists()  # resumed, not retrained
    a, b = load_ckpt(resumed / 'iter_4.pth'), load_ckpt(straight / 'iter_4.pth')
    assert_same_training_state(a, b)
    assert a['meta']['iter'] == 4
    # Speed in the text log and in the scalars file analyze_logs reads.
    log = next(straight.rglob('*.log')).read_text()
    assert 'tokens_per_s: ' in log and 'flops_per_s: ' in log
    scalars = [json.loads(line) for line in
               next(straight.rglob('scalars.json')).read_text().splitlines()]
    train = [s for s in scalars if 'tokens_per_s' in s]
    assert len(train) == 4 and all(s['tokens_per_s'] > 0 for s in train)
    assert 'mfu' not in train[0]  # no known peak on CPU


def _train_dist(config, work_dir, name, max_iters, **extra):
    _train(config, work_dir, name, max_iters, **extra)


# Muon's: both rules' state (momentum, AdamW moments) through DCP.
@pytest.mark.parametrize('config', RESUMED)
def test_fsdp2_sharded_resume_is_bit_exact(run_dist, llama_run, tmp_path,
                                           config):
    _, straight = llama_run(config)  # test_llama_config_trains' run
    resumed = tmp_path / 'resumed'
    run_dist(_train_dist, config, resumed, f'{Path(config).stem}_resumed', 4,
             resume=True, load_from=str(straight / 'iter_2'))
    assert not (resumed / 'iter_2').exists()  # resumed, not retrained
    a = read_dcp_checkpoint(resumed / 'iter_4')
    b = read_dcp_checkpoint(straight / 'iter_4')
    assert_same_training_state(a, b)
    assert a['meta']['iter'] == 4
