# A Llama-style byte-level language model (0.9 M parameters) on Tiny
# Shakespeare, iteration-based. One process:
#   python tools/train.py configs/llama_shakespeare/llama_shakespeare.py
# several processes (DDP, as no wrapper is named):
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare.py 2
# batch_size is per process: the global batch is N x 32 windows of 128 bytes.
# docs/llm.md has the loss it reaches, sample text and the other layouts.
_base_ = ['../_base_/default_runtime.py']

context_length = 128
max_iters = 1500
model = dict(
    type='Llama',
    vocab_size=256,  # byte-level tokenizer
    dim=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=None,  # fewer than num_heads: grouped-query attention
    max_seq_len=context_length,
    tie_embeddings=False,
)
train_dataloader = dict(
    batch_size=32,
    num_workers=0,
    # mmpar's InfiniteSampler resumes at the exact batch (no replay).
    sampler=dict(type='InfiniteSampler', shuffle=True),
    collate_fn=dict(type='default_collate'),
    dataset=dict(
        type='ShakespeareDataset',
        split='train',
        context_length=context_length,
        num_windows=100000,
        random_starts=True),
)
val_dataloader = dict(
    batch_size=64,
    num_workers=0,
    sampler=dict(type='DefaultSampler', shuffle=False),
    collate_fn=dict(type='default_collate'),
    # Every non-overlapping window of the last 10% of the text.
    dataset=dict(
        type='ShakespeareDataset',
        split='val',
        context_length=context_length),
)
test_dataloader = val_dataloader
val_evaluator = dict(type='LanguageModelMetric')
test_evaluator = val_evaluator

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(
        type='AdamW', lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1),
    clip_grad=dict(max_norm=1.0),
)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.05, by_epoch=False, begin=0,
         end=100),
    # `end` explicit: MMEngine saves it, so it must not follow a default.
    dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=max_iters,
         T_max=max_iters, eta_min=1e-4),
]
train_cfg = dict(by_epoch=False, max_iters=max_iters, val_interval=500)
val_cfg = dict()
test_cfg = dict()

default_hooks = dict(
    logger=dict(type='LoggerHook', interval=50),
    checkpoint=dict(
        type='CheckpointHook', by_epoch=False, interval=500,
        max_keep_ckpts=2),
)
# tokens_per_s (per rank and total), flops_per_s, and mfu on a known GPU.
custom_hooks = [dict(type='ThroughputHook')]
log_processor = dict(by_epoch=False, window_size=50)
