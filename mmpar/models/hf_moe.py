"""Hugging Face mixture-of-experts layers under mmpar's expert-parallel
protocol (docs/expert_parallel.md).

transformers runs a MoE model's experts module (``MixtralExperts``,
``Qwen3MoeExperts``: stacked ``gate_up_proj`` ``(E, 2I, H)`` and
``down_proj`` ``(E, H, I)``, called with the tokens and their top-k
choices) through the function its config's experts implementation names in
the public ``transformers.integrations.moe.ExpertsInterface`` registry.
:func:`declare_hf_experts` registers :func:`mmpar_experts_forward` there
and selects it with the model's public ``set_experts_implementation``; that
function sorts the token copies by expert and computes them through
:func:`mmpar.parallel.experts.run_local_experts`, the protocol's second
form: under ``parallel.ep`` the copies go to their experts' ranks and come
back there. The router, top-k and the weighting stay Hugging Face's; the
parameters keep their Hugging Face names, so weights go in and out as for
dense models.

The supported experts classes are listed in :data:`SUPPORTED_EXPERTS`
(their model types in :data:`SUPPORTED_MODEL_TYPES`): gated SwiGLU-style
experts, ``[gate; up]`` concatenated, untransposed, without biases.
"""
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from mmpar.parallel.experts import local_experts, run_local_experts

# The name mmpar's experts function has in transformers' ExpertsInterface.
EXPERTS_IMPLEMENTATION = 'mmpar_expert_parallel'
# Experts classes whose forward mmpar's function computes exactly.
SUPPORTED_EXPERTS = ('MixtralExperts', 'Qwen3MoeExperts')
# model_type -> its config's key for the routed experts per layer.
SUPPORTED_MODEL_TYPES = {'mixtral': 'num_local_experts',
                         'qwen3_moe': 'num_experts'}
# What transformers' use_experts_implementation records on the module, as
# mmpar's function computes it.
LAYOUT = dict(has_gate=True, has_bias=False, is_transposed=False,
              is_concatenated=True, has_post_expert_norm=False)
STACKED = ('gate_up_proj', 'down_proj')


def gated_experts(routed: torch.Tensor, counts: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor,
                  act_fn) -> torch.Tensor:
    """Each expert's ``down(act(gate(x)) * up(x))`` over its rows of
    ``routed`` (sorted by expert, ``counts`` rows each), as transformers'
    eager experts compute it.

    Args:
        routed: ``(N, H)``.
        counts: ``(E,)`` rows per expert.
        gate_up: ``(E, 2I, H)``, gate rows then up rows.
        down: ``(E, H, I)``.
        act_fn: the activation.

    Returns:
        ``(N, H)``.
    """
    outs, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = routed[start:start + count]
        start += count
        gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, down[expert]))
    return torch.cat(outs) if outs else routed.new_zeros((0, down.shape[1]))


def mmpar_experts_forward(module: nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """A Hugging Face experts forward (``ExpertsInterface``): the token
    copies sorted by expert, computed on the experts' ranks
    (:func:`run_local_experts`), weighted and summed per token.

    Args:
        module: the experts module (a :data:`SUPPORTED_EXPERTS` class).
        hidden_states: ``(T, H)`` tokens.
        top_k_index: ``(T, k)`` their experts.
        top_k_weights: ``(T, k)`` the experts' weights.

    Returns:
        ``(T, H)``.
    """
    top_k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    counts = torch.bincount(chosen, minlength=module.num_experts)
    order = chosen.argsort(stable=True)
    token_of = order // top_k

    def compute(routed: torch.Tensor, local_counts: torch.Tensor):
        return gated_experts(routed, local_counts,
                             local_experts(module.gate_up_proj),
                             local_experts(module.down_proj), module.act_fn)

    out = run_local_experts(module, hidden_states[token_of], counts, compute)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token_of, out)


def hf_experts_modules(hf_model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The supported experts modules of ``hf_model`` with their names."""
    return [(name, module) for name, module in hf_model.named_modules()
            if type(module).__name__ in SUPPORTED_EXPERTS]


def declare_hf_experts(hf_model: nn.Module) -> int:
    """Make ``hf_model``'s experts modules meet the expert-parallel
    protocol: their stacked parameters declared, their forward mmpar's
    (:func:`mmpar_experts_forward`, one process or ep alike).

    Args:
        hf_model: a transformers model.

    Returns:
        The number of experts modules found (0: a dense model, unchanged).

    Raises:
        ValueError: an experts module laid out otherwise than
            :data:`LAYOUT` (another transformers version).
    """
    found = hf_experts_modules(hf_model)
    if not found:
        return 0
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, mmpar_experts_forward)
    hf_model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    for name, module in found:
        layout = {key: getattr(module, key, None) for key in LAYOUT}
        if layout != LAYOUT:
            raise ValueError(
                f'{name} ({type(module).__name__}) has the layout {layout}; '
                f'mmpar computes {LAYOUT} (another transformers version?)')
        module.expert_parallel_params = STACKED
        module.expert_parallel_group = None
    return len(found)


def check_hf_expert_parallel(hf_config, ep: int, source: str) -> None:
    """Refuse ``parallel.ep=ep`` for a Hugging Face model whose experts it
    cannot split.

    Args:
        hf_config: the transformers config.
        ep: ``parallel.ep`` (> 1).
        source: where the config comes from: ``'model.config'``, or
            ``"model.pretrained='DIR' config.json"``; the keys are named
            under it.

    Raises:
        ValueError: a model_type without supported experts, or an expert
            count ``ep`` does not divide; naming the key, its value and
            what is allowed.
    """
    model_type = hf_config.model_type
    experts_key = SUPPORTED_MODEL_TYPES.get(model_type)
    if experts_key is None:
        raise ValueError(
            f'{source}.model_type={model_type!r} is not allowed with '
            f'parallel.ep={ep}: mmpar splits the experts of '
            f'{", ".join(SUPPORTED_EXPERTS)} only; allowed: model_type '
            f'{" or ".join(map(repr, SUPPORTED_MODEL_TYPES))} (or '
            'parallel.ep=1)')
    num_experts = getattr(hf_config, experts_key)
    if num_experts % ep:
        raise ValueError(
            f'{source}.{experts_key}={num_experts} is not allowed with '
            f'parallel.ep={ep}, which splits each layer\'s experts evenly '
            f'over its ranks; allowed: a multiple of {ep} (or another '
            'parallel.ep)')
