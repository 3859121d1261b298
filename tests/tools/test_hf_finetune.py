"""The Hugging Face path through the user's entry points.

The Llama of the shipped config trains a few steps (shrunk), and
``tools/convert_checkpoint.py --to hf`` exports it; the fine-tuning config
starts from that directory under FSDP2 (``tools/dist_train.sh``) and under
tp=2: the first step's loss is the exported model's loss on the same batch.
The FSDP2 run's sharded checkpoint exports too, and ``from_pretrained``
gives the logits mmpar computes from it.
"""
import json
import math

import pytest
import torch

from mmpar.convert import main as convert_main
from mmpar.datasets import SFTDataset, ShakespeareDataset
from mmpar.generation import load_model
from tests.checkpoint.test_hf_layouts import hf_logits
from tests.configs.test_llama_configs import SHRINK, _train
from tests.e2e import run_tool

CONFIG = 'configs/llama_shakespeare/llama_shakespeare.py'
FINETUNE = 'configs/hf_finetune/llama_shakespeare_hf_finetune.py'
FINETUNE_TP = 'configs/hf_finetune/llama_shakespeare_hf_finetune_tp.py'
SFT = 'configs/hf_finetune/llama_shakespeare_hf_sft.py'
MODEL_OPTS = {k: v for k, v in SHRINK.items() if k.startswith('model.')}
BATCH, CONTEXT = 4, 32
# In order (no shuffle, no random starts): rank r of d data ranks reads
# windows r, r + d, ... of the train split.
DATA_OPTS = {
    'train_dataloader.batch_size': BATCH,
    'train_dataloader.sampler.shuffle': False,
    'train_dataloader.dataset.random_starts': False,
    'train_dataloader.dataset.context_length': CONTEXT,
    'val_dataloader.batch_size': BATCH,
    'val_dataloader.dataset.context_length': CONTEXT,
    'val_dataloader.dataset.num_windows': 8,
    'train_cfg.max_iters': 1,
    'train_cfg.val_interval': 1,
    'default_hooks.logger.interval': 1,
    'default_hooks.checkpoint.interval': 1,
}


def _options(opts: dict) -> list:
    return [f'{k}={v}' for k, v in opts.items()]


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """(checkpoint, HF directory) of the shipped config's Llama, 2 steps."""
    work_dir = tmp_path_factory.mktemp('hf_export')
    _train(CONFIG, work_dir, 'hf_export', max_iters=2)
    out = work_dir / 'hf'
    run_tool(['python', 'tools/convert_checkpoint.py',
              work_dir / 'iter_2.pth', '--to', 'hf', '--config', CONFIG,
              '--out', out, '--cfg-options', *_options(MODEL_OPTS)])
    return str(work_dir / 'iter_2.pth'), str(out)


def _first_batch_loss(hf_dir: str, data_rank: int, data_size: int) -> float:
    dataset = ShakespeareDataset('train', context_length=CONTEXT)
    items = [dataset[data_rank + i * data_size] for i in range(BATCH)]
    inputs = torch.stack([item['inputs'] for item in items])
    targets = torch.stack([item['data_samples'] for item in items])
    logits = hf_logits(hf_dir, inputs)
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten()).item()


def test_exported_llama_gives_mmpars_logits(exported):
    checkpoint, hf_dir = exported
    model = load_model(CONFIG, checkpoint, MODEL_OPTS)
    inputs = ShakespeareDataset('val', context_length=CONTEXT)[0]['inputs']
    with torch.no_grad():
        expected = model(inputs[None])
    assert (hf_logits(hf_dir, inputs[None]) - expected).abs().max() <= 1e-5


