"""Any Hugging Face causal LM, from a config dict or a local
``save_pretrained`` directory, as an MMEngine model.

``transformers`` is imported when the model is built, so importing mmpar never
needs it (CI installs it from ``requirements-test.txt``; users with
``pip install -e '.[hf]'``). Nothing is downloaded: ``pretrained`` is a local
directory.
"""
import os.path as osp
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from mmengine.model import BaseModel
from torch import nn

from mmpar.models.hf_moe import (check_hf_expert_parallel,
                                  declare_hf_experts)
from mmpar.models.lm_loss import (LMPipelineOutputs, lm_outputs,
                                   transformer_flops_per_token)
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


def _hf_config(transformers, config: dict):
    if not isinstance(config, dict) or 'model_type' not in config:
        raise ValueError(
            f'HFCausalLM config={config!r} must be a dict with '
            "'model_type' (e.g. 'llama') and that model's config keys")
    kwargs = dict(config)
    model_type = kwargs.pop('model_type')
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except ValueError as err:
        raise ValueError(f'HFCausalLM config.model_type={model_type!r}: '
                         f'{err}') from None


def _pretrained_config(transformers, path: str):
    # A path that is not a directory would be taken for a Hub repository
    # id and downloaded: refuse it before transformers sees it.
    if not osp.isdir(path):
        raise FileNotFoundError(
            f'HFCausalLM pretrained={path!r} is not a directory; allowed: a '
            'local directory written by save_pretrained (config.json and '
            'model.safetensors or its index); nothing is downloaded')
    return transformers.AutoConfig.from_pretrained(path,
                                                   local_files_only=True)


def _configured(model_cfg: dict) -> Tuple[Any, str]:
    """The ``model`` section's Hugging Face config, read without building
    the model, and the key it came from (for messages)."""
    transformers = import_transformers()
    pretrained = model_cfg.get('pretrained')
    if pretrained is not None and model_cfg.get('config') is None:
        return (_pretrained_config(transformers, pretrained),
                f'model.pretrained={pretrained!r} config.json')
    return _hf_config(transformers, model_cfg.get('config')), 'model.config'


