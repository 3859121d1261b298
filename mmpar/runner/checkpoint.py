"""Checkpoints as plain data, loadable with ``torch.load(weights_only=True)``.

torch >= 2.6 loads with ``weights_only=True`` by default, and MMEngine 0.10.7
pickles its message hub's ``HistoryBuffer`` objects into every checkpoint, so
its own ``resume``/``load_from`` fail. Allow-listing HistoryBuffer is no fix:
it pickles bound methods, so ``builtins.getattr`` would have to be allowed too,
which defeats the restricted unpickler. mmpar instead stores that state as
plain lists and numbers and rebuilds the buffers after loading.
"""
import glob
import os
import random
import os.path as osp
import pickle
import zipfile
from typing import Any, Optional, Union

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.logging import HistoryBuffer

from mmpar.registry import HOOKS

_BUFFER_TAG = '__history_buffer__'


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read."""


def to_plain(obj: Any) -> Any:
    """Tensors, numbers, strings and containers of them; nothing else.

    ``HistoryBuffer`` becomes a tagged dict, numpy arrays lists, numpy scalars
    Python numbers.
    """
    if isinstance(obj, HistoryBuffer):
        log, count = obj.data
        return {
            _BUFFER_TAG: True,
            'log_history': np.asarray(log).tolist(),
            'count_history': np.asarray(count).tolist(),
            'max_length': int(obj.max_length),
        }
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return type(obj)((k, to_plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj


def from_plain(obj: Any) -> Any:
    """Undo :func:`to_plain` for ``HistoryBuffer`` entries."""
    if isinstance(obj, dict):
        if obj.get(_BUFFER_TAG):
            return HistoryBuffer(obj['log_history'], obj['count_history'],
                                 obj['max_length'])
        return type(obj)((k, from_plain(v)) for k, v in obj.items())
    return obj


def load_checkpoint_file(filename: str,
                         map_location: Union[str, torch.device,
                                             None] = 'cpu') -> dict:
    """``torch.load(filename, weights_only=True)`` with errors a person reads.

    Raises:
        FileNotFoundError: the file does not exist.
        CheckpointLoadError: the file is truncated, corrupt or holds objects
            other than plain data; the message names the file and suggests
            the previous checkpoint.
    """
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'checkpoint {filename!r} does not exist')
    try:
        return torch.load(
            filename, map_location=map_location, weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError,
            zipfile.BadZipFile, ValueError) as err:
        first_line = str(err).strip().splitlines()[0] if str(err) else ''
        raise CheckpointLoadError(
            f'cannot load checkpoint {filename!r}: it is truncated, corrupt '
            f'or not a plain-data checkpoint ({type(err).__name__}: '
            f'{first_line}). Resume from an earlier checkpoint in the same '
            'directory instead.') from None


def atomic_save(checkpoint: dict, path: str) -> None:
    """Write ``checkpoint`` to ``path`` so that ``path`` is always complete.

    The data go to a temporary file in the same directory, are flushed to
    disk, and only then renamed over ``path`` (an atomic ``os.replace``). A
    process killed mid-save leaves the earlier files untouched and at most a
    ``*.tmp`` file that nothing loads.
    """
    tmp_path = f'{path}.{os.getpid()}.tmp'
    try:
        with open(tmp_path, 'wb') as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_path, path)
    finally:
        if osp.exists(tmp_path):
            os.remove(tmp_path)


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a whole torch zip archive (a cheap check: a
    truncated file has no readable central directory), or a complete
    sharded checkpoint directory."""
    if osp.isdir(path):
        from mmpar.runner.sharded_checkpoint import \
            is_complete_sharded_checkpoint
        return is_complete_sharded_checkpoint(path)
    try:
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith('data.pkl') for n in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def find_latest_complete_checkpoint(work_dir: str) -> Optional[str]:
    """The newest complete ``epoch_*.pth`` / ``iter_*.pth`` file or sharded
    ``epoch_*`` / ``iter_*`` directory in ``work_dir``.

    Unlike MMEngine's ``find_latest_checkpoint`` it does not trust the
    ``last_checkpoint`` pointer alone: a pointer to a missing or truncated
    file falls back to the newest complete checkpoint.
    """
    pointer = osp.join(work_dir, 'last_checkpoint')
    if osp.isfile(pointer):
        with open(pointer) as file:
            pointed = file.read().strip()
        if is_complete_checkpoint(pointed):
            return pointed
    # Temporary files and directories of unfinished saves end in '.tmp'.
    candidates = [
        path for pattern in ('epoch_*', 'iter_*')
        for path in glob.glob(osp.join(work_dir, pattern))
        if not path.endswith('.tmp')
    ]
    for path in sorted(candidates, key=osp.getmtime, reverse=True):
        if is_complete_checkpoint(path):
            return path
    return None


