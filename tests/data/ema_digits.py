# A short EMA run for the EMA tests (tests/tools/test_ema_end_to_end.py,
# tests/runner/test_ema.py): the digits ViT at 32 wide, 20 iterations of a
# global batch of 64, validation and a full checkpoint every 10, and
# MMEngine's EMAHook as recipes add it. AdamW's eps is raised so that the
# attention's key bias, whose true gradient is zero, does not turn rounding
# noise into steps of size lr (which no two layouts would share).
_base_ = ['../../configs/vit_digits/vit_digits_iter.py']
model = dict(embed_dim=32, depth=4, num_heads=2)
train_dataloader = dict(batch_size=64)  # per data rank: halve it at dp=2
val_dataloader = dict(batch_size=180)
optim_wrapper = dict(optimizer=dict(eps=1e-3))
max_iters = 20
train_cfg = dict(max_iters=max_iters, val_interval=10)
param_scheduler = [
    dict(type='ConstantLR', factor=1.0, by_epoch=False, begin=0,
         end=max_iters)
]
default_hooks = dict(
    checkpoint=dict(by_epoch=False, interval=10),
    logger=dict(interval=10))
custom_hooks = [dict(type='EMAHook', momentum=0.01, update_buffers=True)]
