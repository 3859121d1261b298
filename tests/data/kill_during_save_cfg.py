_base_ = ['../../configs/vit_digits/vit_digits.py']
custom_imports = dict(
    imports=['tests.data.kill_during_save'], allow_failed_imports=False)
custom_hooks = [dict(type='KillDuringSaveHook', epoch=2)]
