"""Which parameters a whole-matrix optimizer (Muon) takes: the routing rule,
applied from a plain config.

``optim_wrapper = dict(optimizer=dict(type='Muon', lr=0.02))`` is all a
config needs: mmpar's Runner builds it with
:class:`WholeMatrixOptimWrapperConstructor` (when the config names no
``constructor``), which sends each parameter to one of two rules:

* **the whole-matrix rule** (Muon): a parameter with 2 dimensions, of a
  module that is not an ``nn.Embedding`` and whose name is not in
  ``adamw_modules``;
* **AdamW**: everything else: embeddings (and a head tied to one), the
  output head (a module named ``output``, ``lm_head``, ``head`` or
  ``classifier``: the last part of its name, or its whole name, is in
  ``adamw_modules``), norms, biases, anything not 2-D.

Keys of ``optim_wrapper.optimizer`` besides the optimizer's own:
``adamw`` (AdamW's settings: ``lr``, ``betas``, ``eps``, ``weight_decay``...,
torch's defaults otherwise) and ``adamw_modules`` (the head's module names).
A ``paramwise_cfg`` applies as MMEngine's constructor applies it; a group's
lr and decay multipliers then scale the AdamW settings for AdamW's
parameters.

Any optimizer class derived from
:class:`mmpar.optim.matrix_optimizer.WholeMatrixOptimizer` and registered in
``OPTIMIZERS`` gets the same treatment by its registered name; ``'Muon'``
(torch's name, or ``torch.optim.Muon`` itself) means mmpar's
:class:`mmpar.optim.muon.Muon`.
"""
import inspect
from typing import Dict, List, Optional, Sequence

import torch
from mmengine.logging import MMLogger
from mmengine.optim import DefaultOptimWrapperConstructor
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from mmpar.failures import ConfigError
from mmpar.optim.matrix_optimizer import (ADAMW_DEFAULTS, MATRIX,
                                          WholeMatrixOptimizer)
from mmpar.optim.muon import Muon
from mmpar.registry import (OPTIM_WRAPPER_CONSTRUCTORS, OPTIM_WRAPPERS,
                            OPTIMIZERS)

ADAMW_MODULES = ('output', 'lm_head', 'head', 'classifier')
KEY = 'optim_wrapper.optimizer'


def whole_matrix_class(optimizer_type) -> Optional[type]:
    """The :class:`WholeMatrixOptimizer` class an optimizer ``type`` (a
    registered name or a class) means, or None for any other optimizer."""
    # torch's Muon takes only 2-D parameters: its name means mmpar's.
    if optimizer_type is torch.optim.Muon or optimizer_type in ('Muon',
                                                                'torch.Muon'):
        return Muon
    if isinstance(optimizer_type, str):
        optimizer_type = OPTIMIZERS.get(optimizer_type)
    if inspect.isclass(optimizer_type) and issubclass(
            optimizer_type, WholeMatrixOptimizer):
        return optimizer_type
    return None


def with_matrix_constructor(cfg: dict) -> dict:
    """``cfg`` with :class:`WholeMatrixOptimWrapperConstructor` when its
    optimizer is a whole-matrix one and it names no ``constructor``."""
    optimizer = cfg.get('optimizer')
    if 'constructor' in cfg or not isinstance(optimizer, dict) or \
            whole_matrix_class(optimizer.get('type')) is None:
        return cfg
    return dict(cfg, constructor=WholeMatrixOptimWrapperConstructor)


def route(model: nn.Module, adamw_modules: Sequence[str]) -> Dict[int, bool]:
    """``{id(param): True}`` for the whole-matrix rule's parameters of
    ``model``, False for AdamW's (the rule in the module docstring; a
    parameter held by several modules goes to AdamW if one says so)."""
    routes: Dict[int, bool] = {}
    for name, module in model.named_modules():
        head = name in adamw_modules or name.rsplit('.', 1)[-1] in \
            adamw_modules
        for param in module.parameters(recurse=False):
            matrix = param.ndim == 2 and not head and not isinstance(
                module, nn.Embedding)
            routes[id(param)] = routes.get(id(param), True) and matrix
    return routes


def refuse_flat_parameters(model: nn.Module, optimizer_type) -> None:
    """FSDP1 keeps each rank's slice of a flat parameter (several matrices
    end to end, cut at any offset): no matrix can be gathered by its own
    layout, and its 1-D views would all go to AdamW silently."""
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigError(
            f'{KEY}.type={optimizer_type!r} needs whole weight matrices, '
            'and MMFullyShardedDataParallel (FSDP1) holds flat parameters; '
            'allowed: model_wrapper_cfg.type MMFullyShard (FSDP2), '
            'MMDistributedDataParallel, tp / pp layouts, or another '
            f'{KEY}.type')


