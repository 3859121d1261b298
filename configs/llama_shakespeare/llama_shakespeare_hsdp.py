# The Shakespeare LM with hybrid sharding (FSDP2 HYBRID_SHARD): parameters
# sharded within groups of 2 ranks, replicated across the groups. On 4 ranks:
# 2 replicas x 2 shards; on 2 nodes leave hybrid_shard_size unset (the ranks
# of one node form a shard group).
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_hsdp.py 4
_base_ = ['./llama_shakespeare.py']
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='HYBRID_SHARD',
    hybrid_shard_size=2,
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
)
