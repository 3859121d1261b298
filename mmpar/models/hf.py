"""Any Hugging Face causal LM, built from a config dict, as an MMEngine model.

``transformers`` is an optional dependency (``pip install -e .[hf]``); it is
imported when the model is built, so importing mmpar never needs it.
"""
from typing import Dict, List, Optional, Union

import torch
from mmengine.model import BaseModel

from mmpar.models.lm_loss import lm_outputs, transformer_flops_per_token
from mmpar.registry import MODELS


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
        logits = self.hf_model(input_ids=inputs, use_cache=False).logits
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
