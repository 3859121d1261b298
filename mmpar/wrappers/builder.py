"""Turn ``model_wrapper_cfg`` into a wrapper, validating it first."""
import copy
from typing import Optional

from mmengine.registry import DefaultScope
from torch import nn

from mmpar.registry import MODEL_WRAPPERS, SCOPE
from mmpar.wrappers.base import check_sync_strategy

DEFAULT_WRAPPER = 'MMDistributedDataParallel'


def registered_wrappers() -> list:
    """Names a ``model_wrapper_cfg.type`` may take (mmpar's, then MMEngine's)."""
    MODEL_WRAPPERS.parent.import_from_location()
    names = list(MODEL_WRAPPERS.module_dict)
    names += [n for n in MODEL_WRAPPERS.parent.module_dict if n not in names]
    return names


def wrapper_class(wrapper_type) -> type:
    """Resolve a wrapper type (a registered name or a class).

    Raises:
        ValueError: naming the unknown type and the registered ones.
    """
    if isinstance(wrapper_type, type):
        return wrapper_type
    with DefaultScope.overwrite_default_scope(SCOPE):
        cls = MODEL_WRAPPERS.get(wrapper_type) if isinstance(
            wrapper_type, str) else None
    if cls is None:
        raise ValueError(
            f'model_wrapper_cfg.type={wrapper_type!r} is not a registered '
            f'model wrapper; allowed: {", ".join(registered_wrappers())}')
    return cls


def check_wrapper_cfg(model_wrapper_cfg: Optional[dict]) -> None:
    """Validate a wrapper config before any process-group work.

    Checks the type and, where the wrapper class defines ``check_cfg``, its
    arguments. The config is not modified.
    """
    if model_wrapper_cfg is None:
        return
    if not isinstance(model_wrapper_cfg, dict):
        raise TypeError('model_wrapper_cfg must be a dict, got '
                        f'{type(model_wrapper_cfg).__name__}')
    cls = wrapper_class(model_wrapper_cfg.get('type', DEFAULT_WRAPPER))
    if 'sync_strategy' in model_wrapper_cfg:
        check_sync_strategy(model_wrapper_cfg['sync_strategy'])
    check = getattr(cls, 'check_cfg', None)
    if check is not None:
        check({k: v for k, v in model_wrapper_cfg.items() if k != 'type'})


def build_model_wrapper(model_wrapper_cfg: Optional[dict],
                        module: nn.Module) -> nn.Module:
    """Build the wrapper ``model_wrapper_cfg`` names around ``module``.

    Args:
        model_wrapper_cfg: ``dict(type=NAME, **kwargs)``; None or a dict
            without ``type`` means ``MMDistributedDataParallel``.
        module: the model to wrap, already on its device.

    Returns:
        The wrapper. The user's config dict is not mutated.
    """
    check_wrapper_cfg(model_wrapper_cfg)
    kwargs = copy.deepcopy(dict(model_wrapper_cfg or {}))
    cls = wrapper_class(kwargs.pop('type', DEFAULT_WRAPPER))
    return cls(module=module, **kwargs)
