"""Every config under configs/ trains and validates on 2 gloo ranks.

Each config runs through mmpar's Runner inside the shared worker pool (no
process start-up per config), cut to a few iterations.
"""
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
# The language-model configs report a validation loss, not an accuracy:
# tests/configs/test_llama_configs.py trains each of them; the fine-tuning
# configs start from an exported Hugging Face directory, which
# tests/tools/test_hf_finetune.py makes first and trains them from.
OWN_TESTS = ('_base_', 'llama_shakespeare', 'hf_finetune')
CONFIGS = sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / 'configs').rglob('*.py')
    if not set(OWN_TESTS) & set(p.parts))


def _train_briefly(config: str, work_dir: str):
    from mmengine.config import Config

    from mmpar.runner import Runner
    cfg = Config.fromfile(str(ROOT / config))
    cfg.launcher = 'pytorch'  # the pool's process group is already up
    cfg.work_dir = work_dir
    cfg.experiment_name = f'{Path(config).stem}_{Path(work_dir).name}'
    if cfg.train_cfg.get('by_epoch', True):
        cfg.train_cfg.max_epochs = 1
        # One epoch in a few steps: the same 1,437 images in batches of 256
        # per data rank (6 steps where tp or pp leave one data rank, 45 at
        # the configs' 32; a partial last batch either way).
        cfg.train_dataloader.batch_size = 256
        cfg.default_hooks.logger.interval = 5
    else:
        cfg.train_cfg.max_iters = 10
        cfg.train_cfg.val_interval = 10
        cfg.default_hooks.checkpoint.interval = 10
    runner = Runner.from_cfg(cfg)
    runner.train()
    metrics = runner.message_hub.get_scalar('val/accuracy/top1').current()
    return dict(
        world_size=dist.get_world_size(),
        wrapper=type(runner.model).__name__,
        accuracy=metrics)


@pytest.mark.parametrize('config', CONFIGS)
def test_config_trains_on_two_ranks(run_dist, config, tmp_path):
    results = run_dist(_train_briefly, config, str(tmp_path))
    from mmengine.config import Config
    cfg = Config.fromfile(str(ROOT / config))
    named = (cfg.get('model_wrapper_cfg')
             or {}).get('type', 'MMDistributedDataParallel')
    if (cfg.get('parallel') or {}).get('tp', 1) > 1:
        # DDP replicates a tensor-parallel model as MMTensorParallelDDP.
        from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
        named = data_parallel_cfg_for_tp(dict(type=named), 2)['type']
    if (cfg.get('parallel') or {}).get('pp', 1) > 1:
        # The stages' wrapper runs the pipeline schedule.
        named = 'MMPipelineParallel'
    assert [r['world_size'] for r in results] == [2, 2]
    assert [r['wrapper'] for r in results] == [named, named]
    # Every rank evaluated the same model on the same split.
    assert results[0]['accuracy'] == results[1]['accuracy']
    assert 0 <= results[0]['accuracy'] <= 100
    checkpoints = list(tmp_path.glob('epoch_1.pth')) + list(
        tmp_path.glob('iter_10.pth'))
    assert checkpoints, sorted(p.name for p in tmp_path.iterdir())
