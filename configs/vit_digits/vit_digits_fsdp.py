# The default example under FSDP1 (torch FullyShardedDataParallel): every
# TransformerBlock is its own FSDP unit, the rest sits in the root unit.
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_fsdp.py 2
# Every argument is explained in docs/fsdp.md.
_base_ = ['./vit_digits.py']
model_wrapper_cfg = dict(
    type='MMFullyShardedDataParallel',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['TransformerBlock']),
    backward_prefetch='pre',
    # mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32',
    #                      buffer_dtype='fp32'),
    # activation_checkpointing=['TransformerBlock'],
)
