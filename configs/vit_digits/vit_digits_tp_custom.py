# Tensor parallelism for a model written outside mmpar: examples/my_pkg/tp_vit.py
# registers SplittableViT and its blocks when this config imports it, and the
# plan is plain data (attention q/k/v and the MLP's first Linear split by
# columns, the output projections by rows; the attention's input prepared
# once for q/k/v: one all-reduce of its gradient, not three).
#   bash tools/dist_train.sh configs/vit_digits/vit_digits_tp_custom.py 4
# With 4 processes: dp=2 x tp=2. See docs/tensor_parallel.md.
_base_ = ['./vit_digits.py']
custom_imports = dict(
    imports=['examples.my_pkg.tp_vit'], allow_failed_imports=False)
model = dict(
    _delete_=True,
    type='SplittableViT',
    image_size=8,
    patch_size=2,
    embed_dim=64,
    depth=4,
    num_heads=4,
    mlp_ratio=2.0,
)
parallel = dict(
    tp=2,
    tp_plan=dict(
        type='module_plan',
        plan={
            'blocks.*.attn': 'prepare_input',
            'blocks.*.attn.wq': 'colwise',
            'blocks.*.attn.wk': 'colwise',
            'blocks.*.attn.wv': 'colwise',
            'blocks.*.attn.wo': 'rowwise',
            'blocks.*.mlp.fc1': 'colwise',
            'blocks.*.mlp.fc2': 'rowwise',
        }))
