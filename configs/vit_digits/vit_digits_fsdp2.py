# The default example under FSDP2 (torch.distributed.fsdp.fully_shard):
# each TransformerBlock gets its own fully_shard, then the whole model.
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_fsdp2.py 2
# Every argument is explained in docs/fsdp.md.
_base_ = ['./vit_digits.py']
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['TransformerBlock']),
    # reshard_after_forward=False,
    # mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'),
    # activation_checkpointing=['TransformerBlock'],
)
