# FSDP1 with a user-defined wrap policy: examples/my_pkg/my_policies.py
# registers `large_linear` in FSDP_WRAP_POLICIES when this config imports it.
#   bash tools/dist_train.sh \
#       configs/vit_digits/vit_digits_fsdp_custom_policy.py 2
_base_ = ['./vit_digits.py']
custom_imports = dict(
    imports=['examples.my_pkg.my_policies'], allow_failed_imports=False)
model_wrapper_cfg = dict(
    type='MMFullyShardedDataParallel',
    fsdp_auto_wrap_policy=dict(type='large_linear', min_weight_numel=4096),
)
