"""Hugging Face MoE experts under mmpar's experts function
(``mmpar/models/hf_moe.py``) compute what transformers' own eager experts
compute, forward and backward, for each supported class; a configuration
whose experts ``parallel.ep`` cannot split is refused at start-up, naming
the key (no process group). The ep runs: tests/tools/test_ep_hf_moe.py."""
import copy

import pytest
import torch

from mmpar.config_check import check_layout
from mmpar.failures import ConfigError
from mmpar.models import HFCausalLM
from mmpar.models.hf_moe import EXPERTS_IMPLEMENTATION, SUPPORTED_EXPERTS

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2,
            max_position_embeddings=64)
MIXTRAL = dict(model_type='mixtral', num_local_experts=4, **TINY)
QWEN3_MOE = dict(model_type='qwen3_moe', num_experts=4,
                 moe_intermediate_size=16, head_dim=8, **TINY)


@pytest.mark.parametrize('config', [MIXTRAL, QWEN3_MOE],
                         ids=['mixtral', 'qwen3_moe'])
def test_mmpar_experts_compute_what_hugging_face_eager_computes(config):
    torch.manual_seed(0)
    ours = HFCausalLM(config=config)
    experts = [m for m in ours.modules()
               if type(m).__name__ in SUPPORTED_EXPERTS]
    assert len(experts) == 2
    assert ours.hf_model.get_experts_implementation() == {
        '': EXPERTS_IMPLEMENTATION}
    assert all(m.expert_parallel_params == ('gate_up_proj', 'down_proj')
               for m in experts)
    eager = copy.deepcopy(ours.hf_model)
    eager.set_experts_implementation('eager')
    inputs = torch.randint(0, 64, (2, 8))
    got = ours.hf_model(input_ids=inputs).logits
    want = eager(input_ids=inputs).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, a), b in zip(ours.hf_model.named_parameters(),
                            eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4,
                                   msg=name)


def _check(model, ep=2):
    return check_layout(dict(model=model,
                             model_wrapper_cfg=dict(type='MMFullyShard'),
                             parallel=dict(ep=ep)), 4)


def test_refused_at_start_up_naming_the_key(tmp_path):
    from transformers import AutoConfig
    assert _check(dict(type='HFCausalLM', config=MIXTRAL)).dims.ep == 2
    with pytest.raises(ConfigError,
                       match=r"model.config.num_local_experts=6 is not "
                       r"allowed with parallel.ep=4, .*a multiple of 4"):
        _check(dict(type='HFCausalLM',
                    config=dict(MIXTRAL, num_local_experts=6)), ep=4)
    dense = dict(MIXTRAL, model_type='llama')
    with pytest.raises(ConfigError,
                       match=r"model.config.model_type='llama' is not "
                       r"allowed with parallel.ep=2: mmpar splits the "
                       r"experts of MixtralExperts, Qwen3MoeExperts only"):
        _check(dict(type='HFCausalLM', config=dense))
    qwen = dict(QWEN3_MOE, num_experts=6)
    AutoConfig.for_model(**qwen).save_pretrained(tmp_path)
    with pytest.raises(ConfigError,
                       match=rf"model.pretrained='{tmp_path}' config.json."
                       r"num_experts=6 is not allowed with parallel.ep=4"):
        _check(dict(type='HFCausalLM', pretrained=str(tmp_path)), ep=4)
