"""Any Hugging Face causal LM, built from a config dict, as an MMEngine model.

``transformers`` is an optional dependency (``pip install -e .[hf]``); it is
imported when the model is built, so importing mmpar never needs it.
"""
from typing import Dict, List, Optional, Union

import torch
from mmengine.model import BaseModel

from mmpar.models.lm_loss import lm_outputs, transformer_flops_per_token
from mmpar.parallelize.context import (ContextParallel,
                                       context_parallel_attention)
from mmpar.parallelize.module_plan import match_modules
from mmpar.registry import MODELS

# The name mmpar's attention goes by in Hugging Face's attention interface.
CP_ATTENTION = 'mmpar_context_parallel'


def import_transformers():
    """``transformers``, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "HFCausalLM needs the optional dependency 'transformers'; "
            "install it with: pip install -e '.[hf]' (or pip install "
            'transformers)') from None
    return transformers


@MODELS.register_module()
class HFCausalLM(BaseModel):
    """``AutoModelForCausalLM.from_config`` (random weights, no download) with
    mmpar's language-model interface.

    Args:
        config: the Hugging Face config as a dict with ``model_type``, e.g.
            ``dict(model_type='llama', vocab_size=256, hidden_size=128,
            intermediate_size=352, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=128)``.
        data_preprocessor: MMEngine data preprocessor config.

    Same batches and outputs as :class:`mmpar.models.Llama`:
    ``forward(inputs, data_samples, mode)`` with token ids ``(B, T)``;
    ``'loss'``, ``'predict'`` and ``'tensor'`` as there. The Hugging Face
    model is ``self.hf_model``; its decoder layer class
    (:attr:`decoder_layer_class`, e.g. ``'LlamaDecoderLayer'``) is the FSDP
    ``module_class`` unit.
    """

    def __init__(self, config: dict,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        transformers = import_transformers()
        if not isinstance(config, dict) or 'model_type' not in config:
            raise ValueError(
                f'HFCausalLM config={config!r} must be a dict with '
                "'model_type' (e.g. 'llama') and that model's config keys")
        kwargs = dict(config)
        model_type = kwargs.pop('model_type')
        try:
            hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
        except ValueError as err:
            raise ValueError(f'HFCausalLM config.model_type={model_type!r}: '
                             f'{err}') from None
        self.hf_config = hf_config
        self.hf_model = transformers.AutoModelForCausalLM.from_config(
            hf_config)
        self._matmul_params = sum(
            p.numel() for n, p in self.hf_model.named_parameters()
            if p is not self.hf_model.get_input_embeddings().weight or
            hf_config.tie_word_embeddings)
        self._init_context_parallel()

    @property
    def decoder_layer_class(self) -> str:
        """Class name of the repeated decoder layer."""
        layers = self.hf_model.base_model.layers
        return type(layers[0]).__name__

    @property
    def max_seq_len(self) -> int:
        """The longest context (``max_position_embeddings``)."""
        return self.hf_config.max_position_embeddings

    def init_weights(self) -> None:
        # from_config initialised every weight already; MMEngine's default
        # would call Hugging Face's init_weights and draw them again.
        pass

    def forward(self,
                inputs: torch.Tensor,
                data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Union[Dict, List, torch.Tensor]:
        logits = self.hf_model(
            input_ids=inputs, use_cache=False,
            position_ids=self._cp_position_ids(inputs)).logits
        return lm_outputs(logits, data_samples, mode)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at ``seq_len`` (6 N plus attention)."""
        cfg = self.hf_config
        head_dim = getattr(cfg, 'head_dim', None) or (
            cfg.hidden_size // cfg.num_attention_heads)
        return transformer_flops_per_token(self._matmul_params,
                                           cfg.num_hidden_layers,
                                           cfg.num_attention_heads, head_dim,
                                           seq_len)

    # -- the context-parallel protocol (mmpar/parallelize/context.py) -------
    # Decoder models whose layers sit in `<base model>.layers` with a
    # `self_attn` (Llama, Mistral, Qwen2, Gemma, ...); for others
    # apply_context_parallel says that the patterns match nothing.
    context_parallel_sharded = ('inputs', 'data_samples')

    def _init_context_parallel(self) -> None:
        self.context_parallel_modules = (
            f'hf_model.{self.hf_model.base_model_prefix}.layers.*.self_attn', )
        for name in match_modules(self, self.context_parallel_modules[0]):
            self.get_submodule(name).context_parallel = None
        self._context_parallel: Optional[ContextParallel] = None
        self._attn_without_cp = self.hf_config._attn_implementation

    @property
    def context_parallel(self) -> Optional[ContextParallel]:
        """The context-parallel setting; setting it also switches the Hugging
        Face attention implementation (to :data:`CP_ATTENTION` and back)."""
        return self._context_parallel

    @context_parallel.setter
    def context_parallel(self, setting: Optional[ContextParallel]) -> None:
        transformers = import_transformers()
        transformers.AttentionInterface.register(CP_ATTENTION,
                                                 hf_context_parallel_attention)
        self.hf_model.set_attn_implementation(
            self._attn_without_cp if setting is None else CP_ATTENTION)
        self._context_parallel = setting

    def _cp_position_ids(self,
                         inputs: torch.Tensor) -> Optional[torch.Tensor]:
        # Rotary embeddings at this rank's positions (None: 0 .. T-1).
        if self._context_parallel is None:
            return None
        positions = self._context_parallel.positions(inputs.shape[1],
                                                     inputs.device)
        return positions.expand(inputs.shape[0], -1)


def hf_context_parallel_attention(module: torch.nn.Module,
                                  query: torch.Tensor,
                                  key: torch.Tensor,
                                  value: torch.Tensor,
                                  attention_mask: Optional[torch.Tensor],
                                  dropout: float = 0.0,
                                  scaling: Optional[float] = None,
                                  **kwargs) -> tuple:
    """:func:`~mmpar.parallelize.context.context_parallel_attention` as a
    Hugging Face attention function (``AttentionInterface``): ``query``
    ``(B, H, t, D)``, ``key``/``value`` ``(B, H_kv, t, D)``; returns the
    output ``(B, t, H, D)`` and no weights. The causal mask comes from the
    chunk layout: Hugging Face builds none for an implementation it does not
    know.

    Raises:
        ValueError: what it cannot do: a padding mask, attention dropout, a
            sliding window or a logit soft-cap.
    """
    unsupported = dict(attention_mask=attention_mask, dropout=dropout or None,
                       sliding_window=kwargs.get('sliding_window'),
                       softcap=kwargs.get('softcap'))
    unsupported = [k for k, v in unsupported.items() if v is not None]
    if unsupported:
        raise ValueError(
            f'context-parallel attention in {type(module).__name__} does not '
            f'support {", ".join(unsupported)} (mark padding with '
            'ignore_index targets instead of an attention mask)')
    out = context_parallel_attention(query, key, value,
                                     module.context_parallel, scale=scaling)
    return out.transpose(1, 2).contiguous(), None
