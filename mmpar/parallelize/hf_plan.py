"""The ``hf`` tensor-parallel plan: a Hugging Face model's own TP plan.

transformers models carry their split as plain data (``model._tp_plan``:
module-name pattern -> style name). ``tp_plan='hf'`` finds the transformers
model inside an MMEngine model, translates its styles into ``module_plan``
entries (prefixed with where it sits), adds a ``prepare_input`` entry for
each module that holds a colwise -> rowwise pair (its input is then
replicated once for all its column-split layers, and their input gradients
all-reduced once, not once per projection) and applies them. Nothing here
imports transformers: without it no module carries such a plan, and the plan
fails at start-up saying so. A mixture-of-experts layer stays whole on every
tp rank (its experts split over ``parallel.ep``, if set).
"""
from typing import Dict, List, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mmpar.parallelize.module_plan import match_modules, module_plan
from mmpar.registry import TP_PLANS

# transformers style name -> module_plan entry (transformers/distributed/
# tensor_parallel.py registers what each means). The *_gather_output / *_rep
# colwise styles give a replicated output (the LM head's whole vocabulary;
# Phi-3's fused qkv_proj and gate_up_proj, which its code slices and
# chunks); rowwise_split_input / rowwise_rep take a replicated input and cut
# their part locally; embedding_rowwise splits the vocabulary;
# packed_colwise packs [gate; up] (fused=2); replicated_with_grad_allreduce
# is a norm on this rank's heads (Qwen3's q_norm/k_norm). 'replicate' keeps
# the module whole, as mmpar does with a module the plan leaves out. The
# older names local_colwise / local_rowwise are colwise / rowwise.
REPLICATED_OUTPUT = dict(style='colwise', output_layouts='replicate')
SPLIT_INPUT = dict(style='rowwise', input_layouts='replicate')
HF_STYLES = {
    'colwise': 'colwise',
    'local_colwise': 'colwise',
    'rowwise': 'rowwise',
    'local_rowwise': 'rowwise',
    'colwise_rep': REPLICATED_OUTPUT,
    'colwise_gather_output': REPLICATED_OUTPUT,
    'rowwise_rep': SPLIT_INPUT,
    'rowwise_split_input': SPLIT_INPUT,
    'embedding_rowwise': 'rowwise',
    'embedding_colwise': REPLICATED_OUTPUT,
    'packed_colwise': dict(style='colwise', fused=2),
    'replicated_with_grad_allreduce': 'replicate_sharded_input',
    'replicate': None,
}
# Kept whole on every tp rank, with every entry under it: transformers'
# tensor-parallel experts (``moe_tp_experts``: Mixtral's and Qwen3-MoE's
# stacked experts split over tp, their outputs all-reduced). mmpar runs a
# MoE layer whole on each tp rank, its experts split over parallel.ep if
# any, as the Llama plans do (docs/expert_parallel.md, "ep with tp").
WHOLE_STYLES = ('moe_tp_experts', )
# Other expert-parallel and model-specific styles (DeepSeek's MLA
# projection, grouped GEMM experts): no module_plan equivalent.


def find_hf_plan(model: nn.Module) -> Tuple[str, Dict[str, str]]:
    """``(module name, its _tp_plan)`` of the first module carrying one.

    Raises:
        ValueError: no module of ``model`` has a non-empty ``_tp_plan``.
    """
    for name, module in model.named_modules():
        plan = getattr(module, '_tp_plan', None)
        if isinstance(plan, dict) and plan:
            return name, plan
    raise ValueError(
        f"parallel.tp_plan='hf': no module of {type(model).__name__} carries "
        "a Hugging Face tensor-parallel plan (a transformers model's "
        "'_tp_plan'); allowed: a model holding a transformers model with a "
        "TP plan (transformers installed), or another plan")


def megatron_parents(plan: Dict[str, str]) -> List[str]:
    """Patterns of the modules whose direct children in ``plan`` are
    ``colwise`` and ``rowwise`` layers (attention, MLP), with at most norms
    on this rank's heads besides (Qwen3's q/k norms): where the input may be
    laid out once for the whole block. Never the root (its input is token
    ids) nor a module the plan names itself."""
    children: Dict[str, set] = {}
    for pattern, style in plan.items():
        if '.' in pattern:
            children.setdefault(pattern.rsplit('.', 1)[0], set()).add(style)
    pair = {'colwise', 'rowwise'}
    return [parent for parent, styles in children.items()
            if pair <= styles <= pair | {'replicated_with_grad_allreduce'}
            and parent not in plan]


def translate_hf_plan(prefix: str, plan: Dict[str, str],
                      prepare_inputs: bool = True) -> dict:
    """transformers' plan as ``module_plan`` data, names under ``prefix``.

    A :data:`WHOLE_STYLES` module (MoE experts) and the entries under it
    are left out: kept whole on every tp rank.

    Args:
        prefix: where the transformers model sits in the MMEngine model.
        plan: its ``_tp_plan``.
        prepare_inputs: add ``prepare_input`` entries for the
            :func:`megatron_parents` (one reduction of the input gradient
            per block, not per projection).

    Raises:
        ValueError: a style with no ``module_plan`` equivalent, naming it.
    """
    entries = {}
    whole = [p for p, style in plan.items() if style in WHOLE_STYLES]
    for pattern, style in plan.items():
        if any(pattern == w or pattern.startswith(f'{w}.') for w in whole):
            continue
        if style not in HF_STYLES:
            raise ValueError(
                f"parallel.tp_plan='hf': {pattern!r} uses the transformers "
                f'style {style!r}, which mmpar does not translate (expert-'
                'parallel and model-specific styles); allowed: '
                f'{", ".join((*HF_STYLES, *WHOLE_STYLES))}')
        if HF_STYLES[style] is not None:
            entries[f'{prefix}.{pattern}' if prefix else pattern] = \
                HF_STYLES[style]
    for parent in megatron_parents(plan) if prepare_inputs else ():
        entries[f'{prefix}.{parent}' if prefix else parent] = 'prepare_input'
    return entries


def hf_plan_entries(model: nn.Module, prepare_inputs: bool = True) -> dict:
    """The ``module_plan`` entries ``tp_plan='hf'`` applies to ``model``:
    its transformers plan translated (:func:`translate_hf_plan`), less the
    entries that match none of ``model``'s modules. transformers' plan names
    the modules of every layout its config can give: Qwen3-MoE's lists the
    dense ``mlp.gate_proj``, ``up_proj`` and ``down_proj``, which only the
    layers in its ``mlp_only_layers`` have."""
    prefix, plan = find_hf_plan(model)
    entries = translate_hf_plan(prefix, plan, prepare_inputs)
    return {p: e for p, e in entries.items() if match_modules(model, p)}


@TP_PLANS.register_module(name='hf')
def hf(model: nn.Module, tp_mesh: DeviceMesh,
       prepare_inputs: bool = True) -> Dict[str, str]:
    """Split the transformers model inside ``model`` by its own TP plan.

    Args:
        model: the MMEngine model holding a transformers model.
        tp_mesh: the 1-D tensor-parallel mesh.
        prepare_inputs: see :func:`translate_hf_plan`
            (``tp_plan=dict(type='hf', prepare_inputs=False)`` turns it off).
    """
    if not isinstance(prepare_inputs, bool):
        raise ValueError(f"parallel.tp_plan.prepare_inputs={prepare_inputs!r}"
                         " is not allowed; allowed: True or False")
    return module_plan(model, tp_mesh, hf_plan_entries(model, prepare_inputs))
