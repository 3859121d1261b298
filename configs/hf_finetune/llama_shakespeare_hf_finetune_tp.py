# The same fine-tuning with tensor parallelism: the 'hf' plan (transformers'
# own split of LlamaForCausalLM), tp=2; DDP over the data axis on 4 ranks.
#   bash tools/dist_train.sh configs/hf_finetune/llama_shakespeare_hf_finetune_tp.py 2
_base_ = ['./llama_shakespeare_hf_finetune.py']

model_wrapper_cfg = dict(_delete_=True, type='MMDistributedDataParallel')
parallel = dict(tp=2, tp_plan='hf')
