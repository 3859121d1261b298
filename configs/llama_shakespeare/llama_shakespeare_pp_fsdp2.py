# 2-D: pipeline parallelism (2 stages, 1F1B) x FSDP2 over the data axis, each
# stage sharded across its data-parallel peers. On 4 processes:
# pp=2 x dp_shard=2. For the 4-block default, the interleaved schedule also
# fits: schedule='Interleaved1F1B', stages_per_rank=2.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_pp_fsdp2.py 4
_base_ = ['./llama_shakespeare.py']
parallel = dict(pp=2, pipeline=dict(schedule='1F1B', num_microbatches=2))
model_wrapper_cfg = dict(type='MMFullyShard')
