"""Checkpoints as plain data, loadable with ``torch.load(weights_only=True)``.

torch >= 2.6 loads with ``weights_only=True`` by default, and MMEngine 0.10.7
pickles its message hub's ``HistoryBuffer`` objects into every checkpoint, so
its own ``resume``/``load_from`` fail. Allow-listing HistoryBuffer is no fix:
it pickles bound methods, so ``builtins.getattr`` would have to be allowed too,
which defeats the restricted unpickler. mmpar instead stores that state as
plain lists and numbers and rebuilds the buffers after loading.
"""
import copy
import os
import os.path as osp
import pickle
import re
import zipfile
from typing import Any, Union

import numpy as np
import torch
from mmengine.logging import HistoryBuffer
from mmengine.utils import apply_to

_BUFFER_TAG = '__history_buffer__'
# How torch's weights-only unpickler names a global it refuses.
_MMENGINE_GLOBAL = re.compile(r'\bmmengine\.[\w.]+')


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
        return _same_kind(obj, {k: to_plain(v) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, '_fields'):  # a namedtuple
        return type(obj)(*(to_plain(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_plain(v) for v in obj)
    return obj


def _same_kind(obj: dict, items: dict) -> dict:
    """``items`` in a dict of ``obj``'s class. Not ``type(obj)(pairs)``: a
    ``Counter`` (MMEngine's ``MultiStepParamScheduler.milestones``) would
    count the pairs, and a ``defaultdict`` takes its factory first."""
    if type(obj) is dict:
        return items
    same = copy.copy(obj)  # its class and attributes (a default_factory)
    same.clear()
    for key, value in items.items():
        same[key] = value
    return same


def to_cpu(state: Any) -> Any:
    """``state`` with every tensor moved to the CPU."""
    return apply_to(state, lambda x: isinstance(x, torch.Tensor),
                    lambda x: x.cpu())


def from_plain(obj: Any) -> Any:
    """Undo :func:`to_plain` for ``HistoryBuffer`` entries."""
    if isinstance(obj, dict):
        if obj.get(_BUFFER_TAG):
            return HistoryBuffer(obj['log_history'], obj['count_history'],
                                 obj['max_length'])
        return _same_kind(obj, {k: from_plain(v) for k, v in obj.items()})
    return obj


def load_checkpoint_file(filename: str,
                         map_location: Union[str, torch.device,
                                             None] = 'cpu') -> dict:
    """``torch.load(filename, weights_only=True)`` with errors a person reads.

    Tensors are memory-mapped (on the CPU): nothing is read until used, so a
    rank that takes only its shard of each tensor (FSDP, tensor
    parallelism) reads only those pages, never the whole checkpoint.

    Raises:
        FileNotFoundError: the file does not exist.
        CheckpointLoadError: the file is truncated, corrupt or holds objects
            other than plain data; the message names the file and suggests
            the previous checkpoint, or, for a checkpoint of MMEngine's
            Runner, the command that converts it (never run here: it
            unpickles arbitrary objects).
    """
    if not os.path.isfile(filename):
        raise FileNotFoundError(f'checkpoint {filename!r} does not exist')
    try:
        mmap = map_location in ('cpu', torch.device('cpu'))
        return torch.load(filename, map_location=map_location,
                          weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        found = _MMENGINE_GLOBAL.search(str(err))
        if found is None:
            raise _unreadable(filename, err) from None
        raise CheckpointLoadError(
            f'cannot load checkpoint {filename!r}: it was written by '
            f'MMEngine\'s Runner and holds mmengine objects ({found[0]}), '
            'which torch >= 2.6 refuses to load with weights_only=True; '
            'mmpar loads plain-data checkpoints only. If you trust the '
            'file, convert it once (this unpickles it in full) and load '
            f'the copy: {_conversion_command(filename)}') from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError,
            OSError) as err:  # (OSError: mmap of a truncated file)
        raise _unreadable(filename, err) from None


def _unreadable(filename: str, err: Exception) -> CheckpointLoadError:
    first_line = str(err).strip().splitlines()[0] if str(err) else ''
    return CheckpointLoadError(
        f'cannot load checkpoint {filename!r}: it is truncated, corrupt '
        f'or not a plain-data checkpoint ({type(err).__name__}: '
        f'{first_line}). Resume from an earlier checkpoint in the same '
        'directory instead.')


def _conversion_command(filename: str) -> str:
    """The shell command (docs/mmengine_users.md) that rewrites a trusted
    checkpoint of MMEngine's Runner as plain data next to it
    (``epoch_1.pth`` -> ``epoch_1_plain.pth``), for ``load_from`` or
    ``resume``."""
    plain = '{}_plain{}'.format(*osp.splitext(filename))
    return ('python -c "import torch; from mmpar.checkpoint import to_plain; '
            f'torch.save(to_plain(torch.load({filename!r}, '
            f'weights_only=False)), {plain!r})"')


def atomic_save(checkpoint: dict, path: str) -> None:
    """Write ``checkpoint`` to ``path`` so that ``path`` is always complete.

    The data go to a temporary file in the same directory, are flushed to
    disk, and only then renamed over ``path`` (an atomic ``os.replace``). A
    process killed mid-save leaves the earlier files untouched and at most a
    ``*.tmp`` file that nothing loads.
    """
    tmp_path = f'{path}.{os.getpid()}.tmp'
    # As MMEngine's save does (its LocalBackend.put): CheckpointHook's
    # out_dir need not exist yet.
    os.makedirs(osp.dirname(path) or '.', exist_ok=True)
    try:
        with open(tmp_path, 'wb') as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_path, path)
    finally:
        if osp.exists(tmp_path):
            os.remove(tmp_path)


def is_complete_file(path: str) -> bool:
    """Whether ``path`` is a whole torch zip archive (a cheap check: a
    truncated file has no readable central directory)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith('data.pkl') for n in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
