"""HFCausalLM: a transformers causal LM from a config dict, offline; FSDP2 on
its decoder layers matches one-process training. transformers is in
requirements-test.txt: nothing here skips."""
import sys

import pytest
import torch
import torch.distributed as dist

from mmpar.registry import MODELS
from mmpar.wrappers import build_model_wrapper
from tests.lm_toy import make_token_batches
from tests.toy import (assert_states_close, make_optim_wrapper, shard_batch,
                       train_reference)

TINY = dict(model_type='llama', vocab_size=64, hidden_size=32,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16)
OPTIM = dict(accumulative_counts=2, clip=0.05)


def _model():
    torch.manual_seed(0)
    return MODELS.build(dict(type='HFCausalLM', config=TINY))


def test_missing_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, 'transformers', None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        MODELS.build(dict(type='HFCausalLM', config=TINY))


def test_builds_offline_and_speaks_mmpars_interface():
    model = _model()
    assert type(model.hf_model).__name__ == 'LlamaForCausalLM'
    assert model.decoder_layer_class == 'LlamaDecoderLayer'
    assert model.max_seq_len == 16
    batch = make_token_batches(1)[0]
    logits = model(batch['inputs'])
    assert logits.shape == (4, 16, 64)
    torch.testing.assert_close(
        logits, model.hf_model(input_ids=batch['inputs']).logits)
    loss = model(**batch, mode='loss')['loss']
    preds = model(**batch, mode='predict')
    assert sum(p['loss_sum'] for p in preds) / 64 == pytest.approx(
        loss.item(), rel=1e-5)
    # Deterministic from the seed (init_weights draws nothing more).
    state = _model().state_dict()
    model.init_weights()
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    embed = 64 * 32
    n = sum(p.numel() for p in model.parameters()) - embed
    assert model.flops_per_token(16) == 6 * n + 12 * 2 * 4 * 8 * 16


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="model_type='nope'"):
        MODELS.build(dict(type='HFCausalLM',
                          config=dict(TINY, model_type='nope')))
    with pytest.raises(ValueError, match="'model_type'"):
        MODELS.build(dict(type='HFCausalLM', config=dict(hidden_size=8)))


def _train_fsdp2(batches):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    wrapper = build_model_wrapper(
        dict(type='MMFullyShard', fsdp_auto_wrap_policy=dict(
            type='module_class',
            module_classes=[model.decoder_layer_class])), model)
    units = sum(type(m).__name__.startswith('FSDP') for m in model.modules())
    optim_wrapper = make_optim_wrapper(wrapper.module, **OPTIM)
    for batch in batches:
        wrapper.train_step(shard_batch(batch, rank, world), optim_wrapper)
    return units, wrapper.full_state_dict()


def test_fsdp2_matches_one_process(run_dist):
    batches = make_token_batches()
    expected = train_reference(_model(), batches, **OPTIM)
    for units, state in run_dist(_train_fsdp2, batches):
        assert units == 3  # two decoder layers and the root
        assert_states_close(state, expected, atol=1e-6, rtol=1e-5)
    assert not torch.equal(expected['hf_model.lm_head.weight'],
                           _model().state_dict()['hf_model.lm_head.weight'])
