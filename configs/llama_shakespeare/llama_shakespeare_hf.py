# The same workload on Hugging Face's Llama (transformers' LlamaForCausalLM
# built from this config offline: random weights, nothing downloaded), sized
# like the mmpar Llama of llama_shakespeare.py. Needs: pip install -e '.[hf]'
#   python tools/train.py configs/llama_shakespeare/llama_shakespeare_hf.py
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_hf.py 2
_base_ = ['./llama_shakespeare.py']
model = dict(
    _delete_=True,
    type='HFCausalLM',
    config=dict(
        model_type='llama',
        vocab_size=256,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    ),
)
