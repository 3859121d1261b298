# Long context with context parallelism: 1024-byte windows, each split over
# cp=2 ranks (rank r holds chunks r and 3-r of 4, so both do the same
# attention work; keys and values are all-gathered per layer), FSDP2
# sharding every LlamaBlock over dp_shard x cp. On 2 processes: cp=2 (one
# data rank); on 4: cp=2 x dp_shard=2. The loss is the mean over the
# tokens of the whole step, as in one process. docs/context_parallel.md.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_cp.py 4
# Any other Llama config takes it on the command line, too:
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare.py 2 --cfg-options parallel.cp=2
_base_ = ['./llama_shakespeare.py']
context_length = 1024  # a multiple of 2 x cp
model = dict(max_seq_len=context_length)
train_dataloader = dict(
    batch_size=4, dataset=dict(context_length=context_length))
val_dataloader = dict(
    batch_size=8, dataset=dict(context_length=context_length))
test_dataloader = val_dataloader
parallel = dict(cp=2)
model_wrapper_cfg = dict(
    type='MMFullyShard',
    fsdp_auto_wrap_policy=dict(
        type='module_class', module_classes=['LlamaBlock']),
)
checkpoint_format = 'sharded'
