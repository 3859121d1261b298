# A Llama small enough that tools/plan.py --search at 2 ranks measures every
# layout in seconds and the config it writes trains through
# tools/dist_train.sh in a few more (tests/analysis/test_layout_search.py).
_base_ = ['../../configs/llama_shakespeare/llama_shakespeare.py']

model = dict(dim=32, num_layers=2, num_heads=2, max_seq_len=32)
train_dataloader = dict(
    batch_size=4, dataset=dict(context_length=32, num_windows=256))
val_dataloader = dict(
    batch_size=4, dataset=dict(context_length=32, num_windows=8))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=2, val_interval=2)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2))
