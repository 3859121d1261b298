# The Shakespeare LM under DDP, named explicitly (the default config picks
# DDP too when launched on several processes).
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_ddp.py 2
_base_ = ['./llama_shakespeare.py']
model_wrapper_cfg = dict(type='MMDistributedDataParallel')