def _adamw_groups(groups: List[dict], multipliers: List[dict],
                  routes: Dict[int, bool], adamw: dict) -> List[dict]:
    """Each group split by rule; an AdamW part's lr and decay are its
    group's multipliers (``multipliers``, in the order of ``groups``) times
    AdamW's base values."""
    split = []
    for group, multiplier in zip(groups, multipliers):
        for matrix in (True, False):
            params = [p for p in group['params'] if routes[id(p)] == matrix]
            if not params:
                continue
            part = dict(group, params=params, matrix=matrix)
            for key in ('lr', 'weight_decay') if not matrix else ():
                if key in multiplier:
                    part[key] = multiplier[key] * adamw[key]
                else:
                    part.pop(key, None)
            split.append(part)
    return split


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class WholeMatrixOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """MMEngine's constructor for a whole-matrix optimizer: the groups
    routed (module docstring), ``paramwise_cfg`` applied as MMEngine's.

    Raises:
        ConfigError: an optimizer that is not a whole-matrix one, a bad
            ``adamw_modules``, or FSDP1 (:func:`refuse_flat_parameters`).
    """

    def __init__(self, optim_wrapper_cfg: dict,
                 paramwise_cfg: Optional[dict] = None):
        optimizer = dict(optim_wrapper_cfg['optimizer'])
        cls = whole_matrix_class(optimizer.get('type'))
        if cls is None:
            raise ConfigError(
                f'{KEY}.type={optimizer.get("type")!r} is not a whole-matrix'
                ' optimizer; allowed with WholeMatrixOptimWrapperConstructor:'
                ' Muon, or a registered WholeMatrixOptimizer subclass')
        # MMEngine's multipliers scale the optimizer's lr and decay: its
        # defaults where the config leaves them out.
        signature = inspect.signature(cls).parameters
        for key in ('lr', 'weight_decay'):
            if key in signature:
                optimizer.setdefault(key, signature[key].default)
        super().__init__(dict(optim_wrapper_cfg, optimizer=optimizer),
                         paramwise_cfg)
        self.optimizer_class = cls

    def _multipliers(self, model: nn.Module) -> List[dict]:
        """The groups ``paramwise_cfg`` makes with a base lr and weight
        decay of 1: each group's multipliers, which the groups themselves
        (base x multiplier) lose where a base is 0. Not logged again."""
        bases = self.base_lr, self.base_wd
        self.base_lr, self.base_wd = (None if b is None else 1.0
                                      for b in bases)
        logger = MMLogger.get_current_instance()
        disabled, logger.disabled = logger.disabled, True
        multipliers: List[dict] = []
        try:
            self.add_params(multipliers, model)
        finally:
            self.base_lr, self.base_wd = bases
            logger.disabled = disabled
        return multipliers

    def __call__(self, model: nn.Module):
        optimizer_cfg = dict(self.optimizer_cfg)
        optimizer_type = optimizer_cfg.pop('type')
        refuse_flat_parameters(model, optimizer_type)
        adamw_modules = optimizer_cfg.pop('adamw_modules', ADAMW_MODULES)
        if isinstance(adamw_modules, str) or not all(
                isinstance(n, str) for n in adamw_modules):
            raise ConfigError(
                f'{KEY}.adamw_modules={adamw_modules!r}; allowed: a list of '
                'module names, e.g. ["output", "lm_head"]')
        if hasattr(model, 'module'):
            model = model.module
        groups: List[dict] = []
        if self.paramwise_cfg:
            self.add_params(groups, model)
            multipliers = self._multipliers(model)
        else:
            groups = multipliers = [dict(params=list(model.parameters()))]
        adamw = dict(ADAMW_DEFAULTS, **optimizer_cfg.get('adamw') or {})
        groups = _adamw_groups(groups, multipliers,
                               route(model, adamw_modules), adamw)
        try:
            optimizer = self.optimizer_class(groups, **optimizer_cfg)
        except (TypeError, ValueError) as err:
            raise ConfigError(f'{KEY}: {err}') from err
        wrapper_cfg = dict(self.optim_wrapper_cfg)
        wrapper_cfg.setdefault('type', 'OptimWrapper')
        return OPTIM_WRAPPERS.build(wrapper_cfg,
                                    default_args=dict(optimizer=optimizer))
