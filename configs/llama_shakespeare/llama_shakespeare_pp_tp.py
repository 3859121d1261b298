# 3-D: pipeline parallelism (2 stages, 1F1B) x tensor parallelism inside
# each stage (the 'llama' plan: Megatron splits, sequence-parallel norms;
# stages hand each other this tp rank's sequence shard) x FSDP2 over the
# data axis. On 4 processes: pp=2 x tp=2 (one data rank); on 8:
# pp=2 x tp=2 x dp_shard=2, each stage's tp shards sharded again across its
# data-parallel peers. DDP instead of FSDP2 also works (it becomes
# MMTensorParallelDDP). docs/pipeline_parallel.md explains the layout.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_pp_tp.py 8
_base_ = ['./llama_shakespeare.py']
parallel = dict(
    pp=2, tp=2, tp_plan='llama',
    pipeline=dict(schedule='1F1B', num_microbatches=4))
model_wrapper_cfg = dict(type='MMFullyShard')
