# Fine-tune Hugging Face weights under FSDP2: HFCausalLM loads a local
# save_pretrained directory (nothing is downloaded) and training continues
# from it. The directory here is the Llama of llama_shakespeare.py, exported:
#   python tools/train.py configs/llama_shakespeare/llama_shakespeare.py
#   python tools/convert_checkpoint.py work_dirs/llama_shakespeare/iter_1500.pth --to hf --config configs/llama_shakespeare/llama_shakespeare.py --out work_dirs/llama_shakespeare_hf
#   bash tools/dist_train.sh configs/hf_finetune/llama_shakespeare_hf_finetune.py 2
# Any other directory: --cfg-options model.pretrained=DIR (its vocabulary
# must match the data's tokenizer: bytes here).
_base_ = ['../llama_shakespeare/llama_shakespeare_hf_fsdp2.py']

max_iters = 300
model = dict(
    _delete_=True,
    type='HFCausalLM',
    pretrained='work_dirs/llama_shakespeare_hf')
optim_wrapper = dict(optimizer=dict(lr=3e-4))
param_scheduler = [
    # `end` explicit: MMEngine saves it, so it must not follow a default.
    dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=max_iters,
         T_max=max_iters, eta_min=3e-5),
]
train_cfg = dict(by_epoch=False, max_iters=max_iters, val_interval=100)
default_hooks = dict(checkpoint=dict(interval=100))
checkpoint_format = 'sharded'
