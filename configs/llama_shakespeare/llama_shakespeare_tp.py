# The Shakespeare LM with tensor parallelism: the built-in 'llama' plan splits
# q/k/v and the SwiGLU gate/up projections by columns, the output projections
# by rows, runs the norms sequence-parallel and gathers the vocabulary-split
# logits (mmpar/models/llama.py TP_PLAN). On 2 ranks: tp=2, one data replica
# (DDP over the data axis becomes MMTensorParallelDDP); on 4: tp=2 x dp=2.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_tp.py 2
_base_ = ['./llama_shakespeare.py']
parallel = dict(tp=2, tp_plan='llama')
