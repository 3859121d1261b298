"""Reading and writing Hugging Face weights: single and sharded files, one
``.safetensors`` file, the Llama name map, and errors that name the file and
the key."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmpar.models.hf_weights import (hf_weight_files, is_hf_checkpoint,
                                 read_hf_state_dict, save_hf_checkpoint)
from mmpar.models import HFCausalLM, Llama
from mmpar.models.llama_hf import NAMES, plain_name
from tests.checkpoint.test_hf_layouts import LLAMA, hf_logits, make_hf_dir


def _llama(**changes):
    torch.manual_seed(2)
    kwargs = {k: v for k, v in LLAMA.items() if k != 'type'}
    return Llama(**{**kwargs, **changes})


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    return make_hf_dir(str(tmp_path_factory.mktemp('hf_unit')))


def test_name_map_is_one_to_one():
    model = _llama()
    hf_keys = [hf.format(i=i) for hf in NAMES.values()
               for i in range(2 if '{i}' in hf else 1)]
    assert sorted(plain_name(k) for k in hf_keys) == sorted(
        model.state_dict())
    with pytest.raises(ValueError, match="'model.layers.0.mlp.bias'"):
        plain_name('model.layers.0.mlp.bias')


def test_sharded_index_and_single_file_read_the_same(hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    sharded = str(tmp_path / 'sharded')
    AutoModelForCausalLM.from_pretrained(hf_dir).save_pretrained(
        sharded, max_shard_size='20KB')
    assert os.path.isfile(os.path.join(sharded,
                                       'model.safetensors.index.json'))
    assert len(set(hf_weight_files(sharded).values())) > 1
    single_file = os.path.join(hf_dir, 'model.safetensors')
    assert is_hf_checkpoint(single_file) and is_hf_checkpoint(sharded)
    model = _llama()
    expected = read_hf_state_dict(hf_dir, model)
    for path in (sharded, single_file):
        state = read_hf_state_dict(path, model)
        assert state.keys() == expected.keys() == model.state_dict().keys()
        for key in state:
            assert torch.equal(state[key], expected[key]), key


def test_missing_paths_are_named(tmp_path, hf_dir):
    with pytest.raises(FileNotFoundError, match='nowhere'):
        read_hf_state_dict(str(tmp_path / 'nowhere'), _llama())
    with pytest.raises(FileNotFoundError, match="pretrained='.*nowhere'"):
        HFCausalLM(pretrained=str(tmp_path / 'nowhere'))
    with pytest.raises(ValueError, match='exactly one of config'):
        HFCausalLM(config=dict(model_type='llama'), pretrained=hf_dir)
    broken = tmp_path / 'broken'
    broken.mkdir()
    (broken / 'model.safetensors.index.json').write_text(json.dumps(
        dict(weight_map={'lm_head.weight': 'model-00002.safetensors'})))
    with pytest.raises(FileNotFoundError, match="'model-00002.safetensors'"):
        read_hf_state_dict(str(broken), _llama())


def test_shape_and_key_errors_name_file_and_key(hf_dir, tmp_path):
    weights = os.path.join(hf_dir, 'model.safetensors')
    with pytest.raises(ValueError, match=r"model.safetensors: key "
                       r"'model.embed_tokens.weight' has shape \(64, 32\), "
                       r'the model needs \(128, 32\)'):
        read_hf_state_dict(hf_dir, _llama(vocab_size=128))
    state = load_file(weights)
    del state['model.norm.weight']
    save_file(state, str(tmp_path / 'partial.safetensors'))
    with pytest.raises(ValueError, match="key 'model.norm.weight' is "
                       'missing'):
        read_hf_state_dict(str(tmp_path / 'partial.safetensors'), _llama())
    # config.json says what no shape shows: another rope base.
    with pytest.raises(ValueError, match="config.json: rope_parameters="):
        read_hf_state_dict(hf_dir, _llama(rope_theta=500000.0))
    # Or another split of the same width into heads (the same shapes).
    heads = LLAMA['num_heads'] * 2
    with pytest.raises(ValueError, match=r"config.json: num_attention_heads="
                       rf"{LLAMA['num_heads']}, but the model is configured "
                       rf'with num_attention_heads={heads}'):
        read_hf_state_dict(hf_dir, _llama(num_heads=heads,
                                          num_kv_heads=heads))


def test_tied_embeddings_export_and_load(tmp_path):
    model = _llama(tie_embeddings=True)
    out = str(tmp_path / 'tied')
    save_hf_checkpoint(model, model.state_dict(), out)
    assert 'lm_head.weight' not in load_file(
        os.path.join(out, 'model.safetensors'))  # tied: saved once
    inputs = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert (model(inputs) - hf_logits(out, inputs)).abs().max() <= 1e-5
    fresh = _llama(tie_embeddings=True)
    fresh.load_state_dict(read_hf_state_dict(out, fresh), strict=True)
    assert torch.equal(fresh.output.weight, model.tok_embeddings.weight)
