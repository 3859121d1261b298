"""Tokenizers from config: bytes (default), the shipped Shakespeare BPE and
any Hugging Face tokenizer directory; bits per byte counts bytes of text,
not tokens."""
import filecmp
import math

import pytest
import torch

from mmpar.datasets import HFTokenizer, ShakespeareDataset, build_tokenizer
from mmpar.datasets.shakespeare import DATA_FILE, load_text, text_tokens
from mmpar.datasets.tokenizer import (SHAKESPEARE_BPE_DIR,
                                      train_shakespeare_bpe)
from mmpar.evaluation import LanguageModelMetric

BPE = dict(type='ShakespeareBPE')


def test_shipped_bpe_is_what_training_on_the_shipped_text_gives(tmp_path):
    train_shakespeare_bpe(load_text()).save_pretrained(str(tmp_path))
    for name in ('tokenizer.json', 'tokenizer_config.json'):
        assert filecmp.cmp(tmp_path / name, SHAKESPEARE_BPE_DIR / name,
                           shallow=False), name


def test_bpe_round_trip_and_bytes_per_token(tmp_path):
    tokenizer = build_tokenizer(BPE)
    text = 'ROMEO: But soft, what light through yonder window breaks? é'
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 512 and len(ids) < len(text.encode())
    assert tokenizer.decode(ids) == text
    table = tokenizer.token_bytes()
    assert sum(table[i] for i in ids) == len(text.encode('utf-8'))
    # A saved copy loads as a plain Hugging Face tokenizer directory.
    tokenizer.save_pretrained(str(tmp_path))
    assert HFTokenizer(str(tmp_path)).encode(text) == ids
    with pytest.raises(FileNotFoundError, match="path='.*nowhere'"):
        HFTokenizer(str(tmp_path / 'nowhere'))


def test_dataset_windows_of_bpe_tokens():
    val = ShakespeareDataset('val', context_length=32, tokenizer=BPE)
    train = ShakespeareDataset('train', context_length=32, tokenizer=BPE)
    assert len(train.tokens) + len(val.tokens) == len(
        text_tokens(str(DATA_FILE), train.tokenizer))
    assert train.tokens.dtype == torch.int32  # bytes stay uint8
    assert int(val.tokens.max()) < 512
    item = val[0]
    torch.testing.assert_close(item['inputs'][1:], item['data_samples'][:-1])
    assert val.metainfo['vocab_size'] == 512
    assert len(val.metainfo['token_bytes']) == 512


def test_bits_per_byte_divides_by_bytes_of_text():
    val = ShakespeareDataset('val', context_length=32, tokenizer=BPE)
    batch = dict(inputs=torch.stack([val[i]['inputs'] for i in range(3)]),
                 data_samples=torch.stack(
                     [val[i]['data_samples'] for i in range(3)]))
    samples = [dict(loss_sum=10.0 + i, num_tokens=32) for i in range(3)]
    metric = LanguageModelMetric()
    metric.dataset_meta = val.metainfo
    metric.process(batch, samples)
    out = metric.evaluate(3)
    text = build_tokenizer(BPE).decode(batch['data_samples'].flatten())
    nats = sum(s['loss_sum'] for s in samples)
    assert out['lm/cross_entropy'] == pytest.approx(nats / 96)
    assert out['lm/bits_per_byte'] == pytest.approx(
        nats / math.log(2) / len(text.encode('utf-8')))
    assert len(text.encode('utf-8')) > 96  # more than one byte per token


def test_generate_and_export_use_the_configs_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from mmpar.convert import export_hf
    from mmpar.generation import (generate_text, load_model,
                                  tokenizer_from_config)
    config = 'configs/llama_shakespeare/llama_shakespeare.py'
    opts = {'model.vocab_size': 512, 'model.dim': 32, 'model.num_layers': 1,
            'model.num_heads': 2,
            'train_dataloader.dataset.tokenizer': BPE}
    tokenizer = tokenizer_from_config(config, opts)
    assert tokenizer.vocab_size == 512
    model = load_model(config, None, opts)
    text = generate_text(model, 'ROMEO:', 5, tokenizer=tokenizer, seed=0)
    assert text.startswith('ROMEO:') and len(tokenizer.encode(text)) >= 7
    checkpoint = str(tmp_path / 'ckpt.pth')
    torch.save(dict(state_dict=model.state_dict()), checkpoint)
    export_hf(checkpoint, config, str(tmp_path / 'hf'), opts)
    exported = AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
    assert exported.encode('ROMEO:') == tokenizer.encode('ROMEO:')