def test_fsdp2_finetune_starts_at_the_exported_loss(exported, tmp_path):
    _, hf_dir = exported
    run_tool(['bash', 'tools/dist_train.sh', FINETUNE, '2', '--work-dir',
              tmp_path, '--cfg-options', f'model.pretrained={hf_dir}',
              *_options(DATA_OPTS)])
    scalars = next(tmp_path.rglob('scalars.json')).read_text().splitlines()
    first = [json.loads(s) for s in scalars if '"loss"' in s][0]
    assert first['step'] == 1
    # The logged loss is over the step's every token: rank 0's data windows
    # 0, 2, 4, 6 and rank 1's 1, 3, 5, 7 (as many tokens each).
    assert first['loss'] == pytest.approx(
        (_first_batch_loss(hf_dir, 0, 2) + _first_batch_loss(hf_dir, 1, 2))
        / 2, abs=1e-5)
    # The sharded checkpoint of the fine-tuned run exports as well.
    out = convert_main([str(tmp_path / 'iter_1'), '--to', 'hf', '--config',
                        FINETUNE, '--out', str(tmp_path / 'hf_again'),
                        '--cfg-options', f'model.pretrained={hf_dir}'])
    model = load_model(FINETUNE, str(tmp_path / 'iter_1'),
                       {'model.pretrained': hf_dir})
    inputs = torch.arange(CONTEXT)[None]
    with torch.no_grad():
        diff = (hf_logits(out, inputs) - model(inputs)).abs().max()
    assert diff <= 1e-5
    assert not torch.allclose(hf_logits(out, inputs),
                              hf_logits(hf_dir, inputs))


def test_sft_finetune_starts_at_the_exported_models_answer_loss(
        exported, tmp_path):
    """The shipped HF SFT config through tools/dist_train.sh on 2 ranks:
    the first step's loss is the exported model's cross-entropy over the
    answer tokens of the 8 records the ranks read, divided by their count
    (no prompt or padding token counted)."""
    _, hf_dir = exported
    run_tool(['bash', 'tools/dist_train.sh', SFT, '2', '--work-dir',
              tmp_path, '--cfg-options', f'model.pretrained={hf_dir}',
              *_options({'train_dataloader.batch_size': BATCH,
                         'train_dataloader.sampler.shuffle': False,
                         'val_dataloader.batch_size': BATCH,
                         'val_dataloader.dataset.num_windows': 8,
                         'train_cfg.max_iters': 1,
                         'train_cfg.val_interval': 1,
                         'default_hooks.logger.interval': 1,
                         'default_hooks.checkpoint.interval': 1})])
    scalars = next(tmp_path.rglob('scalars.json')).read_text().splitlines()
    first = [json.loads(s) for s in scalars if '"loss"' in s][0]
    # Rank r reads records r, r + 2, ...: together records 0..7.
    dataset = SFTDataset('mmpar:shakespeare_sft_train.jsonl',
                         context_length=128, truncate='left')
    items = [dataset[i] for i in range(2 * BATCH)]
    inputs = torch.stack([torch.as_tensor(i['inputs']) for i in items])
    targets = torch.stack([torch.as_tensor(i['data_samples'])
                           for i in items])
    counted = int((targets != -100).sum())
    assert 0 < counted < targets.numel() // 2
    summed = torch.nn.functional.cross_entropy(
        hf_logits(hf_dir, inputs).flatten(0, 1), targets.flatten(),
        ignore_index=-100, reduction='sum').item()
    assert first['loss'] == pytest.approx(summed / counted, abs=1e-5)


def _finetune_tp(hf_dir: str, work_dir: str) -> float:
    from mmengine.config import Config

    from mmpar.runner import Runner
    from tests.configs.test_llama_configs import ROOT
    cfg = Config.fromfile(str(ROOT / FINETUNE_TP))
    cfg.merge_from_dict({**DATA_OPTS, 'model.pretrained': hf_dir})
    cfg.merge_from_dict({'launcher': 'pytorch', 'work_dir': work_dir,
                         'experiment_name': 'hf_finetune_tp'})
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner.message_hub.get_scalar('train/loss').data[0][0]


def test_tp2_finetune_starts_at_the_exported_loss(exported, run_dist,
                                                  tmp_path):
    _, hf_dir = exported
    losses = run_dist(_finetune_tp, hf_dir, str(tmp_path))
    # tp peers read the same batch: windows 0..3 on both ranks.
    expected = _first_batch_loss(hf_dir, 0, 1)
    assert losses == pytest.approx([expected] * 2, abs=1e-5)
    assert 0 < expected < math.log(256)