@MODELS.register_module()
class HFCausalLM(LMPipelineOutputs, BaseModel):
    """A transformers causal LM with mmpar's language-model interface: random
    weights from a config (``AutoModelForCausalLM.from_config``) or trained
    ones from a local directory (``from_pretrained``).

    Args:
        config: the Hugging Face config as a dict with ``model_type``, e.g.
            ``dict(model_type='llama', vocab_size=256, hidden_size=128,
            intermediate_size=352, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=128)``.
        pretrained: a local directory ``save_pretrained`` wrote (config.json
            and safetensors, single or sharded); the weights are loaded in
            fp32. Give ``config`` or ``pretrained``, not both.
        data_preprocessor: MMEngine data preprocessor config.

    Same batches and outputs as :class:`mmpar.models.Llama`:
    ``forward(inputs, data_samples, mode)`` with token ids ``(B, T)``;
    ``'loss'``, ``'predict'`` and ``'tensor'`` as there. The Hugging Face
    model is ``self.hf_model``; its decoder layer class
    (:attr:`decoder_layer_class`, e.g. ``'LlamaDecoderLayer'``) is the FSDP
    ``module_class`` unit. Decoder-only models laid out as Llama (``layers``,
    ``embed_tokens``, ``norm``, ``rotary_emb``, ``lm_head``) also meet the
    pipeline protocol (``parallel.pp``).

    Raises:
        ValueError: neither or both of ``config`` and ``pretrained``, or a
            bad ``config``.
        FileNotFoundError: ``pretrained`` is not a directory.
    """

    # The registered tensor-parallel plan for it: transformers' own plan
    # (tools/plan.py --search tries it for tp > 1 when the config names none).
    default_tp_plan = 'hf'

    def __init__(self,
                 config: Optional[dict] = None,
                 pretrained: Optional[str] = None,
                 data_preprocessor: Optional[dict] = None):
        super().__init__(data_preprocessor=data_preprocessor)
        transformers = import_transformers()
        if (config is None) == (pretrained is None):
            raise ValueError(
                'HFCausalLM needs exactly one of config (a dict with '
                "'model_type': random weights) and pretrained (a local "
                f'save_pretrained directory); got config={config!r}, '
                f'pretrained={pretrained!r}')
        hf_config = _pretrained_config(transformers, pretrained) \
            if pretrained is not None else _hf_config(transformers, config)
        self.hf_model = transformers.AutoModelForCausalLM.from_config(
            hf_config, dtype=torch.float32)
        self.hf_config = self.hf_model.config
        # MoE experts: mmpar's forward, splittable over parallel.ep.
        declare_hf_experts(self.hf_model)
        if pretrained is not None:
            # Copied into the parameters from memory-mapped files: built on
            # the meta device, each rank later reads only its shards.
            from mmpar.models.hf_weights import read_hf_state_dict
            with torch.no_grad():
                self.load_state_dict(read_hf_state_dict(pretrained, self))
        self._matmul_params = sum(
            p.numel() for n, p in self.hf_model.named_parameters()
            if p is not self.hf_model.get_input_embeddings().weight or
            self.hf_config.tie_word_embeddings)
        self._declare_pipeline_parts()
        self._init_context_parallel()

    @classmethod
    def check_expert_parallel(cls, model_cfg: dict, ep: int,
                              pp: Optional[int] = None) -> None:
        """At start-up (:func:`mmpar.parallel.experts.check_expert_model`),
        before any process group:
        refuse ``parallel.ep=ep`` when the configured model's experts
        cannot be split (a dense or unsupported model, an expert count
        ``ep`` does not divide).

        Args:
            model_cfg: the ``model`` section.
            ep: ``parallel.ep`` (1: ep does not split; nothing to check).
            pp: ``parallel.pp`` (not checked here: mmpar adds no router
                loss to Hugging Face models).

        Raises:
            ValueError: naming the key, its value and what is allowed.
        """
        if ep <= 1:
            return
        hf_config, source = _configured(model_cfg)
        check_hf_expert_parallel(hf_config, ep, source)

    @classmethod
    def tied_weights_key(cls, model_cfg: dict) -> Optional[str]:
        """At start-up (:func:`mmpar.parallel.tied.check_tied_model`, under
        tp or pp), before any process group: the key of
        ``tie_word_embeddings`` (``'model.config.tie_word_embeddings'``)
        when the configured model ties its head to its embedding (as set,
        or as its ``model_type`` defaults), else None."""
        hf_config, source = _configured(model_cfg)
        return f'{source}.tie_word_embeddings' \
            if getattr(hf_config, 'tie_word_embeddings', False) else None

    @property
    def decoder_layer_class(self) -> str:
        """Class name of the repeated decoder layer."""
        layers = self.hf_model.base_model.layers
        return type(next(iter(layers))).__name__

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
        return lm_outputs(logits, data_samples, mode,
                          self._context_parallel)

    # -- Hugging Face weights (mmpar/models/hf_weights.py) ----------------------
    @staticmethod
    def hf_to_plain_name(hf_name: str) -> str:
        """This model's key of a Hugging Face key (under ``hf_model``)."""
        return f'hf_model.{hf_name}'

    # -- the pipeline protocol (docs/pipeline_parallel.md) ------------------
    def _declare_pipeline_parts(self) -> None:
        # Declared only for the Llama-like layout this code runs; any other
        # model is refused at start-up by the protocol check, naming what it
        # lacks.
        base = self.hf_model.base_model
        prefix = f'hf_model.{self.hf_model.base_model_prefix}'
        if all(hasattr(base, a)
               for a in ('layers', 'embed_tokens', 'norm', 'rotary_emb')) \
                and hasattr(self.hf_model, 'lm_head'):
            self.pipeline_layers = f'{prefix}.layers'
            self.pipeline_pre = (f'{prefix}.embed_tokens', )
            self.pipeline_post = (f'{prefix}.norm', 'hf_model.lm_head')

    def pipeline_embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf_model.base_model.embed_tokens(tokens)

    def pipeline_layer(self, layer: nn.Module,
                       hidden: torch.Tensor) -> torch.Tensor:
        # What the base model's forward hands each decoder layer: rotary
        # tables for positions 0..T-1 (under cp this rank's positions) and
        # the causal mask (None for sdpa, which is then causal by itself,
        # and for cp's attention, whose chunks carry their own).
        from transformers.masking_utils import create_causal_mask
        base = self.hf_model.base_model
        positions = self._cp_position_ids(hidden)
        if positions is None:
            positions = torch.arange(hidden.shape[1],
                                     device=hidden.device)[None]
        mask = create_causal_mask(
            config=self.hf_config, inputs_embeds=hidden, attention_mask=None,
            past_key_values=None, position_ids=positions)
        return layer(hidden, attention_mask=mask, position_ids=positions,
                     position_embeddings=base.rotary_emb(hidden, positions))

    def pipeline_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.hf_model.lm_head(self.hf_model.base_model.norm(hidden))

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
        # Private: transformers' one record of the attention in use.
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
