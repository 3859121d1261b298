"""Check a whole config before anything is built or any process group starts.

MMEngine builds parts lazily (the train loop, the optimizer, the evaluator),
so a typo in ``train_cfg`` or an unregistered optimizer surfaces as a
``TypeError`` or ``KeyError`` minutes into a distributed job, on every rank.
:func:`check_config` finds those mistakes at start-up and raises
:class:`~mmpar.failures.ConfigError` naming the key, the bad value and what
is allowed. It reads the config and never changes it.
"""
import contextlib
import importlib
import inspect
import math
import numbers
import os.path as osp
from typing import Any, Iterable, Iterator, Optional

import torch
from mmengine.hooks import EMAHook
from mmengine.model import BaseAveragedModel

from mmpar.checkpoint.format import (check_async_save, check_published_keys,
                                     checkpoint_format)
from mmpar.checks import check_int, is_int
from mmpar.datasets.packed_check import check_document_attention
from mmpar.device import accelerator_type
from mmpar.dist import BACKENDS, launch_env
from mmpar.failures import ConfigError
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims
from mmpar.parallel.experts import check_expert_model
from mmpar.parallel.tied import check_tied_model
from mmpar.parallel.sequence import SHARDED_ATTR
from mmpar.parallelize.pipeline.schedules import check_evaluates
from mmpar.parallelize.resolved import ResolvedPlan, resolve_plan
from mmpar.parallelize.tensor import splits_sequence
from mmpar.registry import (DATA_SAMPLERS, DATASETS, HOOKS, METRICS, MODELS,
                            OPTIM_WRAPPERS, OPTIMIZERS, PARAM_SCHEDULERS)
from mmpar.wrappers.builder import DEFAULT_WRAPPER, declared, wrapper_class

LOG_LEVELS = ('DEBUG', 'INFO', 'WARNING', 'ERROR', 'CRITICAL')
# Keys of ``train_cfg`` MMEngine's built-in train loops accept.
TRAIN_CFG_KEYS = {
    'type', 'by_epoch', 'max_epochs', 'max_iters', 'val_begin',
    'val_interval', 'dynamic_intervals'
}
# MMEngine requires each of these groups to be all set or all unset.
TOGETHER = (('train_dataloader', 'train_cfg', 'optim_wrapper'),
            ('val_dataloader', 'val_cfg', 'val_evaluator'),
            ('test_dataloader', 'test_cfg', 'test_evaluator'))
WRAPPER_BOOL_KEYS = ('find_unused_parameters', 'broadcast_buffers',
                     'gradient_as_bucket_view', 'static_graph')
WRAPPER_POSITIVE_KEYS = ('bucket_cap_mb', )


def _fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f'{key}={value!r} is not allowed; {allowed}')


def _check_positive_int(key: str, value: Any, minimum: int = 1) -> None:
    check_int(key, value, minimum, error=ConfigError)


def _check_positive_number(key: str, value: Any) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or value <= 0):
        _fail(key, value, 'allowed: a number > 0')


def _import_locations(registry) -> None:
    # Registry.get imports only its own ``locations``, not its parents'
    # (MMEngine's samplers register on import of mmengine.dataset).
    while registry is not None:
        registry.import_from_location()
        registry = registry.parent


def _registered(registry, scope: Optional[str]) -> list:
    """Names ``registry`` resolves under ``scope`` (its own, then parents)."""
    names = []
    with registry.switch_scope_and_registry(scope) as current:
        while current is not None:
            current.import_from_location()
            names += [n for n in current.module_dict if n not in names]
            current = current.parent
    return sorted(names)


def check_type(key: str, section: Any, registry, scope: Optional[str],
               required: bool = True) -> Optional[type]:
    """Check ``section['type']`` names something in ``registry``.

    Returns:
        The registered class, or None if ``type`` is not a string (a class
        given directly) or the section is absent and not required.
    """
    if section is None and not required:
        return None
    if not isinstance(section, dict) and not isinstance(
            section, (type(None), str, numbers.Number, list, tuple)):
        return None  # an object built by the caller (a module, a dataset)
    if not isinstance(section, dict):
        _fail(key, section, f'allowed: a dict with a "type" key from the '
              f'{registry.name} registry')
    if 'type' not in section:
        raise ConfigError(f'{key} has no "type"; allowed: '
                          f'{", ".join(_registered(registry, scope))}')
    name = section['type']
    if not isinstance(name, str):
        return name if inspect.isclass(name) else None
    with registry.switch_scope_and_registry(scope) as scoped:
        _import_locations(scoped)
        cls = scoped.get(name)
    if cls is None:
        _fail(f'{key}.type', name, f'not registered in {registry.name}; '
              f'allowed: {", ".join(_registered(registry, scope))}')
    return cls


