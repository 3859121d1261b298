"""mmpar's registries: children of MMEngine's, scope ``mmpar``.

A config with ``default_scope = 'mmpar'`` finds mmpar's entries first and
MMEngine's after (a child registry falls back to its parent). Because
``MODEL_WRAPPERS`` is a child of MMEngine's, ``mmengine.model.is_model_wrapper``
and MMEngine's hooks recognise every wrapper registered here.
"""
from typing import Optional

from mmengine.registry import DATA_SAMPLERS as MMENGINE_DATA_SAMPLERS
from mmengine.registry import DATASETS as MMENGINE_DATASETS
from mmengine.registry import EVALUATOR as MMENGINE_EVALUATOR
from mmengine.registry import FUNCTIONS as MMENGINE_FUNCTIONS
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import LOOPS as MMENGINE_LOOPS
from mmengine.registry import METRICS as MMENGINE_METRICS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import LOG_PROCESSORS as MMENGINE_LOG_PROCESSORS
from mmengine.registry import \
    OPTIM_WRAPPER_CONSTRUCTORS as MMENGINE_OPTIM_WRAPPER_CONSTRUCTORS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import OPTIMIZERS as MMENGINE_OPTIMIZERS
from mmengine.registry import PARAM_SCHEDULERS as MMENGINE_PARAM_SCHEDULERS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import TRANSFORMS as MMENGINE_TRANSFORMS
from mmengine.registry import VISBACKENDS as MMENGINE_VISBACKENDS
from mmengine.registry import VISUALIZERS as MMENGINE_VISUALIZERS
from mmengine.registry import \
    WEIGHT_INITIALIZERS as MMENGINE_WEIGHT_INITIALIZERS
from mmengine.registry import Registry

SCOPE = 'mmpar'


def _child(name: str, parent: Optional[Registry],
           *locations: str) -> Registry:
    """mmpar's child of an MMEngine registry (or, without ``parent``, a
    registry of its own); ``locations`` are imported on first lookup, so
    their modules register without an explicit import."""
    return Registry(name, parent=parent, scope=SCOPE,
                    locations=list(locations))


MODELS = _child('model', MMENGINE_MODELS, 'mmpar.models')
MODEL_WRAPPERS = _child('model_wrapper', MMENGINE_MODEL_WRAPPERS,
                        'mmpar.wrappers')
DATASETS = _child('dataset', MMENGINE_DATASETS, 'mmpar.datasets')
METRICS = _child('metric', MMENGINE_METRICS, 'mmpar.evaluation')
OPTIM_WRAPPERS = _child('optim_wrapper', MMENGINE_OPTIM_WRAPPERS,
                        'mmpar.optim')
HOOKS = _child('hook', MMENGINE_HOOKS, 'mmpar.runner')
LOOPS = _child('loop', MMENGINE_LOOPS, 'mmpar.runner')
RUNNERS = _child('runner', MMENGINE_RUNNERS, 'mmpar.runner')

# Children with nothing of mmpar's in them yet: they let a config with
# default_scope='mmpar' build MMEngine's samplers, schedulers and
# visualisers without a "failed to search registry with scope" warning.
DATA_SAMPLERS = _child('data sampler', MMENGINE_DATA_SAMPLERS)
TRANSFORMS = _child('transform', MMENGINE_TRANSFORMS)
# mmpar's whole-matrix optimizers (Muon) and their constructor.
OPTIMIZERS = _child('optimizer', MMENGINE_OPTIMIZERS, 'mmpar.optim')
OPTIM_WRAPPER_CONSTRUCTORS = _child('optimizer wrapper constructor',
                                    MMENGINE_OPTIM_WRAPPER_CONSTRUCTORS,
                                    'mmpar.optim')
PARAM_SCHEDULERS = _child('parameter scheduler', MMENGINE_PARAM_SCHEDULERS)
EVALUATOR = _child('evaluator', MMENGINE_EVALUATOR)
VISUALIZERS = _child('visualizer', MMENGINE_VISUALIZERS)
VISBACKENDS = _child('vis_backend', MMENGINE_VISBACKENDS)
LOG_PROCESSORS = _child('log_processor', MMENGINE_LOG_PROCESSORS)
WEIGHT_INITIALIZERS = _child('weight initializer',
                             MMENGINE_WEIGHT_INITIALIZERS)
FUNCTIONS = _child('function', MMENGINE_FUNCTIONS)

# Named FSDP auto-wrap policies: callables with torch's policy signature
# ``(module, recurse, nonwrapped_numel, **kwargs) -> bool``. Registering them by
# name keeps configs plain data (no ``functools.partial`` in a config file).
FSDP_WRAP_POLICIES = _child('fsdp wrap policy', None,
                            'mmpar.wrappers.policies')

# Named tensor-parallel plans: callables ``plan(model, tp_mesh, **kwargs)``
# that split ``model`` in place (mmpar/parallelize/tensor.py). Model presets
# register next to their model.
TP_PLANS = _child('tensor-parallel plan', None,
                  'mmpar.parallelize.module_plan', 'mmpar.parallelize.hf_plan',
                  'mmpar.models')

# Text tokenizers by name (mmpar/datasets/tokenizer.py): ByteTokenizer,
# HFTokenizer(path) and the shipped ShakespeareBPE.
TOKENIZERS = _child('tokenizer', None, 'mmpar.datasets.tokenizer')


def registered_names(registry: Registry) -> list:
    """The names ``registry`` holds, after importing its locations."""
    registry.import_from_location()
    return sorted(registry.module_dict)


def lookup_callable(registry: Registry, name: str, key: str):
    """The callable registered in ``registry`` as ``name``.

    Args:
        registry: one of mmpar's registries of functions.
        name: the registered name.
        key: the config key, for error messages.

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
        TypeError: an entry that is not callable.
    """
    from mmengine.registry import DefaultScope
    with DefaultScope.overwrite_default_scope(SCOPE):
        entry = registry.get(name)
    if entry is None:
        raise ValueError(
            f'{key}={name!r} is not a registered {registry.name}; '
            f'registered: {", ".join(registered_names(registry))}')
    if not callable(entry):
        raise TypeError(f'{key}={name!r} is registered as {entry!r}, which '
                        'is not callable')
    return entry

# torch's pipeline schedules by name (``parallel.pipeline.schedule``):
# classes from torch.distributed.pipelining (mmpar/parallelize/pipeline/).
PIPELINE_SCHEDULES = _child('pipeline schedule', None,
                            'mmpar.parallelize.pipeline.schedules')
