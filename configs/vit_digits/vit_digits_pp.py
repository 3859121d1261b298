# The default example with pipeline parallelism: the ViT's 4 blocks are cut
# into 2 stages at blocks.2 (patch embedding + blocks 0-1 | blocks 2-3 + head)
# and run by torch's 1F1B schedule with 4 micro-batches per batch. With 2
# processes that is the whole world; with 4 the other axis is data parallel
# (dp=2 x pp=2, DDP over the data axis).
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_pp.py 2
# Every option is explained in docs/pipeline_parallel.md.
_base_ = ['./vit_digits.py']
parallel = dict(
    pp=2,
    pipeline=dict(
        split_points=['blocks.2'], schedule='1F1B', num_microbatches=4))
# model_wrapper_cfg = dict(type='MMFullyShard')  # 2-D: FSDP2 x PP
# Checkpoints hold the whole model and optimizer (every stage gathered, plain
# names): they load into the unsplit model and resume at any layout, e.g.
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_pp.py 2 --resume
# checkpoint_format = 'sharded'  # each stage writes its own shards (DCP)
