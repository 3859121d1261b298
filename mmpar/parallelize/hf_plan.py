"""The ``hf`` tensor-parallel plan: a Hugging Face model's own TP plan.

transformers models carry their split as plain data (``model._tp_plan``:
module-name pattern -> style name). ``tp_plan='hf'`` finds the transformers
model inside an MMEngine model, translates its styles into ``module_plan``
entries (prefixed with where it sits), adds a ``prepare_input`` entry for
each module that holds a colwise -> rowwise pair (its input is then
replicated once for all its column-split layers, and their input gradients
all-reduced once, not once per projection) and applies them. Nothing here
imports transformers: without it no module carries such a plan, and the plan
fails at start-up saying so.
"""
from typing import Dict, List, Tuple

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from mmpar.parallelize.module_plan import module_plan
from mmpar.registry import TP_PLANS

# transformers style name -> module_plan entry. The *_gather_output / *_rep
# styles give a replicated output (e.g. the LM head's full-vocabulary
# logits); embedding_rowwise splits the vocabulary.
HF_STYLES = {
    'colwise': 'colwise',
    'rowwise': 'rowwise',
    'colwise_rep': dict(style='colwise', output_layouts='replicate'),
    'colwise_gather_output': dict(style='colwise',
                                  output_layouts='replicate'),
    'rowwise_rep': 'rowwise',
    'embedding_rowwise': 'rowwise',
}


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
    exactly ``colwise`` and ``rowwise`` layers (attention, MLP): where the
    input may be laid out once for the whole block. Never the root (its
    input is token ids) nor a module the plan names itself."""
    children: Dict[str, set] = {}
    for pattern, style in plan.items():
        if '.' in pattern:
            children.setdefault(pattern.rsplit('.', 1)[0], set()).add(style)
    return [parent for parent, styles in children.items()
            if styles == {'colwise', 'rowwise'} and parent not in plan]


def translate_hf_plan(prefix: str, plan: Dict[str, str],
                      prepare_inputs: bool = True) -> dict:
    """transformers' plan as ``module_plan`` data, names under ``prefix``.

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
    for pattern, style in plan.items():
        if style not in HF_STYLES:
            raise ValueError(
                f"parallel.tp_plan='hf': {pattern!r} uses the transformers "
                f'style {style!r}, which mmpar does not translate; allowed: '
                f'{", ".join(HF_STYLES)}')
        entries[f'{prefix}.{pattern}' if prefix else pattern] = \
            HF_STYLES[style]
    for parent in megatron_parents(plan) if prepare_inputs else ():
        entries[f'{prefix}.{parent}' if prefix else parent] = 'prepare_input'
    return entries


@TP_PLANS.register_module(name='hf')
def hf(model: nn.Module, tp_mesh: DeviceMesh,
       prepare_inputs: bool = True) -> None:
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
    prefix, plan = find_hf_plan(model)
    module_plan(model, tp_mesh, translate_hf_plan(prefix, plan,
                                                  prepare_inputs))
