# 2-D: tensor parallelism inside groups of 2 ranks (the 'llama' plan), FSDP2
# sharding each LlamaBlock over the data axis across them. On 4 ranks:
# tp=2 x dp_shard=2; sharded (DCP) checkpoints.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_tp_fsdp2.py 4
_base_ = ['./llama_shakespeare.py']
parallel = dict(tp=2, tp_plan='llama')
model_wrapper_cfg = dict(
    type='MMFullyShard',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
)
checkpoint_format = 'sharded'
