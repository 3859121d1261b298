"""The Runner's optim wrappers: mmpar's, bound to the model.

A config names MMEngine's ``OptimWrapper`` / ``AmpOptimWrapper`` (by name,
``mmengine.``-scoped name or class) and gets mmpar's class of the same name
(:mod:`mmpar.optim.optim_wrapper`), which owns the global-norm clip over
every axis, the gradient-sync policy and the non-finite guard. Each built
optim wrapper is bound to the model once.
"""
from typing import Callable, Optional

import torch
from mmengine.optim import AmpOptimWrapper as MMEngineAmpOptimWrapper
from mmengine.optim import OptimWrapper as MMEngineOptimWrapper
from mmengine.optim import OptimWrapperDict, build_optim_wrapper
from torch import nn

from mmpar.failures import ConfigError
from mmpar.optim import AmpOptimWrapper, OptimWrapper
from mmpar.optim.matrix_constructor import with_matrix_constructor
from mmpar.runner.param_groups import build_with_plain_rules
from mmpar.wrappers.base import StepMixin, describe

# MMEngine's names and classes -> mmpar's classes.
_OURS = {
    'OptimWrapper': OptimWrapper,
    'mmengine.OptimWrapper': OptimWrapper,
    MMEngineOptimWrapper: OptimWrapper,
    'AmpOptimWrapper': AmpOptimWrapper,
    'mmengine.AmpOptimWrapper': AmpOptimWrapper,
    MMEngineAmpOptimWrapper: AmpOptimWrapper,
}


def _ours(cfg: dict) -> dict:
    cfg = with_matrix_constructor(dict(cfg))  # Muon: its routing rule
    given = cfg.get('type', 'OptimWrapper')
    cfg['type'] = _OURS.get(given, given)
    return cfg


def mmpar_optim_wrapper_cfg(cfg: dict) -> dict:
    """``cfg`` with MMEngine's optim wrapper types replaced by mmpar's (a
    dict of several optim wrappers, for an ``OptimWrapperDict``, each)."""
    if 'type' in cfg or 'optimizer' in cfg or 'constructor' in cfg:
        return _ours(cfg)
    return {name: _ours(sub) if isinstance(sub, dict) else sub
            for name, sub in cfg.items()}


def every_stage(model: nn.Module) -> Optional[nn.Module]:
    """What the optimizer must hold for a rank with several pipeline stages
    (virtual stages): all of them. MMEngine's optimizer constructors take a
    wrapper's ``module``, which for a pipelined model is one stage copy (the
    model MMEngine's loops and hooks see), so the other stages' parameters
    would never train. None when the model's ``module`` holds every
    parameter of this rank."""
    parts = describe(model).pipeline
    if parts is None or len(parts.stage_modules) < 2:
        return None
    return nn.ModuleList(parts.stage_modules)


def build_parallel_optim_wrapper(build: Callable, cfg, model: nn.Module,
                                 plain: Optional[nn.Module] = None):
    """``build(cfg)`` (MMEngine's builder) with mmpar's classes, bound to
    ``model``. A config an optimizer constructor builds (``optimizer`` or
    ``constructor`` given) gets every parameter of this rank, all pipeline
    stages included (:func:`every_stage`), with its ``paramwise_cfg`` rules
    applied to ``plain`` (:func:`mmpar.runner.param_groups.plain_view` of
    the model before its layout) when given.

    An optim wrapper class that is not mmpar's (a downstream project's
    subclass of MMEngine's) is adopted, not replaced
    (:mod:`mmpar.optim.adopt`).

    Raises:
        ConfigError: a wrapped model with an ``OptimWrapperDict``.
    """
    if isinstance(cfg, dict):
        cfg = mmpar_optim_wrapper_cfg(cfg)
    stages = every_stage(model)
    optimizer = cfg.get('optimizer') if isinstance(cfg, dict) else None
    constructs = isinstance(cfg, dict) and (
        'constructor' in cfg or (
            optimizer is not None and
            not isinstance(optimizer, torch.optim.Optimizer)))
    if constructs and plain is not None:
        built = build_with_plain_rules(
            cfg, plain, model, model if stages is None else stages)
    elif constructs and stages is not None:
        built = build_optim_wrapper(stages, cfg)
    else:
        built = build(cfg)
    wrappers = list(built.values()) if isinstance(
        built, OptimWrapperDict) else [built]
    if isinstance(model, StepMixin):
        if isinstance(built, OptimWrapperDict):
            raise ConfigError(
                'optim_wrapper: a dict of several optim wrappers (an '
                'OptimWrapperDict) trains only at world size 1: a model '
                'stepping several optimizers runs its own train_step, which '
                "no parallel wrapper can sync; allowed: one optim wrapper")
        for optim_wrapper in wrappers:
            # mmpar's bound as they are; MMEngine's (a downstream subclass)
            # adopted, as the model's train_step would on first use.
            model.parallel_optim_wrapper(optim_wrapper)
    return built
