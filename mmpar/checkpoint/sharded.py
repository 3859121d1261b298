"""The ``sharded`` checkpoint format: a ``torch.distributed.checkpoint``
(DCP) directory that every rank writes its own shards into, in parallel.

A full checkpoint gathers the whole model and optimizer onto rank 0, which
does not scale to models larger than one rank's memory. A sharded one never
gathers: each rank hands DCP its local shards (FSDP1/FSDP2 DTensors or
ShardedTensors; replicated tensors of DDP and plain models are written once),
and DCP reshards on load, so a checkpoint from 2 ranks resumes on 1 or 4.

Layout of ``epoch_N/`` (or ``iter_N/``)::

    .metadata          DCP's index of the tensors (written last by DCP)
    __*_*.distcp       the tensor data, one file per writing rank
    mmpar_state.pth    everything that is not a tensor, as plain data
                       (meta, message hub, schedulers, optimizer param
                       groups), written by rank 0, loads weights_only=True
    ema/               with an averaged copy (EMAHook): its values, as the
                       model's (a DCP directory of the same keys)

Hooks see stand-ins for the tensors (:mod:`mmpar.checkpoint.refs`), so
MMEngine's ``EMAHook`` swaps ``state_dict`` and ``ema_state_dict`` here as
in a full checkpoint; which part each ends up naming is saved, and a load
reads the model from the part ``state_dict`` names after the hooks ran.

Only tensors go to DCP: DCP stores other objects with ``torch.save`` and
reads them back with ``torch.load(weights_only=False)``; keeping them in
``mmpar_state.pth`` keeps them plain data. (DCP's own ``.metadata`` index is
a pickle that torch reads with ``pickle.load``: load sharded checkpoints
only from sources you trust.)

The directory is written under ``NAME.tmp`` and renamed to ``NAME`` when
complete, before CheckpointHook moves ``last_checkpoint``.
"""
import copy
import os
import os.path as osp
import shutil
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from mmengine.dist import barrier, is_distributed, is_main_process
from mmengine.optim import OptimWrapper
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                     get_state_dict,
                                                     set_model_state_dict,
                                                     set_state_dict)

from mmpar.checkpoint import pipeline
from mmpar.checkpoint.background import BackgroundSave
from mmpar.checkpoint.files import (CheckpointLoadError, atomic_save,
                                    is_complete_file, load_checkpoint_file)
from mmpar.checkpoint.refs import (MODEL_PART, StoredTensor, pack_refs,
                                   stand_ins, stored_part, unpack_refs)
from mmpar.checkpoint.shadow import swapped_in
from mmpar.dist import all_gather_objects
from mmpar.failures import ConfigError
from mmpar.parallel.dtensor import packed_parameters
from mmpar.wrappers.base import describe

PLAIN_FILE = 'mmpar_state.pth'
DCP_METADATA = '.metadata'
_OPTIM_KEYS = ('state', 'param_groups')


def _optimizer(optim_wrapper) -> Optional[torch.optim.Optimizer]:
    if isinstance(optim_wrapper, OptimWrapper):
        return optim_wrapper.optimizer
    return None


def is_sharded_checkpoint(path: str) -> bool:
    """Whether ``path`` is a directory (complete or not) of this format."""
    return osp.isdir(path)


def is_complete_sharded_checkpoint(path: str) -> bool:
    """A directory with DCP's index and a whole plain-data file."""
    return (osp.isdir(path) and osp.isfile(osp.join(path, DCP_METADATA))
            and is_complete_file(osp.join(path, PLAIN_FILE)))


def split_tensors(tree: Any) -> Tuple[Any, Any]:
    """``(tensors, rest)``: nested dicts split into the tensor leaves and all
    other leaves, each keeping the dict structure. ``None`` for an empty
    side (an empty dict stays on the ``rest`` side)."""
    if isinstance(tree, torch.Tensor):
        return tree, None
    if not isinstance(tree, dict) or not tree:
        return None, tree
    tensors, rest = {}, {}
    for key, value in tree.items():
        tensor_part, rest_part = split_tensors(value)
        if tensor_part is not None:
            tensors[key] = tensor_part
        if rest_part is not None:
            rest[key] = rest_part
    return tensors or None, rest or None


def merge(tensors: Any, rest: Any) -> Any:
    """Undo :func:`split_tensors`."""
    if tensors is None:
        return rest
    if rest is None:
        return tensors
    merged = dict(rest)
    for key, value in tensors.items():
        merged[key] = merge(value, rest.get(key))
    return merged


