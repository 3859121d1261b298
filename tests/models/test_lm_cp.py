"""Llama and HFCausalLM under context parallelism (cp=2 on 2 gloo ranks):
each rank's logits are the one-process logits at its positions, and the
cp-summed gradients of the token-sum loss over the global token count are
the one-process gradients, masked tokens included."""
import importlib.util

import pytest
import torch
import torch.distributed as dist

from mmpar.models.lm_loss import normalise_loss, token_loss_sum
from mmpar.parallelize.context import (ContextParallel,
                                       apply_context_parallel, shard_batch,
                                       unshard_sequence)

IGNORE = -100
HF_TINY = dict(model_type='llama', vocab_size=64, hidden_size=32,
               intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=16)
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec('transformers') is None,
    reason='transformers is not installed (pip install -e .[hf])')


def _llama():
    from mmpar.models.llama import Llama
    torch.manual_seed(0)
    return Llama(vocab_size=64, dim=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, max_seq_len=16)


def _hf(config=HF_TINY):
    from mmpar.models.hf import HFCausalLM
    torch.manual_seed(0)
    return HFCausalLM(config)


BUILDERS = dict(llama=_llama, hf=_hf)


def _batch(masked: bool):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, 17), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if masked:
        # Uneven over the ranks: sample 0 loses a prompt (positions 0-4,
        # rank 0's first chunk and one of rank 1's tokens), sample 1 its
        # padded tail (rank 0's last chunk).
        targets[0, :5] = IGNORE
        targets[1, 13:] = IGNORE
    return inputs, targets


def _loss(model, inputs, targets, group=None):
    loss_sum, num_tokens = token_loss_sum(model(inputs), targets)
    if group is not None:
        dist.all_reduce(num_tokens, group=group)
    return normalise_loss(loss_sum, num_tokens)


def _cp_parity(kind: str, masked: bool):
    inputs, targets = _batch(masked)
    reference = BUILDERS[kind]()
    expected_logits = reference(inputs)
    _loss(reference, inputs, targets).backward()

    model = BUILDERS[kind]()
    setting = apply_context_parallel(model, dist.group.WORLD)
    data = shard_batch(model, dict(inputs=inputs, data_samples=targets))
    logits = model(data['inputs'])
    torch.testing.assert_close(logits, setting.shard(expected_logits),
                               rtol=0, atol=1e-6)
    parts = [torch.empty_like(logits) for _ in range(setting.size)]
    dist.all_gather(parts, logits.detach())
    torch.testing.assert_close(unshard_sequence(parts), expected_logits,
                               rtol=0, atol=1e-6)

    _loss(model, data['inputs'], data['data_samples'],
          setting.group).backward()
    # cp peers hold the same weights: their gradients add up.
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=setting.group)
        torch.testing.assert_close(
            param.grad, reference.get_parameter(name).grad, rtol=0,
            atol=1e-6, msg=lambda m, name=name: f'{name}: {m}')
    # Switched back, it is the one-process model again.
    apply_context_parallel(model, None)
    torch.testing.assert_close(model(inputs), expected_logits)
    return setting.rank


@pytest.mark.parametrize('masked', [False, True],
                         ids=['all_tokens', 'ignore_index'])
def test_llama_cp2_matches_one_process(run_dist, masked):
    assert run_dist(_cp_parity, 'llama', masked) == [0, 1]


@needs_transformers
def test_hf_cp2_matches_one_process(run_dist):
    # Through Hugging Face's attention interface and position_ids.
    assert run_dist(_cp_parity, 'hf', True) == [0, 1]


@needs_transformers
def test_hf_cp_switches_attention_and_back():
    model = _hf()
    inputs = _batch(False)[0]
    expected = model(inputs)
    apply_context_parallel(model, ContextParallel(group=None, rank=0,
                                                  size=1))
    assert model.hf_config._attn_implementation == 'mmpar_context_parallel'
    assert model.hf_model.model.layers[1].self_attn.context_parallel \
        is model.context_parallel
    torch.testing.assert_close(model(inputs), expected)
    apply_context_parallel(model, None)
    assert model.hf_config._attn_implementation == 'sdpa'


@needs_transformers
def test_hf_model_without_layers_self_attn_is_refused():
    model = _hf(dict(model_type='gpt2', vocab_size=64, n_embd=32, n_layer=1,
                     n_head=2, n_positions=16))
    with pytest.raises(ValueError, match=r"HFCausalLM.context_parallel_"
                       r"modules=\('hf_model.transformer.layers.\*.self_"
                       r"attn',\) matches no module"):
        apply_context_parallel(model, None)


def test_llama_declares_every_block_attention():
    model = _llama()
    setting = ContextParallel(group=None, rank=0, size=1)
    apply_context_parallel(model, setting)
    assert [block.attn.context_parallel for block in model.layers.values()
            ] == [setting, setting]


def test_llama_rotary_follows_the_rank_positions():
    from mmpar.models.llama import rotary_at_rank
    model = _llama()
    setting = ContextParallel(group=None, rank=1, size=2)
    cos, _ = rotary_at_rank(*model.rotary(8), 8, setting)  # 4-11 of 16
    torch.testing.assert_close(cos, model.rope_cos[4:12])


def test_llama_cp_refuses_bad_lengths():
    from mmpar.models.llama import rotary_at_rank
    model = _llama()
    setting = ContextParallel(group=None, rank=0, size=2)
    with pytest.raises(ValueError, match=r'sequence length 6 must be a '
                       r'multiple of 2 x cp = 4'):
        rotary_at_rank(*model.rotary(3), 3, setting)
    with pytest.raises(ValueError, match=r'sequence length 20 exceeds '
                       r'model.max_seq_len=16'):
        rotary_at_rank(*model.rotary(10), 10, setting)


def test_token_loss_sum_counts_only_counted_tokens():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, IGNORE, 2], [IGNORE, IGNORE, IGNORE]])
    loss_sum, num_tokens = token_loss_sum(logits, targets)
    assert num_tokens.item() == 2
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    torch.testing.assert_close(normalise_loss(loss_sum, num_tokens),
                               expected)
    # Nothing counted: zero, not NaN.
    assert normalise_loss(loss_sum * 0, torch.tensor(0)).item() == 0
    assert normalise_loss(loss_sum * 0, 0).item() == 0
