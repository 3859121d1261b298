# The Shakespeare LM trained with Muon under FSDP2: the blocks' weight
# matrices by Muon (each orthogonalised whole, gathered on one owner rank),
# the embedding, output head and norms by AdamW. docs/muon.md.
#   bash tools/dist_train.sh configs/llama_shakespeare/llama_shakespeare_muon.py 2
# One process, or any other layout, takes the same optimizer:
#   python tools/train.py configs/llama_shakespeare/llama_shakespeare_muon.py
_base_ = ['./llama_shakespeare_fsdp2.py']
optim_wrapper = dict(
    optimizer=dict(
        _delete_=True,
        type='Muon',
        lr=0.02,
        weight_decay=0.1,
        # AdamW's settings for the parameters Muon does not take.
        adamw=dict(lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1),
    ),
)