def _quiet(dcp_call, *args, **kwargs):
    # Single-process without a process group (no_dist), where DCP warns
    # "torch.distributed is disabled ... assuming the intent is to
    # save/load in a single process" on every call.
    kwargs.setdefault('no_dist', not is_distributed())
    with warnings.catch_warnings():
        warnings.filterwarnings(
            'ignore', message='torch.distributed is disabled')
        return dcp_call(*args, **kwargs)


def _load_tensors(state: dict, path: str, partial: bool) -> None:
    """``dcp.load`` into ``state`` in place; a failure names the directory.

    Raises:
        CheckpointLoadError: a shard file is missing, truncated or corrupt,
            or the checkpoint lacks tensors ``state`` needs.
    """
    from torch.distributed.checkpoint import DefaultLoadPlanner
    try:
        _quiet(dcp.load, state, checkpoint_id=path,
               planner=DefaultLoadPlanner(allow_partial_load=partial))
    # DCP's CheckpointException (failures of any rank) is a BaseException.
    except (Exception, CheckpointException) as err:
        lines = str(err).strip().splitlines()
        raise CheckpointLoadError(
            f'cannot load sharded checkpoint {path!r}: a shard is missing, '
            f'corrupt or does not match this model ({type(err).__name__}: '
            f'{lines[-1] if lines else ""}). Resume from an earlier '
            'checkpoint in the same directory instead.') from None


def distributed_state(model: nn.Module,
                      optimizer: Optional[torch.optim.Optimizer]
                      ) -> Tuple[dict, Optional[dict]]:
    """``(model_state, optim_state)`` as DCP takes them: the plain model's
    names, this rank's shards. torch's ``get_state_dict`` on the module
    that holds the plain names, or for a pipelined model (whose optimizer
    spans several stage copies) :mod:`mmpar.checkpoint.pipeline`'s."""
    info = describe(model)
    if info.pipeline is not None:
        return pipeline.distributed_state_dict(info.pipeline, optimizer)
    module = info.state_module
    if optimizer is None:
        return get_state_dict(module, [])[0], None
    return get_state_dict(module, optimizer)


def _set_distributed_state(model: nn.Module,
                           optimizer: Optional[torch.optim.Optimizer],
                           model_state: dict, optim_state: Optional[dict],
                           strict: bool) -> None:
    """Load what DCP read into :func:`distributed_state`'s dicts."""
    info = describe(model)
    if info.pipeline is not None:
        pipeline.load_distributed_state_dict(info.pipeline, optimizer,
                                             model_state, optim_state, strict)
    elif optim_state is None:
        set_model_state_dict(info.state_module, model_state,
                             options=StateDictOptions(strict=strict))
    else:
        set_state_dict(info.state_module, optimizer,
                       model_state_dict=model_state,
                       optim_state_dict=optim_state,
                       options=StateDictOptions(strict=strict))


def _all_keys(keys: list) -> list:
    # Every rank's model keys, in order of first appearance by rank: a
    # pipelined rank holds only its stages' keys.
    return list(OrderedDict.fromkeys(
        k for part in all_gather_objects(keys) for k in part))


