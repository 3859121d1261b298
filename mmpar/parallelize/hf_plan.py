"""The ``hf`` tensor-parallel plan: a Hugging Face model's own TP plan.

transformers models carry their split as plain data (``model._tp_plan``:
module-name pattern -> style name). ``tp_plan='hf'`` finds the transformers
model inside an MMEngine model, translates its styles into ``module_plan``
entries (prefixed with where it sits) and applies them. Nothing here imports
transformers: without it no module carries such a plan, and the plan fails
at start-up saying so.
"""
from typing import Dict, Tuple

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


def translate_hf_plan(prefix: str, plan: Dict[str, str]) -> dict:
    """transformers' plan as ``module_plan`` data, names under ``prefix``.

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
    return entries


@TP_PLANS.register_module(name='hf')
def hf(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the transformers model inside ``model`` by its own TP plan."""
    prefix, plan = find_hf_plan(model)
    module_plan(model, tp_mesh, translate_hf_plan(prefix, plan))