def check_custom_imports(custom_imports: Any) -> None:
    """Import ``custom_imports`` now, naming a module that does not exist."""
    if custom_imports is None:
        return
    if not isinstance(custom_imports, dict) or 'imports' not in custom_imports:
        _fail('custom_imports', custom_imports,
              "allowed: dict(imports=['module', ...])")
    imports = custom_imports['imports']
    modules = [imports] if isinstance(imports, str) else imports
    if not isinstance(modules, (list, tuple)):
        _fail('custom_imports.imports', imports, 'allowed: a list of modules')
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            if custom_imports.get('allow_failed_imports', False):
                continue
            _fail('custom_imports.imports', module,
                  f'the module cannot be imported ({err}); allowed: modules '
                  'importable from PYTHONPATH')


def _init_arg_names(cls: type, forwarded: Iterable[str] = ()
                    ) -> Optional[set]:
    """Keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up the
    MRO; where ``cls`` declares what its ``**kwargs`` carry (``forwarded``),
    those; None if the chain ends in an open ``**kwargs``."""
    names = set()
    for klass in cls.__mro__:
        if '__init__' not in vars(klass):
            continue
        params = inspect.signature(vars(klass)['__init__']).parameters
        names.update(n for n, p in params.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))
        if forwarded or not any(p.kind == p.VAR_KEYWORD
                                for p in params.values()):
            return (names | set(forwarded)) - {'self', 'module'}
    return None


def check_init_args(key: str, section: dict, cls: Any,
                    forwarded: Iterable[str] = ()) -> None:
    """Keys of ``section`` that ``cls(...)`` does not take (e.g. a
    misspelt model argument): named here, not reported later as a failure
    of whatever the build was doing (building on the meta device).
    ``forwarded``: what ``cls``'s ``**kwargs`` carry, where it says."""
    allowed = _init_arg_names(cls, forwarded) if inspect.isclass(cls) \
        else None
    if allowed is None:
        return
    for name, value in section.items():
        if name != 'type' and name not in allowed:
            _fail(f'{key}.{name}', value,
                  f'{cls.__name__} takes no argument {name!r}; allowed: '
                  f'{", ".join(sorted(allowed))}')


def check_wrapper_args(wrapper_cfg: Optional[dict]) -> None:
    """Arguments the wrapper class does not take (e.g. FSDP-only keys on
    DDP) and wrong types of common DDP arguments; ``wrapper_cfg`` is the
    config's, already checked by
    :func:`~mmpar.wrappers.builder.check_wrapper_cfg` (type, sync
    strategy, the class's own check)."""
    if wrapper_cfg is None:
        return
    wrapper = wrapper_cfg.get('type', DEFAULT_WRAPPER)
    check_init_args('model_wrapper_cfg', wrapper_cfg, wrapper_class(wrapper),
                    declared(wrapper).forwarded_kwargs)
    for key, value in wrapper_cfg.items():
        if key in WRAPPER_BOOL_KEYS and not isinstance(value, bool):
            _fail(f'model_wrapper_cfg.{key}', value, 'allowed: True, False')
        if key in WRAPPER_POSITIVE_KEYS:
            _check_positive_number(f'model_wrapper_cfg.{key}', value)


def check_dist_cfg(env_cfg: Any) -> None:
    dist_cfg = (env_cfg or {}).get('dist_cfg') or {}
    backend = dist_cfg.get('backend')
    if backend is not None and backend not in BACKENDS:
        _fail('env_cfg.dist_cfg.backend', backend,
              f'allowed: {", ".join(BACKENDS)}')
    # 'nccl' without CUDA is not an error: the Runner warns and uses gloo
    # (mmpar.dist.usable_backend), as OpenMMLab runtimes ask for nccl.
    if 'timeout' in dist_cfg:
        _check_positive_number('env_cfg.dist_cfg.timeout',
                               dist_cfg['timeout'])


