"""``tp_plan='hf'``: a transformers model's own TP plan. A tiny Llama (GQA:
4 query, 2 key/value heads) inside an MMEngine model splits over tp=2 and
trains like one process."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel

from mmpar.parallelize.hf_plan import translate_hf_plan
from mmpar.parallelize.tensor import apply_tp
from tests.parallelize import tp_cases


class HFCausalLM(BaseModel):
    """An MMEngine model holding a transformers causal LM as ``lm``."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        self.lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.lm(input_ids=inputs).logits
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits.flatten(0, 1),
                                             data_samples.flatten()))
        return logits


def test_translation_prefixes_and_refuses_unknown_styles():
    assert translate_hf_plan('lm', {'lm_head': 'colwise_gather_output'}) == {
        'lm.lm_head': dict(style='colwise', output_layouts='replicate')}
    with pytest.raises(ValueError, match="'packed_colwise'"):
        translate_hf_plan('', {'x': 'packed_colwise'})


def test_model_without_hf_plan_is_refused():
    with pytest.raises(ValueError, match="tp_plan='hf': no module"):
        apply_tp(tp_cases.make_vit(), None, 'hf')


def _hf_parity():
    mesh = tp_cases.world_mesh(2)
    torch.manual_seed(0)
    model = HFCausalLM()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    batches = [dict(inputs=torch.randint(0, 64, (4, 16), generator=gen),
                    data_samples=torch.randint(0, 64, (4, 16), generator=gen))
               for _ in range(4)]
    ref_optim = tp_cases.optim_wrapper_for(reference)
    for batch in batches:
        reference.train_step(batch, ref_optim)
    apply_tp(model, mesh['tp'], 'hf')
    from mmpar.wrappers import MMTensorParallelDDP
    wrapper = MMTensorParallelDDP(
        model, process_group=mesh['dp'].get_group())
    optim = tp_cases.optim_wrapper_for(model)
    for batch in batches:
        wrapper.train_step(batch, optim)
    state = wrapper.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-6,
                                   msg=key)


def test_hf_llama_tp2_trains_like_one_process(run_dist):
    run_dist(_hf_parity)
