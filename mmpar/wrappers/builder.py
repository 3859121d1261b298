"""Turn ``model_wrapper_cfg`` into a wrapper, validating it first."""
import copy
import functools
import logging
from typing import Optional

# Registers MMEngine's own wrappers, which ``mmengine.NAME`` may still name.
import mmengine.model  # noqa: F401
from mmengine.logging import print_log

from mmengine.registry import DefaultScope
from torch import nn

from mmpar.registry import MODEL_WRAPPERS, SCOPE
from mmpar.wrappers.base import StepMixin

DEFAULT_WRAPPER = 'MMDistributedDataParallel'
# What `parallel.use_fsdp=True` picks when no model_wrapper_cfg is given.
USE_FSDP_WRAPPER = 'MMFullyShardedDataParallel'


def registered_wrappers() -> list:
    """Names a ``model_wrapper_cfg.type`` may take (mmpar's, then
    MMEngine's), without those that cannot wrap a model from a config."""
    MODEL_WRAPPERS.parent.import_from_location()
    classes = {**MODEL_WRAPPERS.parent.module_dict,
               **MODEL_WRAPPERS.module_dict}
    return [name for name in dict.fromkeys([
        *MODEL_WRAPPERS.module_dict, *MODEL_WRAPPERS.parent.module_dict])
            if not _unusable(classes[name])]


def _unusable(cls: type) -> str:
    """Why ``cls`` cannot be a ``model_wrapper_cfg.type`` ('' if it can):
    the Runner trains through the wrapper's ``train_step`` (torch's
    ``DataParallel`` and ``DistributedDataParallel``, in MMEngine's
    registry, have none), and mmpar's pipeline wrapper is built by
    ``pipeline_parallelize``, not from a config."""
    if not callable(getattr(cls, 'train_step', None)):
        return ('cannot wrap a model here: it has no train_step, through '
                "which the Runner trains (torch's classes lack MMEngine's "
                'step interface)')
    if issubclass(cls, StepMixin) and not cls.from_config:
        return ('cannot wrap a model here: mmpar builds it itself from '
                'parallel.pp and parallel.pipeline, not from '
                'model_wrapper_cfg')
    return ''


def wrapper_class(wrapper_type) -> type:
    """Resolve a wrapper type (a registered name or a class).

    Raises:
        ValueError: naming the unknown type, or one that cannot wrap a
            model from a config, and the registered ones that can.
    """
    if isinstance(wrapper_type, type):
        cls = wrapper_type
    else:
        wrapper_type = _mmpar_twin(wrapper_type)
        with DefaultScope.overwrite_default_scope(SCOPE):
            cls = MODEL_WRAPPERS.get(wrapper_type) if isinstance(
                wrapper_type, str) else None
    reason = ('is not a registered model wrapper' if cls is None else
              _unusable(cls))
    if reason:
        name = getattr(wrapper_type, '__name__', wrapper_type)
        raise ValueError(f'model_wrapper_cfg.type={name!r} {reason}; '
                         f'allowed: {", ".join(registered_wrappers())}')
    return cls


def declared(wrapper_type) -> type:
    """The class whose declarations (``shards_parameters``,
    ``tensor_parallel_wrapper``, ...) describe ``wrapper_type``: the class
    itself for mmpar's wrappers; another registry's wrapper declares nothing,
    so :class:`~mmpar.wrappers.base.StepMixin`'s defaults apply.
    """
    cls = wrapper_class(wrapper_type)
    return cls if issubclass(cls, StepMixin) else StepMixin


MMENGINE_PREFIX = 'mmengine.'


def _mmpar_twin(wrapper_type):
    """``'mmengine.NAME'`` -> ``'mmpar.NAME'`` where mmpar has its own NAME.

    mmpar's wrappers keep MMEngine's names (``MMDistributedDataParallel``,
    ``MMFullyShardedDataParallel``) and add what MMEngine's lack on CPU and
    with the parallel layout (the data axis, plain-data checkpoints, CPU
    device ids), so an OpenMMLab config that spells the MMEngine scope gets
    mmpar's class, with a one-line notice. MMEngine wrappers that mmpar does
    not re-implement keep resolving to MMEngine's.
    """
    name = wrapper_type[len(MMENGINE_PREFIX):] if isinstance(
        wrapper_type, str) and wrapper_type.startswith(
            MMENGINE_PREFIX) else None
    if name not in MODEL_WRAPPERS.module_dict:
        return wrapper_type
    _notice_twin(wrapper_type, name)
    return f'{SCOPE}.{name}'


