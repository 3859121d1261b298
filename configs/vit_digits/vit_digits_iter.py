# The default example, iteration-based: 600 iterations, validation and a
# checkpoint every 100. A resume restores the sampler position instead of
# replaying the data loader (mmpar's IterBasedTrainLoop + InfiniteSampler).
_base_ = ['./vit_digits.py']
max_iters = 600
train_dataloader = dict(sampler=dict(type='InfiniteSampler', shuffle=True))
train_cfg = dict(
    _delete_=True, by_epoch=False, max_iters=max_iters, val_interval=100)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=40),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=max_iters,
         T_max=max_iters, eta_min=1e-5),
]
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=100))
log_processor = dict(by_epoch=False)
