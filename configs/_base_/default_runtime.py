# Runtime settings shared by every example.
default_scope = 'mmpar'

env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    # backend unset: nccl when CUDA is available, gloo otherwise.
    dist_cfg=dict(timeout=1800),
)

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=10),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3),
    sampler_seed=dict(type='DistSamplerSeedHook'),
)

vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='Visualizer', vis_backends=vis_backends)
log_processor = dict(window_size=10, by_epoch=True)
log_level = 'INFO'
randomness = dict(seed=0)
load_from = None
resume = False
