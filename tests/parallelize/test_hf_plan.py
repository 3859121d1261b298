"""``tp_plan='hf'``: a transformers model's own TP plan. A tiny Llama (GQA:
4 query, 2 key/value heads) and a tiny Phi-3 (fused ``qkv_proj`` and
``gate_up_proj``, which its plan gathers) inside an MMEngine model split over
tp=2 and train like one process, iteration by iteration; the plan of every
decoder family listed in :data:`FAMILIES` translates and fits the model."""
import copy

import pytest
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel

from mmpar.parallelize.hf_plan import translate_hf_plan
from mmpar.parallelize.tensor import apply_tp
from tests.parallelize import tp_cases


# transformers decoder families with a TP plan (GPT-2 has none: its fused
# c_attn is a Conv1D, which no style splits; GPT-NeoX fuses q/k/v per head,
# so its plain colwise plan keeps each head's q, k and v together).
FAMILIES = ('Llama', 'Mistral', 'Qwen2', 'Qwen3', 'Phi3', 'Gemma', 'Gemma2',
            'GPTNeoX')


def tiny_causal_lm(family: str, num_hidden_layers: int = 2):
    """A tiny ``<family>ForCausalLM`` from its config class (offline)."""
    import transformers
    config = getattr(transformers, f'{family}Config')(
        vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=num_hidden_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return getattr(transformers, f'{family}ForCausalLM')(config)


class HFCausalLM(BaseModel):
    """An MMEngine model holding a transformers causal LM as ``lm``."""

    def __init__(self, family: str = 'Llama'):
        super().__init__()
        self.lm = tiny_causal_lm(family)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.lm(input_ids=inputs).logits
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits.flatten(0, 1),
                                             data_samples.flatten()))
        return logits


def test_translation_prefixes_and_refuses_unknown_styles():
    assert translate_hf_plan('lm', {'lm_head': 'colwise_gather_output'}) == {
        'lm.lm_head': dict(style='colwise', output_layouts='replicate')}
    with pytest.raises(ValueError, match=r"'x' uses the transformers style "
                       r"'grouped_gemm', which mmpar does not translate "
                       r"\(expert-parallel .*allowed: colwise, "):
        translate_hf_plan('', {'x': 'grouped_gemm'})


def test_styles_translate_as_transformers_defines_them():
    """Each style's layouts as transformers/distributed/tensor_parallel.py
    registers it."""
    plan = translate_hf_plan('', {
        'a.o': 'rowwise_split_input', 'a.rep': 'rowwise_rep',
        'a.qkv': 'colwise_gather_output',
        'a.n': 'replicated_with_grad_allreduce',
        'm.gu': 'packed_colwise', 'e': 'embedding_colwise', 'r': 'replicate'},
        prepare_inputs=False)
    assert plan == {
        'a.o': dict(style='rowwise', input_layouts='replicate'),
        'a.rep': dict(style='rowwise', input_layouts='replicate'),
        'a.qkv': dict(style='colwise', output_layouts='replicate'),
        'a.n': 'replicate_sharded_input',
        'm.gu': dict(style='colwise', fused=2),
        'e': dict(style='colwise', output_layouts='replicate')}


@pytest.mark.parametrize('family', FAMILIES)
def test_every_family_plan_translates_and_fits(family):
    """No style refused, every pattern matches, tp=2 divides every split."""
    from mmpar.parallelize.hf_plan import find_hf_plan
    from mmpar.parallelize.module_plan import module_plan_styles
    model = tiny_causal_lm(family, num_hidden_layers=1)
    prefix, plan = find_hf_plan(model)
    entries = translate_hf_plan(prefix, plan)
    styles = module_plan_styles(model, entries, 2)
    split = {n for n, s in styles.items() if 'Parallel' in type(s).__name__}
    assert 'lm_head' in split and len(split) >= 5, sorted(split)


