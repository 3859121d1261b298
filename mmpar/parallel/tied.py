"""Tied weights against the layout: refused where the layout would untie
them.

A tied weight is one tensor under two parameter names (a language model's
input embedding and output head). Tensor parallelism gives the two modules
different layouts (the embedding split by rows, the head by columns), so each
becomes its own DTensor; a pipeline stage is a copy of the model, so the
embedding on the first stage and the head on the last are two tensors. Either
way each copy then trains on its own gradient, and the run silently differs
from one process from its second step on. Data parallelism (DDP, FSDP1,
FSDP2, naive, bucketed) keeps one tensor and sums both uses' gradients, so it
trains tied weights as one process does.

So under ``parallel.tp > 1`` or ``parallel.pp > 1`` mmpar refuses them: at
the config check, when the model's class says which config key ties its
weights (its classmethod ``tied_weights_key(model_cfg)``, see
:func:`check_tied_model`), and in any case where the model is laid out
(:func:`refuse_shared_parameters`, on the built model, so a user's own
model is covered).
"""
from typing import Any, Callable, Dict, List, Optional, Tuple

from torch import nn

from mmpar.failures import ConfigError

# Why each axis unties shared weights, for the refusal.
UNTIES = dict(
    tp='tensor parallelism gives the tied modules different layouts',
    pp='pipeline parallelism puts the tied modules on different stages')


def untying_axes(tp: Optional[int], pp: Optional[int]) -> Dict[str, int]:
    """The axes of a layout that would untie shared weights, with their
    sizes: ``tp`` and ``pp`` where larger than 1 (None or ``-1``, not
    resolved yet, do not count)."""
    return {axis: size for axis, size in (('tp', tp), ('pp', pp))
            if size is not None and size > 1}


def tied_weights_error(what: str, axes: Dict[str, int],
                       untie: str) -> ConfigError:
    """The refusal of tied weights ``what`` (a config key and its value, or
    the parameter names that share one tensor) under the untying ``axes``
    (:func:`untying_axes`); ``untie`` says how to untie them."""
    layout = ' and '.join(f'parallel.{a}={n}' for a, n in axes.items())
    why = ' and '.join(UNTIES[a] for a in axes)
    return ConfigError(
        f'{what} is not allowed with {layout}: {why}, so each copy would '
        'train on its own gradient and the weights would silently untie; '
        f'allowed: {untie}, or a layout without tp and pp (parallel.tp=1 and '
        'parallel.pp=1, e.g. DDP or FSDP2, which train tied weights as one '
        'process does)')


def shared_parameters(model: nn.Module) -> List[Tuple[str, ...]]:
    """The names of each tensor ``model`` holds under more than one
    parameter name, in registration order.

    ``named_parameters()`` lists a shared tensor once, under its first name;
    ``remove_duplicate=False`` lists every name.
    """
    names = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


def refuse_shared_parameters(model: nn.Module, tp: Optional[int],
                             pp: Optional[int]) -> None:
    """Refuse a model whose parameters share a tensor under ``parallel.tp=
    tp`` or ``parallel.pp=pp`` (larger than 1; else nothing to refuse).

    Raises:
        ConfigError: naming the parameters, the layout and what is allowed.
    """
    axes = untying_axes(tp, pp)
    shared = shared_parameters(model) if axes else []
    if shared:
        names = '; '.join(' and '.join(repr(n) for n in group)
                          for group in shared)
        raise tied_weights_error(
            f'{type(model).__name__}: parameters {names} share one tensor '
            '(tied weights), which', axes,
            'untie them (give each module its own nn.Parameter)')


def check_tied_model(model_cfg: Any, model_class: Callable[[], Any],
                     layout: Any) -> None:
    """At start-up: under ``parallel.tp > 1`` or ``parallel.pp > 1`` a model
    class that can tell from its config whether it ties weights says so (its
    classmethod ``tied_weights_key(model_cfg)`` returns the config key that
    ties them when it is true, e.g. ``'model.tie_embeddings'``, else None:
    Llama, HFCausalLM); any other model is checked when it is laid out
    (:func:`refuse_shared_parameters`).

    Args:
        model_cfg: the ``model`` section.
        model_class: returns the model's class (called under tp or pp only).
        layout: the ``ParallelDims``, or the ``ParallelConfig`` while the
            world size is unknown (its ``tp`` and ``pp``).

    Raises:
        ConfigError: naming the key, the value, the layout and what is
            allowed.
    """
    axes = untying_axes(layout.tp, layout.pp)
    if not axes or not isinstance(model_cfg, dict):
        return
    tied_key = getattr(model_class(), 'tied_weights_key', None)
    key = tied_key(model_cfg) if callable(tied_key) else None
    if key is not None:
        raise tied_weights_error(f'{key}=True', axes, f'{key}=False')
