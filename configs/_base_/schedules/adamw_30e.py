# AdamW, linear warm-up then cosine decay, 30 epochs, validation every epoch.
max_epochs = 30
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-3, weight_decay=0.05),
    clip_grad=dict(max_norm=1.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=40),
    # `end` is set explicitly: MMEngine saves it in checkpoints, so a default
    # tied to max_epochs would not follow a resumed run with more epochs.
    dict(type='CosineAnnealingLR', by_epoch=True, begin=0, end=max_epochs,
         T_max=max_epochs, eta_min=1e-5),
]
train_cfg = dict(by_epoch=True, max_epochs=max_epochs, val_interval=1)
val_cfg = dict()
test_cfg = dict()