SYNC_BN_IMPLEMENTATIONS = ('torch', 'mmcv')


def check_sync_bn(sync_bn: Any, launcher: Optional[str]) -> None:
    """``sync_bn``: MMEngine's SyncBatchNorm conversion, GPU-only.

    A one-process run never converts (the Runner reverts SyncBatchNorm), so
    only a launched run on a machine without CUDA is refused; torch would
    fail deep inside DDP ("SyncBatchNorm layers only work with GPU
    modules").
    """
    if sync_bn is None:
        return
    if sync_bn not in SYNC_BN_IMPLEMENTATIONS:
        _fail('sync_bn', sync_bn, 'allowed: None, ' +
              ', '.join(repr(v) for v in SYNC_BN_IMPLEMENTATIONS))
    if launcher not in (None, 'none') and accelerator_type() != 'cuda':
        _fail('sync_bn', sync_bn,
              'SyncBatchNorm needs CUDA, which is not available; allowed on '
              'CPU: None (unset it, e.g. --cfg-options sync_bn=None): each '
              "rank then normalises with its own batch statistics and the "
              "wrapper's buffer_sync keeps running statistics equal")


def check_dataloader(key: str, loader: Any, scope: Optional[str]) -> None:
    if not isinstance(loader, dict):
        _fail(key, loader, 'allowed: a dict with batch_size and dataset')
    if 'dataset' not in loader:
        raise ConfigError(f'{key} has no "dataset"; allowed: '
                          f'{key}.dataset=dict(type=...)')
    check_type(f'{key}.dataset', loader['dataset'], DATASETS, scope)
    if 'batch_size' in loader:
        _check_positive_int(f'{key}.batch_size', loader['batch_size'])
    if 'num_workers' in loader:
        _check_positive_int(f'{key}.num_workers', loader['num_workers'], 0)
    check_type(f'{key}.sampler', loader.get('sampler'), DATA_SAMPLERS, scope,
               required=False)


def check_optim_wrapper(optim_wrapper: Any, scope: Optional[str]) -> None:
    if not isinstance(optim_wrapper, dict):
        _fail('optim_wrapper', optim_wrapper,
              'allowed: dict(optimizer=dict(type=...), ...)')
    if 'constructor' in optim_wrapper:
        return  # a custom constructor may read any keys
    section = dict(optim_wrapper)
    section.setdefault('type', 'OptimWrapper')
    check_type('optim_wrapper', section, OPTIM_WRAPPERS, scope)
    if 'optimizer' not in optim_wrapper:
        raise ConfigError('optim_wrapper has no "optimizer"; allowed: '
                          'optim_wrapper.optimizer=dict(type=..., lr=...)')
    check_type('optim_wrapper.optimizer', optim_wrapper['optimizer'],
               OPTIMIZERS, scope)
    if 'accumulative_counts' in optim_wrapper:
        _check_positive_int('optim_wrapper.accumulative_counts',
                            optim_wrapper['accumulative_counts'])
    if optim_wrapper.get('clip_grad') is not None:
        check_clip_grad(optim_wrapper['clip_grad'])


# clip_grad's type -> the torch function MMEngine's OptimWrapper hands the
# other keys to (mmpar's global-norm clip takes the same), and its limit.
CLIP_FUNCTIONS = {'norm': (torch.nn.utils.clip_grad_norm_, 'max_norm'),
                  'value': (torch.nn.utils.clip_grad_value_, 'clip_value')}


