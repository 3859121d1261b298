# The base of the launches in tests/tools/test_documented_options.py: the
# iteration-based example shrunk to seconds per run on 2 CPU ranks. Four
# blocks, so that 2 pp ranks can hold 2 virtual stages each; SGD (AdamW
# divides by sqrt(v) and amplifies float noise, docs/tensor_parallel.md), so
# that a pipeline run can be held to one process's weights tightly.
_base_ = ['../../configs/vit_digits/vit_digits_iter.py']
model = dict(embed_dim=16, depth=4, num_heads=2)
train_dataloader = dict(batch_size=16)
val_dataloader = dict(batch_size=180)
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.05, momentum=0.9),
    clip_grad=dict(max_norm=1.0))
max_iters = 4
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
default_hooks = dict(
    checkpoint=dict(interval=2, max_keep_ckpts=2),
    logger=dict(interval=1))