@HOOKS.register_module()
class PlainCheckpointHook(Hook):
    """Keeps checkpoints plain data; the Runner registers it itself."""

    priority = 'VERY_LOW'

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint.update(to_plain(dict(checkpoint)))

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        if 'message_hub' in checkpoint:
            checkpoint['message_hub'] = from_plain(checkpoint['message_hub'])
        # Restored by Runner.resume once MMEngine's resume has finished (it
        # may reseed); a plain load_from leaves the generators alone.
        runner._loaded_rng_states = checkpoint.get('rng_states')


def rng_state() -> dict:
    """This process's random-number generator states (Python, NumPy, torch
    and, once CUDA is in use, every CUDA device)."""
    state = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` returned (also after :func:`to_plain`
    and a weights-only load, which turn NumPy's array into a list)."""
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state['numpy']
    np.random.set_state(
        (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def all_rng_states() -> list:
    """Every rank's :func:`rng_state`, in rank order (a collective when
    distributed: every rank must call it)."""
    import torch.distributed as dist
    local = rng_state()
    if not (dist.is_available() and dist.is_initialized()):
        return [local]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, local)
    return states


def restore_rng_states(runner, states: Optional[list]) -> bool:
    """Give this rank its saved generator states; False (and a warning)
    when the checkpoint has none or was saved with another world size."""
    if not states:
        return False
    if len(states) != runner.world_size:
        runner.logger.warning(
            f'the checkpoint holds RNG states of {len(states)} ranks and this '
            f'run has {runner.world_size}: random number generators are not '
            'restored')
        return False
    set_rng_state(states[runner.rank])
    return True


def model_state(model: torch.nn.Module) -> dict:
    """The plain model's full state dict, keys as ``model.state_dict()``.

    A wrapper whose parameters are sharded provides ``full_state_dict()``
    (collective: every rank must call it); otherwise the inner module's state
    dict is used.
    """
    if hasattr(model, 'full_state_dict'):
        return model.full_state_dict()
    from mmengine.model import is_model_wrapper
    module = model.module if is_model_wrapper(model) else model
    return module.state_dict()


def optimizer_state(model: torch.nn.Module, optim_wrapper) -> dict:
    """Optimizer state in a form that loads under any wrapper.

    Sharded wrappers provide ``full_optim_state_dict(optim_wrapper)``
    (collective); otherwise the optim wrapper's own state dict.
    """
    if hasattr(model, 'full_optim_state_dict'):
        return model.full_optim_state_dict(optim_wrapper)
    return optim_wrapper.state_dict()


def collect_checkpoint(runner,
                       meta: Optional[dict] = None,
                       by_epoch: bool = True,
                       save_optimizer: bool = True,
                       save_param_scheduler: bool = True) -> dict:
    """Everything a resume needs, as MMEngine lays it out. Runs on all
    ranks, so sharded wrappers can gather their state."""
    from mmengine.optim import OptimWrapper
    from mmengine.runner.checkpoint import weights_to_cpu

    checkpoint = checkpoint_extras(runner, meta, by_epoch,
                                   save_param_scheduler)
    checkpoint['state_dict'] = weights_to_cpu(model_state(runner.model))
    if save_optimizer:
        if not isinstance(runner.optim_wrapper, OptimWrapper):
            raise TypeError('runner.optim_wrapper must be an OptimWrapper, '
                            f'got {type(runner.optim_wrapper).__name__}')
        checkpoint['optimizer'] = _to_cpu(
            optimizer_state(runner.model, runner.optim_wrapper))
    return checkpoint


def _to_cpu(state):
    from mmengine.utils import apply_to
    return apply_to(state, lambda x: hasattr(x, 'cpu'), lambda x: x.cpu())


def checkpoint_extras(runner,
                      meta: Optional[dict] = None,
                      by_epoch: bool = True,
                      save_param_scheduler: bool = True) -> dict:
    """The checkpoint without model and optimizer state: ``meta``,
    ``message_hub`` and ``param_schedulers`` (both formats share it)."""
    import time

    import mmengine

    meta = dict(meta or {})
    if by_epoch:
        # Saved after the epoch's hooks, before `epoch` is incremented.
        meta.setdefault('epoch', runner.epoch + 1)
        meta.setdefault('iter', runner.iter)
    else:
        meta.setdefault('epoch', runner.epoch)
        meta.setdefault('iter', runner.iter + 1)
    meta.update(
        cfg=runner.cfg.pretty_text,
        seed=runner.seed,
        experiment_name=runner.experiment_name,
        time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
        mmengine_version=mmengine.__version__)
    dataset = runner.train_dataloader.dataset
    if hasattr(dataset, 'metainfo'):
        meta.update(dataset_meta=dataset.metainfo)

    checkpoint = dict(
        meta=meta,
        message_hub=_to_cpu(runner.message_hub.state_dict()),
        rng_states=all_rng_states())
    schedulers = runner.param_schedulers
    if save_param_scheduler and schedulers is not None:
        if isinstance(schedulers, dict):
            checkpoint['param_schedulers'] = {
                name: [s.state_dict() for s in group]
                for name, group in schedulers.items()
            }
        else:
            checkpoint['param_schedulers'] = [s.state_dict() for s in schedulers]
    return checkpoint
