_base_ = './plan_ddp.py'
optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3), _delete_=True)
parallel = dict(use_fsdp=True)
model_wrapper_cfg = dict(
    type='MMFullyShardedDataParallel',
    sharding_strategy='FULL_SHARD',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['PlanBlock']))
