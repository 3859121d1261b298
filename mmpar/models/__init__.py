from mmpar.models.hf import HFCausalLM
from mmpar.models.llama import (TP_PLAN, TP_PLAN_NO_SP, Llama, LlamaBlock,
                                pipeline_split_points)
from mmpar.models.vit import DigitsViT, TransformerBlock

__all__ = [
    'DigitsViT', 'TransformerBlock', 'Llama', 'LlamaBlock', 'TP_PLAN',
    'TP_PLAN_NO_SP', 'pipeline_split_points', 'HFCausalLM'
]