def save_sharded(model: nn.Module,
                 optim_wrapper: Optional[OptimWrapper],
                 path: str,
                 extras: dict,
                 save_optimizer: bool = True,
                 before_write: Optional[Callable[[dict], None]] = None,
                 shadows: Optional[Dict[str, nn.Module]] = None,
                 background: Optional[BackgroundSave] = None) -> None:
    """Write a sharded checkpoint to directory ``path``; every rank calls it.

    Args:
        model: the (wrapped) model.
        optim_wrapper: its optim wrapper; needed with ``save_optimizer``.
        path: the directory to write (via ``path + '.tmp'``).
        extras: the plain-data part besides model and optimizer (``meta``,
            ``message_hub``, schedulers, RNG states); not modified.
        save_optimizer: also save the optimizer state.
        before_write: called on rank 0 with the plain-data part just before
            it is written (the Runner's ``before_save_checkpoint`` hooks);
            its ``state_dict`` holds stand-ins for the model's tensors
            (:mod:`mmpar.checkpoint.refs`).
        shadows: part name -> a shadow of the model
            (:mod:`mmpar.checkpoint.shadow`, e.g. an averaged copy), each
            written as the model's state into ``path/<part>``.
        background: write asynchronously on it: this returns once the
            tensors are staged (copied to host memory by DCP's
            ``async_save``) and the plain-data part is built; the write,
            the plain file and the rename into ``path`` follow in its
            thread (:mod:`mmpar.checkpoint.background`). Shadows are
            written before this returns.

    Raises:
        TypeError: ``save_optimizer`` without an ``OptimWrapper``.
    """
    optimizer = _optimizer(optim_wrapper) if save_optimizer else None
    if save_optimizer and optimizer is None:
        raise TypeError('optim_wrapper must be an OptimWrapper, got '
                        f'{type(optim_wrapper).__name__}')
    model_state, optim_state = distributed_state(model, optimizer)
    not_tensors = [
        k for k, v in model_state.items() if not isinstance(v, torch.Tensor)
    ]
    if not_tensors:
        # DCP would pickle them (and unpickle with weights_only=False).
        raise ValueError(
            f"checkpoint_format='sharded' saves tensors only; the model's "
            f'state entries {not_tensors} are not tensors. Use '
            "checkpoint_format='full'")
    packed = packed_parameters(model)
    if packed:
        # DCP sees a strided part's rows as overlapping chunks and fails.
        raise ConfigError(
            "checkpoint_format='sharded' cannot store the fused tp "
            f'parameters {packed[:4]} (parallel.tp_plan: '
            "dict(style='colwise', fused=k)); allowed: "
            "checkpoint_format='full' with a fused plan")
    plain = dict(extras)
    plain['model_keys'] = _all_keys(list(model_state))
    tensors = {'model': model_state}
    if optim_state is not None:
        tensors['optimizer'], plain['optimizer'] = split_tensors(optim_state)
        # The optim wrapper's own entries (e.g. an AMP loss scaler).
        plain['optim_wrapper'] = {
            k: v
            for k, v in optim_wrapper.state_dict().items()
            if k not in _OPTIM_KEYS
        }
    shadows = shadows or {}
    tmp = f'{path}.tmp'
    if is_main_process():
        if osp.isdir(tmp):  # left by an interrupted save
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        for part in shadows:
            os.makedirs(osp.join(tmp, part))
    barrier()
    for part, shadow in shadows.items():
        _save_shadow(model, shadow, osp.join(tmp, part))
    if is_main_process():
        plain['state_dict'] = stand_ins(MODEL_PART, plain['model_keys'])
        if before_write is not None:
            before_write(plain)
        pack_refs(plain)
    if background is None:
        # Collective: each rank writes its shards; returns once DCP's
        # coordinator has written .metadata.
        _quiet(dcp.save, tensors, checkpoint_id=tmp)
        if is_main_process():
            _finish(plain, tmp, path)
        barrier()
        return
    # Collective (DCP stages every tensor before it returns); the write
    # and DCP's plan exchange go on on the writer group.
    written = _quiet(dcp.async_save, tensors, checkpoint_id=tmp,
                     process_group=background.group())
    plain = copy.deepcopy(plain) if is_main_process() else None

    def finish() -> None:
        written.result()  # every rank's data and .metadata are on disk
        if plain is not None:
            _finish(plain, tmp, path)

    background.start(path, finish)


def _finish(plain: dict, tmp: str, path: str) -> None:
    # Rank 0, once DCP has written every rank's shards and .metadata: the
    # plain part, then the rename that makes the checkpoint visible.
    atomic_save(plain, osp.join(tmp, PLAIN_FILE))
    if osp.isdir(path):
        shutil.rmtree(path)
    elif osp.exists(path):
        os.remove(path)
    os.replace(tmp, path)


def _save_shadow(model: nn.Module, shadow: nn.Module, directory: str) -> None:
    # Collective: the shadow's values written as the model's state.
    with swapped_in(model, shadow):
        # Its buffers, as the model's, equal over the data axis first.
        describe(model).sync_buffers()
        state, _ = distributed_state(model, None)
        _quiet(dcp.save, {'model': state}, checkpoint_id=directory)


def load_into_shadow(model: nn.Module, shadow: nn.Module, path: str,
                     part: str) -> None:
    """Load part ``part`` of sharded checkpoint ``path`` into the shadow,
    through the model (every rank calls it). Keys the part lacks keep their
    values."""
    with swapped_in(model, shadow):
        _load_model(model, _part_dir(path, part), strict=False)


def _load_model(model: nn.Module, directory: str, strict: bool) -> None:
    # The model's tensors only. Not strict (load_from's default): keys the
    # checkpoint lacks keep their current values, as
    # nn.Module.load_state_dict(strict=False).
    state, _ = distributed_state(model, None)
    _load_tensors({'model': state}, directory, partial=not strict)
    _set_distributed_state(model, None, state, None, strict)


def _part_dir(path: str, part: Optional[str]) -> str:
    return path if part in (None, MODEL_PART) else osp.join(path, part)


def load_plain_state(path: str) -> dict:
    """The plain-data part of sharded checkpoint ``path``.

    Raises:
        FileNotFoundError / CheckpointLoadError: it is missing or not whole
            (an interrupted save), naming the file.
    """
    if not osp.isfile(osp.join(path, DCP_METADATA)):
        raise FileNotFoundError(
            f'{path!r} is a directory but not a complete sharded checkpoint '
            f'(no {DCP_METADATA}); resume from an earlier checkpoint instead')
    return load_checkpoint_file(osp.join(path, PLAIN_FILE))