@functools.lru_cache(maxsize=None)
def _notice_twin(wrapper_type: str, name: str) -> None:
    # Once per name and process: the type is resolved at check and build.
    print_log(
        f'model_wrapper_cfg.type={wrapper_type!r}: using mmpar.{name} '
        f'(mmpar re-implements mmengine.{name}; wrappers resolve in the '
        'mmpar scope)',
        logger='current',
        level=logging.WARNING)


def check_wrapper_cfg(model_wrapper_cfg: Optional[dict]) -> None:
    """Validate a wrapper config before any process-group work.

    Checks the type and its arguments: ``sync_strategy`` and
    ``buffer_sync`` for every wrapper, then the class's own ``check_cfg``
    where it has one (mmpar's wrappers; a user's may, with or without
    mmpar's base). The config is not modified.
    """
    if model_wrapper_cfg is None:
        return
    if not isinstance(model_wrapper_cfg, dict):
        raise TypeError('model_wrapper_cfg must be a dict, got '
                        f'{type(model_wrapper_cfg).__name__}')
    cls = wrapper_class(model_wrapper_cfg.get('type', DEFAULT_WRAPPER))
    args = {k: v for k, v in model_wrapper_cfg.items() if k != 'type'}
    StepMixin.check_cfg(args)
    if getattr(cls, 'check_cfg', None) is not None:
        cls.check_cfg(args)


def build_model_wrapper(model_wrapper_cfg: Optional[dict],
                        module: nn.Module,
                        default_args: Optional[dict] = None) -> nn.Module:
    """Build the wrapper ``model_wrapper_cfg`` names around ``module``.

    Args:
        model_wrapper_cfg: ``dict(type=NAME, **kwargs)``; None or a dict
            without ``type`` means ``MMDistributedDataParallel``.
        module: the model to wrap, already on its device.
        default_args: runtime objects for arguments the config does not set
            (as MMEngine's builders take them): compose passes the data
            axis (``process_group`` or ``device_mesh``).

    Returns:
        The wrapper. The user's config dict is not mutated.

    The config was checked once (:func:`check_wrapper_cfg`, called by
    ``check_config``); the constructor turns its values into torch's.
    """
    kwargs = copy.deepcopy(dict(model_wrapper_cfg or {}))
    cls = wrapper_class(kwargs.pop('type', DEFAULT_WRAPPER))
    for key, value in (default_args or {}).items():
        kwargs.setdefault(key, value)
    return cls(module=module, **kwargs)


def default_wrapper_cfg(parallel) -> dict:
    """The ``model_wrapper_cfg`` to use when a config has none.

    Args:
        parallel: a :class:`mmpar.parallel.config.ParallelConfig`.

    Returns:
        ``dict(type='MMFullyShardedDataParallel', cpu_offload=...,
        sharding_strategy=..., sync_module_states=...)`` when ``use_fsdp``,
        else ``dict(type='MMDistributedDataParallel')``. A new dict each call.
    """
    if parallel.use_fsdp:
        return dict(type=USE_FSDP_WRAPPER, **parallel.fsdp_kwargs)
    return dict(type=DEFAULT_WRAPPER)


def check_use_fsdp(parallel, model_wrapper_cfg: Optional[dict]) -> None:
    """``parallel.use_fsdp=True`` only picks the wrapper when none is given.

    Raises:
        ValueError: ``use_fsdp=True`` with an explicit wrapper that does not
            shard (one of the two is a mistake).
    """
    if not parallel.use_fsdp or model_wrapper_cfg is None:
        return
    wrapper = model_wrapper_cfg.get('type', DEFAULT_WRAPPER)
    if not declared(wrapper).shards_parameters:
        name = getattr(wrapper, '__name__', str(wrapper))
        raise ValueError(
            f'parallel.use_fsdp=True but model_wrapper_cfg.type={name!r} '
            'is not FSDP; use_fsdp only picks the wrapper when '
            'model_wrapper_cfg is absent: drop one of them')
