# Hugging Face's Mixtral (a mixture of experts: 4 experts per layer, each
# token routed to its top 2) on the Shakespeare LM, built offline from
# transformers' MixtralConfig (random weights, nothing downloaded), sized
# like the MoE Llama of llama_shakespeare_moe.py. HFCausalLM runs its experts
# through mmpar's experts function (registered in transformers'
# ExpertsInterface), which splits them over ranks under parallel.ep
# (mixtral_shakespeare_hf_moe_ep.py). docs/expert_parallel.md.
# Needs: pip install -e '.[hf]'
#   python tools/train.py configs/hf_finetune/mixtral_shakespeare_hf_moe.py
# Fine-tune a Mixtral or Qwen3-MoE save_pretrained directory instead:
#   --cfg-options model.config=None model.pretrained=DIR
_base_ = ['../llama_shakespeare/llama_shakespeare.py']
model = dict(
    _delete_=True,
    type='HFCausalLM',
    config=dict(
        model_type='mixtral',
        vocab_size=256,
        hidden_size=128,
        intermediate_size=128,  # per expert
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
)
