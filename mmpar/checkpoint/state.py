"""Model and optimizer state under any layout, in the plain model's terms.

The model's description (:func:`mmpar.wrappers.describe`) says how: a
pipelined model's stages (:mod:`mmpar.checkpoint.pipeline`), a model whose
tensors are only this rank's part (FSDP, tensor parallelism: gathered by
torch's ``torch.distributed.checkpoint.state_dict`` API, a collective every
rank calls), or a module whose state is whole on every rank. Full
checkpoints of sharded runs key the optimizer state by parameter names, DDP
and one-process runs by index; :func:`localize_optim_state` turns either
into what this process's optim wrapper loads.
"""
import copy
import re
from collections import OrderedDict

from mmengine.optim import OptimWrapper
from mmengine.runner import load_state_dict
from torch import nn

from mmpar.checkpoint import pipeline
from mmpar.failures import ConfigError
from mmpar.wrappers import full_state
from mmpar.wrappers.base import describe
from mmpar.wrappers.local_state import plain_name


def model_state(model: nn.Module) -> dict:
    """The plain model's full state dict, keys as ``model.state_dict()``.

    A collective when the model holds shards (every rank must call it).
    """
    info = describe(model)
    if info.pipeline is not None:
        return pipeline.full_state_dict(info.pipeline)
    if info.holds_shards:
        return full_state.full_state_dict(info.state_module)
    return info.state_module.state_dict()


def optimizer_state(model: nn.Module, optim_wrapper) -> dict:
    """Optimizer state in a form that loads under any wrapper.

    Models holding shards: unsharded and keyed by parameter names, with the
    optim wrapper's own entries (e.g. an AMP loss scaler) kept (collective);
    otherwise the optim wrapper's own state dict (keyed by index).
    """
    info = describe(model)
    if info.pipeline is not None:
        return pipeline.full_optim_state_dict(info.pipeline, optim_wrapper)
    state = optim_wrapper.state_dict()
    if info.holds_shards:
        state.update(full_state.full_optim_state_dict(
            info.state_module, optim_wrapper.optimizer))
    return state


def _revise(state: dict, revise_keys: list) -> dict:
    # torch's per-module state versions ride on the dict (state_dict()'s
    # documented ``_metadata``); keep them, as MMEngine's loader does.
    metadata = getattr(state, '_metadata', None)
    for pattern, replacement in revise_keys:
        state = OrderedDict(
            (re.sub(pattern, replacement, k), v) for k, v in state.items())
    if metadata is not None:
        state._metadata = metadata
    return state


def load_model_state(model: nn.Module, checkpoint: dict, strict: bool,
                     revise_keys: list, every_parameter: bool = False,
                     source: str = 'the checkpoint') -> dict:
    """Load a full checkpoint's weights into ``model`` under any layout
    (every rank calls it); returns the checkpoint.

    Raises:
        ConfigError: ``every_parameter`` and a parameter of a model
            held whole on each rank (one process, DDP, the data-parallel
            wrappers) is not in the checkpoint ``source``.
    """
    info = describe(model)
    state = _revise(checkpoint.get('state_dict', checkpoint), revise_keys)
    if info.pipeline is None and not info.holds_shards:
        if every_parameter:
            _refuse_missing_parameters(info.state_module, state, source)
        # MMEngine's load into a module (its strictness report), as its
        # Runner's load_checkpoint does.
        load_state_dict(info.state_module, state, strict)
        return checkpoint
    if info.pipeline is not None:
        pipeline.load_full_state_dict(info.pipeline, state, strict=strict)
    else:
        info.load_full_state(state, strict)
    return checkpoint


def _refuse_missing_parameters(module: nn.Module, state: dict,
                               source: str) -> None:
    names = [name for name, _ in module.named_parameters()]
    missing = [name for name in names if name not in state]
    if missing:
        raise ConfigError(
            f'{source} lacks {len(missing)} of the {len(names)} parameters '
            f'of {type(module).__name__} ({", ".join(missing[:5])}'
            f'{", ..." if len(missing) > 5 else ""}): they would be '
            'evaluated at their random initialisation. Give the checkpoint '
            "of this config's model")


def _is_full_optim_state(state: dict) -> bool:
    # Full state is keyed by parameter names; a plain optimizer's by index.
    groups = state.get('param_groups') or [{}]
    params = groups[0].get('params') or [None]
    return isinstance(params[0], str)


def _names_for_indices(model: nn.Module, optimizer, saved: dict) -> dict:
    """Index-keyed optimizer state (a DDP or one-process run) by names.

    Index ``i`` is the optimizer's i-th parameter across its groups; this run
    builds its optimizer from the same model in the same order, so the
    current optimizer's parameters name the indices.
    """
    names = {p: plain_name(n) for n, p in model.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g['params']]
    return dict(
        state={order[i]: v for i, v in saved['state'].items()},
        param_groups=[
            dict(g, params=[order[i] for i in g['params']])
            for g in saved['param_groups']
        ])


def localize_optim_state(model: nn.Module, optim_wrapper,
                         checkpoint: dict, resuming: bool = False) -> None:
    """Turn name-keyed optimizer state into this process's form, in place.

    ``checkpoint['optimizer']`` in the full form sharded runs save (or, for a
    model holding shards, the index-keyed form DDP and one-process runs
    save) becomes what ``optim_wrapper.state_dict()`` would return here, so
    MMEngine's ``resume`` loads it with ``optim_wrapper.load_state_dict`` as
    usual. The optimizer itself is left as it was (``load_from`` does not
    restore optimizer state). Anything else is left untouched.

    A pipelined model (its optimizer holds only this rank's stages) takes
    name-keyed state only; index-keyed state (a DDP or one-process run)
    cannot say which index is which of its parameters.

    Raises:
        ConfigError: ``resuming`` a pipelined model from index-keyed
            optimizer state.
    """
    saved = checkpoint.get('optimizer')
    if not (isinstance(saved, dict) and 'param_groups' in saved
            and isinstance(optim_wrapper, OptimWrapper)):
        return
    optimizer = optim_wrapper.optimizer
    info = describe(model)
    if info.pipeline is not None:
        if _is_full_optim_state(saved):
            local = dict(saved)
            local.update(pipeline.localize_optim_state(info.pipeline,
                                                       optimizer, saved))
            checkpoint['optimizer'] = local
        elif resuming:
            # A ConfigError, not CheckpointLoadError: the file is whole, the
            # layout cannot take it, and an older checkpoint of the same run
            # would not do better (resume='auto' tries the previous one on a
            # CheckpointLoadError, with this one's weights already loaded).
            raise ConfigError(
                'resume: this checkpoint holds the optimizer state of a '
                'one-process or DDP run (keyed by index), which a pipelined '
                'model (parallel.pp > 1) cannot match to its stages; allowed: '
                'a checkpoint saved under pp, FSDP or FSDP2, any '
                "checkpoint_format='sharded' one, or load_from (weights only)")
        return
    if _is_full_optim_state(saved):
        full = {k: saved[k] for k in ('state', 'param_groups')}
    elif info.holds_shards:
        # Saved unsharded by index (DDP, one process): resuming it sharded.
        full = _names_for_indices(info.model, optimizer, saved)
    else:
        return
    before = copy.deepcopy(optimizer.state_dict())
    full_state.load_full_optim_state_dict(info.state_module, optimizer, full)
    local = dict(saved)
    local.update(optimizer.state_dict())
    optimizer.load_state_dict(before)
    checkpoint['optimizer'] = local
