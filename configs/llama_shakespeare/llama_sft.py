# Supervised fine-tuning of the Llama of llama_shakespeare.py on a local
# JSONL instruction set: chats and prompt/response pairs, the loss on the
# answer tokens only, several records packed into each window with
# attention and positions per record (docs/data.md).
#   python tools/train.py configs/llama_shakespeare/llama_sft.py
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_sft.py 2
# The shipped set (1,000 records from Tiny Shakespeare, public domain) is
# made by mmpar/datasets/shakespeare_sft.py. For your own: set `files` to
# JSONL paths, globs or folders. To fine-tune the pretrained byte-level
# Llama instead of a fresh one, train llama_shakespeare.py first and add
#   --cfg-options load_from=work_dirs/llama_shakespeare/iter_1500.pth
# (the rotary tables are not saved, so the longer context loads).
# With an HFTokenizer whose tokenizer has a chat template, records are
# rendered by that template (template=None picks it; 'plain' forces the
# format strings).
_base_ = ['./llama_shakespeare.py']

context_length = 256
max_iters = 300
model = dict(max_seq_len=context_length)
sft = dict(
    type='SFTDataset',
    context_length=context_length,
    tokenizer=None,  # bytes, as the Llama's vocab_size=256
    template=None,  # the tokenizer's chat template if any, else plain
    pack=True,  # records one after another in each window
    document_attention=True,  # positions and attention per record
    truncate='left',  # a record cut to context_length keeps its answer
)
train_dataloader = dict(
    batch_size=16,
    # InfiniteSampler's stream and resume, shuffled without a list of every
    # index (constant memory, docs/data.md).
    sampler=dict(_delete_=True, type='PermutedInfiniteSampler',
                 shuffle=True),
    dataset=dict(_delete_=True,
                 files='mmpar:shakespeare_sft_train.jsonl', **sft))
val_dataloader = dict(
    batch_size=16,
    dataset=dict(_delete_=True, files='mmpar:shakespeare_sft_val.jsonl',
                 **sft))
test_dataloader = val_dataloader

optim_wrapper = dict(optimizer=dict(lr=1e-3))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0,
         end=30),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=0, end=max_iters,
         T_max=max_iters, eta_min=1e-4),
]
train_cfg = dict(by_epoch=False, max_iters=max_iters, val_interval=100)
default_hooks = dict(
    logger=dict(interval=20),
    checkpoint=dict(interval=100))
