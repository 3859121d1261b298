# The default example: a small ViT on the 8x8 digits, DDP when launched on
# several processes (bash tools/dist_train.sh THIS_CONFIG 2), unwrapped on one.
_base_ = [
    '../_base_/default_runtime.py',
    '../_base_/datasets/digits.py',
    '../_base_/schedules/adamw_30e.py',
]
model = dict(
    type='DigitsViT',
    image_size=8,
    patch_size=2,
    embed_dim=64,
    depth=4,
    num_heads=4,
    mlp_ratio=2.0,
)
