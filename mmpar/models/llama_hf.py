"""mmpar's :class:`~mmpar.models.Llama` as Hugging Face's ``LlamaForCausalLM``:
the config and the state-dict names.

The two compute the same function from the same tensors, so only names map:

- Rotary layout: mmpar's ``apply_rotary`` pairs dimension ``i`` with
  ``i + head_dim/2`` (half-split), exactly as Hugging Face's ``rotate_half``,
  so ``wq``/``wk`` map unpermuted. (Meta's original checkpoints pair
  adjacent dimensions; Hugging Face's conversion script permutes their q/k
  rows into the half-split layout that both models here share.)
- RMSNorm ``x * rsqrt(mean(x^2) + eps) * weight`` in fp32, SwiGLU
  ``down(silu(gate x) * up x)`` and no biases in both.
"""
import re
from typing import Dict

# mmpar name -> Hugging Face name; {i} is the block index.
NAMES = {
    'tok_embeddings.weight': 'model.embed_tokens.weight',
    'layers.{i}.attn_norm.weight': 'model.layers.{i}.input_layernorm.weight',
    'layers.{i}.attn.wq.weight': 'model.layers.{i}.self_attn.q_proj.weight',
    'layers.{i}.attn.wk.weight': 'model.layers.{i}.self_attn.k_proj.weight',
    'layers.{i}.attn.wv.weight': 'model.layers.{i}.self_attn.v_proj.weight',
    'layers.{i}.attn.wo.weight': 'model.layers.{i}.self_attn.o_proj.weight',
    'layers.{i}.mlp_norm.weight':
    'model.layers.{i}.post_attention_layernorm.weight',
    'layers.{i}.mlp.w1.weight': 'model.layers.{i}.mlp.gate_proj.weight',
    'layers.{i}.mlp.w3.weight': 'model.layers.{i}.mlp.up_proj.weight',
    'layers.{i}.mlp.w2.weight': 'model.layers.{i}.mlp.down_proj.weight',
    'norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}


def _pattern(template: str) -> re.Pattern:
    return re.compile(
        re.escape(template).replace(r'\{i\}', r'(?P<i>\d+)') + '$')


_FROM_HF = [(_pattern(hf), plain) for plain, hf in NAMES.items()]


def plain_name(hf_name: str) -> str:
    """The :class:`Llama` state-dict key of a ``LlamaForCausalLM`` key.

    Raises:
        ValueError: a key with no counterpart, naming it.
    """
    for pattern, plain in _FROM_HF:
        match = pattern.match(hf_name)
        if match:
            return plain.format(**match.groupdict())
    raise ValueError(f'Hugging Face key {hf_name!r} has no counterpart in '
                     "mmpar's Llama")


def hf_config(arch: Dict):
    """The ``LlamaConfig`` of a :class:`Llama` built with ``arch`` (its
    resolved constructor arguments)."""
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=arch['vocab_size'],
        hidden_size=arch['dim'],
        intermediate_size=arch['hidden_dim'],
        num_hidden_layers=arch['num_layers'],
        num_attention_heads=arch['num_heads'],
        num_key_value_heads=arch['num_kv_heads'],
        head_dim=arch['dim'] // arch['num_heads'],
        max_position_embeddings=arch['max_seq_len'],
        rope_theta=arch['rope_theta'],
        rms_norm_eps=arch['norm_eps'],
        tie_word_embeddings=arch['tie_embeddings'],
        hidden_act='silu',
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        architectures=['LlamaForCausalLM'])