def test_moe_experts_stay_whole_with_what_is_under_them():
    """transformers' tensor-parallel experts (``moe_tp_experts``) and the
    stacked parameters it lists under them: no entry (the MoE layer whole
    on every tp rank); a sibling with the same prefix is still split."""
    plan = {'l.mlp.experts': 'moe_tp_experts',
            'l.mlp.experts.gate_up_proj': 'packed_colwise',
            'l.mlp.experts.down_proj': 'grouped_gemm',
            'l.mlp.experts_x': 'colwise'}
    assert translate_hf_plan('m', plan) == {'m.l.mlp.experts_x': 'colwise'}


QWEN3_MOE = dict(num_experts=4, moe_intermediate_size=16)


@pytest.mark.parametrize('family,experts,dense', [
    ('Mixtral', dict(num_local_experts=4), []),
    ('Qwen3Moe', QWEN3_MOE, []),
    ('Qwen3Moe', dict(QWEN3_MOE, mlp_only_layers=[1]), [1])],
    ids=['mixtral', 'qwen3_moe', 'qwen3_moe_dense_layer1'])
def test_moe_family_plans_split_attention_and_leave_moe_layers_whole(
        family, experts, dense):
    """``tp_plan='hf'`` on transformers' MoE models: attention, the
    embedding and the head split, every MoE layer (router and experts)
    whole; Qwen3-MoE's dense MLP split where a layer has one
    (``mlp_only_layers``), its entries left out where none has."""
    import transformers

    from mmpar.parallelize.hf_plan import hf_plan_entries
    from mmpar.parallelize.module_plan import module_plan_styles
    config = getattr(transformers, f'{family}Config')(
        vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, max_position_embeddings=32, **experts)
    model = getattr(transformers, f'{family}ForCausalLM')(config)
    styles = module_plan_styles(model, hf_plan_entries(model), 2)
    split = {n for n, s in styles.items() if 'Parallel' in type(s).__name__}
    assert {'lm_head', 'model.embed_tokens', 'model.layers.0.self_attn.q_proj',
            'model.layers.1.self_attn.o_proj'} <= split
    assert {n for n in styles if '.mlp' in n} == {
        f'model.layers.{i}.mlp.{p}' for i in dense
        for p in ('gate_proj', 'up_proj', 'down_proj')}


def test_model_without_hf_plan_is_refused():
    with pytest.raises(ValueError, match="tp_plan='hf': no module"):
        apply_tp(tp_cases.make_vit(), None, 'hf')


def _hf_parity(family):
    mesh = tp_cases.world_mesh(2)
    torch.manual_seed(0)
    model = HFCausalLM(family)
    reference = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    batches = [dict(inputs=torch.randint(0, 64, (4, 16), generator=gen),
                    data_samples=torch.randint(0, 64, (4, 16), generator=gen))
               for _ in range(4)]
    ref_optim = tp_cases.optim_wrapper_for(reference)
    ref_losses = [reference.train_step(batch, ref_optim)['loss']
                  for batch in batches]
    apply_tp(model, mesh['tp'], 'hf')
    from mmpar.wrappers import MMTensorParallelDDP
    wrapper = MMTensorParallelDDP(
        model, process_group=mesh['dp'].get_group())
    optim = tp_cases.optim_wrapper_for(model)
    losses = [wrapper.train_step(batch, optim)['loss'] for batch in batches]
    # Every iteration: the loss before its update, the weights after all.
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    # Updates, not values (tp_cases.assert_parity): a norm weight near 1
    # moves by ~1e-5, which a relative tolerance on the value would hide.
    state = wrapper.full_state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key] - initial[key],
                                   value - initial[key], rtol=1e-4,
                                   atol=2e-7, msg=key)


@pytest.mark.parametrize('family', ['Llama', 'Phi3', 'Qwen3'])
def test_hf_tp2_trains_like_one_process(run_dist, family):
    run_dist(_hf_parity, family)
