# The Shakespeare LM with a mixture of experts in every block: 4 SwiGLU
# experts, each token routed to its top 2 (softmax scores), balanced by a
# sequence-wise auxiliary loss (logged as moe_aux_loss, with the tokens each
# expert got as moe_tokens_e<i>). docs/expert_parallel.md.
#   python tools/train.py configs/llama_shakespeare/llama_shakespeare_moe.py
#   (split the experts over ranks: llama_shakespeare_moe_ep.py)
_base_ = ['./llama_shakespeare.py']
model = dict(
    moe=dict(
        num_experts=4,
        top_k=2,
        hidden_dim=128,  # per expert (None: the dense MLP's width)
        score_func='softmax',  # or 'sigmoid' (DeepSeek-V3)
        shared_expert=False,
        balance='aux_loss',  # or 'bias' (no loss term), or None
        aux_loss_weight=0.01,
    ))
