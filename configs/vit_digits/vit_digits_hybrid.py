# The default example with hybrid sharding (FSDP1 HYBRID_SHARD): parameters
# are sharded within groups of `hybrid_shard_size` ranks (default: the ranks
# on one node) and replicated across the groups.
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_hybrid.py 2
# With 2 ranks and hybrid_shard_size=1 this is 2 replicas of unsharded
# parameters; on 2 nodes x 8 GPUs leave it unset (8 per shard group).
# FSDP2 hybrid: type='MMFullyShard' with the same two keys.
_base_ = ['./vit_digits.py']
model_wrapper_cfg = dict(
    type='MMFullyShardedDataParallel',
    sharding_strategy='HYBRID_SHARD',
    hybrid_shard_size=1,
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['TransformerBlock']),
)
