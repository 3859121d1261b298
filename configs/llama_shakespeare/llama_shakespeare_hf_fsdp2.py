# Hugging Face's Llama under FSDP2: fully_shard on each LlamaDecoderLayer
# (transformers' decoder layer class), then the whole model.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_hf_fsdp2.py 2
_base_ = ['./llama_shakespeare_hf.py']
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaDecoderLayer']),
)
