# The Llama of llama_shakespeare.py trained on your own corpus: text files
# tokenized once (cached), packed into 128-token windows across documents,
# each token attending only within its document (docs/data.md).
#   python tools/train.py configs/llama_shakespeare/llama_corpus.py
# Here the corpus is the shipped Tiny Shakespeare, one document per speech
# (split at blank lines). For your own: set `files` (paths, globs or
# folders of .txt / .jsonl / .parquet), or tokenize once with
#   python tools/prepare_data.py data/my_corpus FILES... --separator '\n\n'
# and name the shards: sources=[dict(shards='data/my_corpus', weight=1)].
# Several sources are blended by weight.
_base_ = ['./llama_shakespeare.py']

context_length = 128
corpus = [
    dict(files='mmpar:tinyshakespeare.txt.xz', separator='\n\n', weight=1.0)
]
train_dataloader = dict(
    dataset=dict(
        _delete_=True,
        type='PackedTokenDataset',
        sources=corpus,
        split='train',  # each source's first 90%, cut at a document start
        context_length=context_length,
        num_windows=100000,
        mask_boundaries=True,  # no target across a document boundary
        document_attention=True,  # positions and attention per document
    ))
val_dataloader = dict(
    dataset=dict(
        _delete_=True,
        type='PackedTokenDataset',
        sources=corpus,
        split='val',
        context_length=context_length,
        document_attention=True,
    ))
test_dataloader = val_dataloader