def check_clip_grad(clip_grad: Any) -> None:
    """``optim_wrapper.clip_grad``: its keys are the clip function's
    arguments, its limit a number > 0 (a negative ``max_norm`` flips every
    gradient: training would ascend), ``norm_type`` a p > 0 or 'inf'."""
    key = 'optim_wrapper.clip_grad'
    if not isinstance(clip_grad, dict):
        _fail(key, clip_grad, 'allowed: None or dict(max_norm=...)')
    clip_type = clip_grad.get('type', 'norm')
    if clip_type not in CLIP_FUNCTIONS:
        _fail(f'{key}.type', clip_type, 'allowed: norm, value')
    function, limit = CLIP_FUNCTIONS[clip_type]
    allowed = list(inspect.signature(function).parameters)[1:]
    for name, value in clip_grad.items():
        if name != 'type' and name not in allowed:
            _fail(f'{key}.{name}', value,
                  f'clip_grad type={clip_type!r} (torch.nn.utils.'
                  f'{function.__name__}) takes no argument {name!r}; '
                  f'allowed: type, {", ".join(allowed)}')
    if limit not in clip_grad:
        raise ConfigError(f'{key} has no {limit!r}; allowed: '
                          f'dict(type={clip_type!r}, {limit}=<a number > 0>)')
    _check_positive_number(f'{key}.{limit}', clip_grad[limit])
    norm_type = clip_grad.get('norm_type', 2.0)
    try:
        p = None if isinstance(norm_type, bool) else float(norm_type)
    except (TypeError, ValueError):
        p = None
    if p is None or not p > 0:  # nan too; 0 would divide by zero
        _fail(f'{key}.norm_type', norm_type,
              "allowed: a number > 0 (the p of the p-norm) or 'inf'")


def check_train_cfg(train_cfg: Any) -> None:
    if not isinstance(train_cfg, dict):
        _fail('train_cfg', train_cfg, 'allowed: dict(max_epochs=...)')
    if 'type' in train_cfg:
        return  # a custom loop may take other keys
    for key in train_cfg:
        if key not in TRAIN_CFG_KEYS:
            _fail(f'train_cfg.{key}', train_cfg[key],
                  f'unknown key {key!r}; allowed: '
                  f'{", ".join(sorted(TRAIN_CFG_KEYS))}')
    for key in ('max_epochs', 'max_iters', 'val_interval'):
        if key in train_cfg:
            _check_positive_int(f'train_cfg.{key}', train_cfg[key])


def check_hooks(cfg: Any, scope: Optional[str]) -> None:
    default_hooks = cfg.get('default_hooks') or {}
    for name, hook in default_hooks.items():
        check_type(f'default_hooks.{name}', hook, HOOKS, scope,
                   required=False)
    checkpoint = default_hooks.get('checkpoint') or {}
    if 'async_save' in checkpoint:
        try:
            check_async_save(checkpoint['async_save'])
        except ValueError as err:
            raise ConfigError(str(err)) from None
    interval = checkpoint.get('interval', 1)
    if interval != -1:  # -1: never save by interval
        if not is_int(interval) or interval < 1:
            _fail('default_hooks.checkpoint.interval', interval,
                  'allowed: an int >= 1, or -1 (never)')
    averaging = []
    for index, hook in enumerate(cfg.get('custom_hooks') or []):
        cls = check_type(f'custom_hooks[{index}]', hook, HOOKS, scope)
        if getattr(cls, 'check_cfg', None) is not None:
            cls.check_cfg({k: v for k, v in hook.items() if k != 'type'})
        if inspect.isclass(cls) and issubclass(cls, EMAHook):
            averaging.append(index)
            check_ema_type(f'custom_hooks[{index}]', hook, scope)
    if len(averaging) > 1:
        _fail(f'custom_hooks[{averaging[1]}]', cfg['custom_hooks'][
            averaging[1]]['type'], f'custom_hooks[{averaging[0]}] is an '
              'EMAHook already, and both would write '
              "checkpoint['ema_state_dict']; allowed: one EMAHook")


def check_ema_type(key: str, hook: dict, scope: Optional[str]) -> None:
    """An ``EMAHook``'s ``ema_type`` names a ``BaseAveragedModel``.

    mmpar averages sharded and pipelined models on each rank's shards
    (:mod:`mmpar.runner.ema`), through ``BaseAveragedModel``'s interface
    (a copy of the model, ``avg_func`` tensor by tensor).
    """

    name = hook.get('ema_type', 'ExponentialMovingAverage')
    try:
        cls = check_type(key, dict(type=name), MODELS, scope)
    except ConfigError as err:  # it names '<key>.type'
        raise ConfigError(str(err).replace(f'{key}.type', f'{key}.ema_type',
                                           1)) from None
    if inspect.isclass(cls) and not issubclass(cls, BaseAveragedModel):
        _fail(f'{key}.ema_type', name,
              'it is not a mmengine.model.BaseAveragedModel, which mmpar '
              'averages on each rank\'s shards; allowed: '
              'ExponentialMovingAverage, MomentumAnnealingEMA, '
              'StochasticWeightAverage or a subclass of BaseAveragedModel')