def load_sharded(model: nn.Module,
                 optim_wrapper: Optional[OptimWrapper],
                 path: str,
                 strict: bool,
                 after_read: Optional[Callable[[dict], None]] = None) -> dict:
    """Load sharded checkpoint ``path`` into ``model``; every rank calls it.

    Args:
        model: the (wrapped) model.
        optim_wrapper: its optim wrapper, or None (weights only).
        path: the checkpoint directory.
        strict: keys must match exactly.
        after_read: called with the plain-data part once read, before any
            tensor is loaded (the Runner's ``after_load_checkpoint`` hooks).

    Returns the plain part, with ``optimizer`` (if saved and an optim wrapper
    is given) in the form ``optim_wrapper.state_dict()`` has in this
    process, so MMEngine's ``resume`` loads it as usual. The optimizer itself
    is left as it was (``load_from`` does not restore optimizer state).
    """
    checkpoint = load_plain_state(path)
    unpack_refs(checkpoint, path, checkpoint.get('model_keys', []))
    if after_read is not None:
        after_read(checkpoint)
    # The part the hooks left state_dict naming (EMAHook's deployment swap:
    # the averaged copy's unless it resumes).
    model_dir = _part_dir(path, stored_part(checkpoint.pop('state_dict')))
    optimizer = _optimizer(optim_wrapper)
    saved_optim = checkpoint.get('optimizer')
    if optimizer is None or saved_optim is None:
        _load_model(model, model_dir, strict)
        checkpoint.pop('optimizer', None)
        return checkpoint
    before = copy.deepcopy(optimizer.state_dict())
    # distributed_state creates the optimizer's state (a zero-lr step) so
    # that DCP has tensors of the right shards to load into.
    model_state, optim_state = distributed_state(model, optimizer)
    optim_tensors, _ = split_tensors(optim_state)
    loaded = {'optimizer': optim_tensors}
    if model_dir == path:
        loaded['model'] = model_state
    else:
        _load_tensors({'model': model_state}, model_dir, partial=False)
    _load_tensors(loaded, path, partial=False)
    _set_distributed_state(model, optimizer, model_state,
                           merge(loaded['optimizer'], saved_optim), strict)
    local = dict(checkpoint.get('optim_wrapper') or {})
    local.update(optimizer.state_dict())
    optimizer.load_state_dict(before)
    checkpoint['optimizer'] = local
    return checkpoint


def _read_all(path: str) -> dict:
    """Every tensor of DCP directory ``path``, nested as saved."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    flat = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    _quiet(dcp.load, flat, checkpoint_id=path, no_dist=True)
    # DCP flattens nested dicts; planner_data maps each flat key back to
    # its path (parameter names contain dots, so splitting would not do).
    tensors: dict = {}
    for key, value in flat.items():
        node = tensors
        *parents, leaf = metadata.planner_data.get(key, (key, ))
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tensors


def sharded_to_full(path: str) -> dict:
    """Sharded checkpoint ``path`` as one full checkpoint (mmpar's ``full``
    format), in this process, with no process group.

    ``state_dict`` has the plain model's keys in its order (and, as the
    hooks left them, ``ema_state_dict`` the averaged copy's or the model's
    under ``module.``, as MMEngine's ``EMAHook`` writes it); ``optimizer``
    is keyed by parameter names, the form full checkpoints of sharded runs
    have, which loads under any wrapper or none.
    """
    checkpoint = load_plain_state(path)
    tensors = _read_all(path)
    model = tensors.get('model', {})
    keys = list(OrderedDict.fromkeys(
        list(checkpoint.pop('model_keys', [])) + list(model)))
    parts = {MODEL_PART: model}
    unpack_refs(checkpoint, path, keys)
    for name, value in list(checkpoint.items()):
        part = stored_part(value)
        if part is None:
            continue
        if part not in parts:
            parts[part] = _read_all(_part_dir(path, part)).get('model', {})
        stored = parts[part]
        checkpoint[name] = OrderedDict(
            (k, stored[v.key] if isinstance(v, StoredTensor) else v)
            for k, v in value.items()
            if not isinstance(v, StoredTensor) or v.key in stored)
    if 'optimizer' in checkpoint:
        optimizer = dict(checkpoint.pop('optim_wrapper', None) or {})
        optimizer.update(
            merge(tensors.get('optimizer'), checkpoint['optimizer']))
        checkpoint['optimizer'] = optimizer
    return checkpoint
