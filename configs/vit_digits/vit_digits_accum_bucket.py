# Gradient accumulation over 2 micro-batches with the bucketed data-parallel
# wrapper: per process 2 x 16 images per optimizer step, the same global batch
# as the default example with 2 processes (2 x 32).
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_accum_bucket.py 2
_base_ = ['./vit_digits.py']
train_dataloader = dict(batch_size=16)
optim_wrapper = dict(accumulative_counts=2)
model_wrapper_cfg = dict(
    type='MMBucketDataParallel',
    bucket_cap_mb=1,
    sync_strategy='single_auto_sync',
)