def check_checkpoint_paths(cfg: Any) -> None:
    load_from = cfg.get('load_from')
    if load_from is None or '://' in str(load_from):
        return
    # A directory is a sharded checkpoint (mmpar/checkpoint/sharded.py).
    if not osp.exists(load_from):
        key = 'load_from (resume)' if cfg.get('resume') else 'load_from'
        _fail(key, load_from, 'the file does not exist; allowed: an '
              'existing checkpoint file or sharded checkpoint directory, '
              'or None')


def _launch_world_size(launcher: Optional[str]) -> Optional[int]:
    """The world size the launcher's environment announces, if it does."""
    if launcher in (None, 'none'):
        return 1
    try:
        return launch_env(launcher).world_size
    except (RuntimeError, ValueError):
        return None  # not started by that launcher (yet): checked later


def check_fused_checkpoints(cfg: Any, plan: ResolvedPlan) -> None:
    """A fused tp split cannot be stored by DCP: refuse sharded checkpoints
    with one at start-up (the save would fail at the first checkpoint).
    ``plan``'s ``tp_plan`` is checked (a ``module_plan``'s entries too)."""
    tp_plan = plan.parallel.tp_plan
    if not isinstance(tp_plan, dict) or tp_plan.get('type') != 'module_plan':
        return
    fused = [pattern for pattern, entry in tp_plan['plan'].items()
             if isinstance(entry, dict) and entry.get('fused', 1) > 1]
    if fused and checkpoint_format(cfg) == 'sharded':
        _fail('checkpoint_format', 'sharded',
              f'parallel.tp_plan splits fused projections part by part '
              f'({", ".join(fused)}), which a sharded checkpoint (DCP) '
              "cannot store; allowed: checkpoint_format='full' with a "
              'fused plan')


# Where a config says its sequence length: dataset keys, then the model's.
SEQ_LEN_KEYS = ('context_length', 'seq_len', 'max_seq_len')


def _seq_len_of(key: str, section: Any, registry,
                scope: Optional[str]) -> Optional[tuple]:
    """``(key, length)`` a dataset or model section gives (or its class's
    default), or None."""
    if not isinstance(section, dict):
        return None
    cls = check_type(key, section, registry, scope, required=False)
    for name in SEQ_LEN_KEYS:
        if name in section:
            return f'{key}.{name}', section[name]
    params = inspect.signature(cls).parameters \
        if isinstance(cls, type) else {}
    for name in SEQ_LEN_KEYS:
        if name in params and is_int(params[name].default):
            return f'{key}.{name}', params[name].default
    return None


def config_seq_lens(cfg: Any) -> list:
    """``[(key, length)]``: the sequence lengths a config names (its data
    sets' ``context_length`` / ``seq_len``, or their classes' defaults; with
    none, the model's ``max_seq_len``)."""
    scope = cfg.get('default_scope')
    loaders = [(name, cfg.get(name)) for name in
               ('train_dataloader', 'val_dataloader', 'test_dataloader')]
    lengths = [_seq_len_of(f'{name}.dataset', loader.get('dataset'),
                           DATASETS, scope)
               for name, loader in loaders if isinstance(loader, dict)]
    if not any(lengths):
        lengths = [_seq_len_of('model', cfg.get('model'), MODELS, scope)]
    return [(key, n) for key, n in filter(None, lengths) if is_int(n)]


def _model_class(cfg: Any) -> Any:
    """The registered class of a ``model`` dict (None for anything else)."""
    model = cfg.get('model')
    return check_type('model', model, MODELS, cfg.get('default_scope'),
                      required=False) if isinstance(model, dict) else None


