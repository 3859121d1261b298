# Supervised fine-tuning of Hugging Face weights (a local save_pretrained
# directory, nothing downloaded) on a local JSONL instruction set, under
# FSDP2: the loss on the answer tokens only (docs/data.md).
#   (export the Llama as in llama_shakespeare_hf_finetune.py, then)
#   bash tools/dist_train.sh configs/hf_finetune/llama_shakespeare_hf_sft.py 2
# Each record is one sample, padded (pack=False): a Hugging Face model has
# no per-record attention in a packed window, so packing would let a record
# attend to the one before it. With an HFTokenizer whose tokenizer has a
# chat template, records are rendered by it (template=None picks it).
# Your own data: files=JSONL paths, globs or folders; your own model:
# --cfg-options model.pretrained=DIR (its vocabulary must match the
# tokenizer: bytes here).
_base_ = ['./llama_shakespeare_hf_finetune.py']

context_length = 128  # the exported Llama's
sft = dict(
    type='SFTDataset',
    context_length=context_length,
    tokenizer=None,  # bytes, as the exported Llama's vocabulary
    template=None,  # the tokenizer's chat template if any, else plain
    pack=False,
    truncate='left',  # a record cut to context_length keeps its answer
)
train_dataloader = dict(
    batch_size=16,
    sampler=dict(_delete_=True, type='PermutedInfiniteSampler',
                 shuffle=True),
    dataset=dict(_delete_=True,
                 files='mmpar:shakespeare_sft_train.jsonl', **sft))
val_dataloader = dict(
    batch_size=16,
    dataset=dict(_delete_=True, files='mmpar:shakespeare_sft_val.jsonl',
                 **sft))
test_dataloader = val_dataloader
