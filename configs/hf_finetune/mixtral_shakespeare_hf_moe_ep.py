# Hugging Face's Mixtral with its experts split over 2 ranks (expert
# parallelism): each rank holds 2 of the 4 experts of every layer, routed
# tokens go to their experts' rank and back with all-to-alls; the other
# weights are sharded by FSDP2 over all data ranks, the experts over the
# data ranks outside ep. docs/expert_parallel.md.
#   bash tools/dist_train.sh configs/hf_finetune/mixtral_shakespeare_hf_moe_ep.py 2
#   bash tools/dist_train.sh configs/hf_finetune/mixtral_shakespeare_hf_moe_ep.py 4 --cfg-options parallel.dp_shard=2
_base_ = ['./mixtral_shakespeare_hf_moe.py']
parallel = dict(ep=2)
model_wrapper_cfg = dict(
    type='MMFullyShard',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['MixtralDecoderLayer']),
)
