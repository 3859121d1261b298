# The default example with tensor parallelism: each TransformerBlock's MLP is
# split over tp=2 ranks (the registered `digits_vit` plan); the rest of the
# model is replicated. With 2 processes that is the whole world; with 4 the
# other axis is data parallel (dp=2 x tp=2, DDP over the data axis).
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_tp.py 2
# Every option is explained in docs/tensor_parallel.md.
_base_ = ['./vit_digits.py']
parallel = dict(tp=2, tp_plan='digits_vit')
# model_wrapper_cfg = dict(type='MMFullyShard')  # 2-D: FSDP2 x TP
