# The Shakespeare LM with pipeline parallelism: the blocks are cut into 2
# stages (split evenly when split_points is left out; e.g.
# split_points=['layers.2'] for the 4-block default), run by torch's 1F1B
# schedule with 4 micro-batches per batch. On 2 processes that is the whole
# world; on 4 the other axis is data parallel (pp=2 x dp=2, DDP per stage).
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_pp.py 2
# Every option is explained in docs/pipeline_parallel.md.
_base_ = ['./llama_shakespeare.py']
parallel = dict(
    pp=2, pipeline=dict(schedule='1F1B', num_microbatches=4))
