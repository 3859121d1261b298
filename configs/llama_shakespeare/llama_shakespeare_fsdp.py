# The Shakespeare LM under FSDP1: every LlamaBlock is its own FSDP unit, the
# embedding, final norm and head sit in the root unit.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_fsdp.py 2
_base_ = ['./llama_shakespeare.py']
model_wrapper_cfg = dict(
    type='MMFullyShardedDataParallel',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
    backward_prefetch='pre',
)
