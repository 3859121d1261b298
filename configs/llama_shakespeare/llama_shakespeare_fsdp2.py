# The Shakespeare LM under FSDP2 (fully_shard on each LlamaBlock, then the
# whole model), saving sharded (DCP) checkpoints.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_fsdp2.py 2
_base_ = ['./llama_shakespeare.py']
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
    # mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'),
)
# Each rank writes its own shards (a directory per checkpoint);
# tools/generate.py reads such a directory too.
checkpoint_format = 'sharded'
