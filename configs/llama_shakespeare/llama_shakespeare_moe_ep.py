# The MoE Llama with its experts split over 2 ranks (expert parallelism):
# routed tokens go to their experts' rank and back with all-to-alls; the
# other weights are sharded by FSDP2 over all data ranks, the experts over
# the data ranks outside ep (dp_shard x cp = efsdp x ep).
# docs/expert_parallel.md.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_moe_ep.py 2
_base_ = ['./llama_shakespeare_moe.py']
parallel = dict(ep=2)
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
)
