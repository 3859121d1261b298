"""mmpar's registries: children of MMEngine's, scope ``mmpar``.

A config with ``default_scope = 'mmpar'`` finds mmpar's entries first and
MMEngine's after (a child registry falls back to its parent). Because
``MODEL_WRAPPERS`` is a child of MMEngine's, ``mmengine.model.is_model_wrapper``
and MMEngine's hooks recognise every wrapper registered here.
"""
from mmengine.registry import DATASETS as MMENGINE_DATASETS
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import LOOPS as MMENGINE_LOOPS
from mmengine.registry import METRICS as MMENGINE_METRICS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import Registry

SCOPE = 'mmpar'

MODELS = Registry(
    'model', parent=MMENGINE_MODELS, scope=SCOPE, locations=['mmpar.models'])
MODEL_WRAPPERS = Registry(
    'model_wrapper',
    parent=MMENGINE_MODEL_WRAPPERS,
    scope=SCOPE,
    locations=['mmpar.wrappers'])
DATASETS = Registry(
    'dataset',
    parent=MMENGINE_DATASETS,
    scope=SCOPE,
    locations=['mmpar.datasets'])
METRICS = Registry(
    'metric',
    parent=MMENGINE_METRICS,
    scope=SCOPE,
    locations=['mmpar.evaluation'])
OPTIM_WRAPPERS = Registry(
    'optim_wrapper',
    parent=MMENGINE_OPTIM_WRAPPERS,
    scope=SCOPE,
    locations=['mmpar.optim'])
HOOKS = Registry(
    'hook', parent=MMENGINE_HOOKS, scope=SCOPE, locations=['mmpar.runner'])
LOOPS = Registry(
    'loop', parent=MMENGINE_LOOPS, scope=SCOPE, locations=['mmpar.runner'])
RUNNERS = Registry(
    'runner',
    parent=MMENGINE_RUNNERS,
    scope=SCOPE,
    locations=['mmpar.runner'])

# Named FSDP auto-wrap policies: callables with torch's policy signature
# ``(module, recurse, nonwrapped_numel, **kwargs) -> bool``. Registering them by
# name keeps configs plain data (no ``functools.partial`` in a config file).
FSDP_WRAP_POLICIES = Registry(
    'fsdp wrap policy', scope=SCOPE, locations=['mmpar.wrappers.policies'])