def check_context_parallel(cfg: Any, dims: Optional[ParallelDims],
                           parallel: ParallelConfig) -> None:
    """With ``parallel.cp > 1``: the model declares the context-parallel
    protocol, and every sequence length the config names (the data sets'
    ``context_length`` / ``seq_len``, else ``model.max_seq_len``) divides by
    ``2 x cp`` (each sequence is cut in ``2 x cp`` equal chunks).

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    cp = dims.cp if dims is not None else parallel.cp
    if cp is None or cp <= 1:
        return
    model_cls = _model_class(cfg)
    if isinstance(model_cls, type) and not hasattr(model_cls, SHARDED_ATTR):
        _fail('parallel.cp', cp,
              f'model.type={cfg["model"].get("type")!r} has no '
              f'context-parallel protocol (no {SHARDED_ATTR}; see '
              'docs/context_parallel.md); allowed: parallel.cp=1, or a '
              'model that declares it (Llama, HFCausalLM)')
    for key, length in config_seq_lens(cfg):
        if length % (2 * cp):
            _fail(key, length,
                  f'with parallel.cp={cp} each sequence is cut into 2 x cp '
                  f'= {2 * cp} equal chunks; allowed: a multiple of '
                  f'{2 * cp} (or another parallel.cp)')


def check_pipeline_evaluation(cfg: Any, plan: ResolvedPlan) -> None:
    """A pipeline whose schedule cannot evaluate (the V schedules) with a
    val loop, which training runs. (A test loop is not refused here: a
    training config commonly inherits one it never runs; the test step
    refuses it.)"""
    pp = plan.dims.pp if plan.dims is not None else \
        plan.parallel.pp or plan.parallel.pipeline_parallelism
    if plan.pipeline is None or pp in (None, 1) or \
            cfg.get('val_dataloader') is None:
        return
    with _as_config_error():
        check_evaluates(plan.pipeline.schedule,
                        'val_dataloader and val_cfg are set, so training '
                        'validates; set them and val_evaluator to None to '
                        'train without validation')


def check_sequence_parallel(cfg: Any, dims: Optional[ParallelDims],
                            parallel: ParallelConfig) -> None:
    """Under a tp plan that splits the sequence (sequence parallelism,
    ``tp_plan='llama'``), every sequence length the config names divides
    by tp; with ``cp > 1`` each cp rank's part does (``length / cp``
    tokens, after :func:`check_context_parallel`'s ``2 x cp`` check).

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    tp = dims.tp if dims is not None else parallel.tp
    cp = (dims.cp if dims is not None else parallel.cp) or 1
    if not is_int(tp) or tp <= 1 or cp < 1 or parallel.tp_plan is None:
        return  # no tp, or a layout not known yet (-1)
    with _as_config_error():
        split = splits_sequence(parallel.tp_plan)
    if not split:
        return
    multiple = cp * math.lcm(2, tp) if cp > 1 else tp
    for key, length in config_seq_lens(cfg):
        if (length // cp) % tp:
            what = f"each cp rank's {length // cp} tokens (parallel.cp=" \
                f'{cp})' if cp > 1 else 'the sequence'
            _fail(key, length,
                  f'parallel.tp_plan={parallel.tp_plan!r} splits {what} '
                  f'over parallel.tp={tp} (sequence parallelism); '
                  f'allowed: a multiple of {multiple}, or a tp plan that '
                  "keeps the sequence whole (Llama: 'llama_no_sp')")


def _check_together(cfg: Any, keys: Iterable[str]) -> None:
    present = [k for k in keys if cfg.get(k) is not None]
    if present and len(present) != len(keys):
        missing = [k for k in keys if k not in present]
        raise ConfigError(f'{", ".join(present)} set but {", ".join(missing)}'
                          f' missing; allowed: all of {", ".join(keys)} or '
                          'none of them')


@contextlib.contextmanager
def _as_config_error() -> Iterator[None]:
    # Checks that live next to what they check (hooks' and wrappers'
    # check_cfg, the parallel section) raise ValueError or TypeError.
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def check_layout(cfg: Any, world_size: Optional[int] = None
                 ) -> ResolvedPlan:
    """The wrapper, ``parallel``, activation-checkpointing and compile
    sections, resolved once into the plan the Runner hands down: what
    ``check_config`` and the plan tool (which plans partial configs) both
    check. At the world size (``world_size``, else the launcher's) the
    layout is resolved (:func:`mmpar.parallel.dims.resolve_dims`, the one
    validator) and checked with the wrapper
    (:func:`mmpar.parallelize.resolved.check_composition`).

    Returns:
        The plan (its ``dims`` None when the world is unknown: the Runner
        resolves it once the process group exists).

    Raises:
        ConfigError: naming the key, the value and what is allowed.
    """
    loader = cfg.get('train_dataloader')
    batch_size = loader.get('batch_size') if isinstance(loader, dict) \
        else None
    with _as_config_error():
        plan = resolve_plan(
            cfg.get('parallel'), cfg.get('model_wrapper_cfg'),
            world_size=world_size or _launch_world_size(cfg.get('launcher')),
            activation_checkpointing=cfg.get('activation_checkpointing'),
            compile_cfg=cfg.get('model_compile'),
            batch_size=batch_size if is_int(batch_size) else None,
            meta_init=cfg.get('meta_init', True),
            find_unused_parameters=bool(cfg.get('find_unused_parameters')))
        check_wrapper_args(plan.given_wrapper_cfg)
    check_context_parallel(cfg, plan.dims, plan.parallel)
    check_sequence_parallel(cfg, plan.dims, plan.parallel)
    layout = plan.dims if plan.dims is not None else plan.parallel
    with _as_config_error():
        check_tied_model(cfg.get('model'), lambda: _model_class(cfg), layout)
        check_expert_model(cfg.get('model'), lambda: _model_class(cfg),
                           layout)
    check_document_attention(cfg, plan.dims.pp if plan.dims is not None else
                             plan.parallel.pp)
    check_pipeline_evaluation(cfg, plan)
    return plan


def check_config(cfg: Any, world_size: Optional[int] = None
                 ) -> ResolvedPlan:
    """Validate a full Runner config (a ``Config`` or dict) up front.

    Args:
        cfg: the config.
        world_size: the number of ranks to check the ``parallel`` layout
            for; None reads it from the launcher's environment (the plan
            tool passes its ``--world-size``).

    Returns:
        The resolved plan (:func:`check_layout`), which the Runner hands
        down, so nothing parses or checks those sections again.

    Raises:
        ConfigError: the first problem found, naming key, value and what is
            allowed.
    """
    # MMEngine's built-ins (samplers, hooks, optimizers, schedulers) register
    # when mmengine.runner imports them; the Runner has done so already.
    import mmengine.runner  # noqa: F401

    check_custom_imports(cfg.get('custom_imports'))
    scope = cfg.get('default_scope')
    if cfg.get('model') is None:
        raise ConfigError('the config has no "model"; allowed: '
                          'model=dict(type=...) from the model registry')
    check_init_args('model', cfg['model'],
                    check_type('model', cfg['model'], MODELS, scope))
    for keys in TOGETHER:
        _check_together(cfg, keys)
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        if cfg.get(key) is not None:
            check_dataloader(key, cfg[key], scope)
    if cfg.get('optim_wrapper') is not None:
        check_optim_wrapper(cfg['optim_wrapper'], scope)
    if cfg.get('train_cfg') is not None:
        check_train_cfg(cfg['train_cfg'])
    for key in ('val_evaluator', 'test_evaluator'):
        evaluator = cfg.get(key)
        for index, metric in enumerate(evaluator if isinstance(
                evaluator, (list, tuple)) else [evaluator]):
            if isinstance(metric, dict) and 'metrics' not in metric:
                check_type(key, metric, METRICS, scope, required=False)
    schedulers = cfg.get('param_scheduler')
    for index, scheduler in enumerate(schedulers if isinstance(
            schedulers, (list, tuple)) else [schedulers]):
        if scheduler is not None:
            check_type(f'param_scheduler[{index}]', scheduler,
                       PARAM_SCHEDULERS, scope)
    check_dist_cfg(cfg.get('env_cfg'))
    check_sync_bn(cfg.get('sync_bn'), cfg.get('launcher'))
    with _as_config_error():
        check_hooks(cfg, scope)
        checkpoint_format(cfg)
        check_published_keys(cfg)
    plan = check_layout(cfg, world_size)
    check_fused_checkpoints(cfg, plan)
    check_checkpoint_paths(cfg)
    if not isinstance(plan.meta_init, bool):
        _fail('meta_init', cfg.get('meta_init'),
              'allowed: True (build a model the layout shards or splits on '
              'the meta device) or False (build it whole on every rank)')
    log_level = cfg.get('log_level', 'INFO')
    if isinstance(log_level, str) and log_level.upper() not in LOG_LEVELS:
        _fail('log_level', log_level, f'allowed: {", ".join(LOG_LEVELS)}')
    seed = (cfg.get('randomness') or {}).get('seed')
    if seed is not None and not is_int(seed):
        _fail('randomness.seed', seed, 'allowed: an int or None')
    return plan
