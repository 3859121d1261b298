"""Stand-ins for tensors that a sharded checkpoint keeps in DCP.

MMEngine's hooks handle checkpoints as dicts of tensors: ``EMAHook`` puts
its averaged weights under ``ema_state_dict`` and swaps them with
``state_dict`` entry by entry, so that ``state_dict`` holds the averaged
weights for deployment. A sharded checkpoint never has those tensors in one
place. Its hooks see :class:`StoredTensor` stand-ins instead: ``state_dict``
names the model's tensors in the checkpoint, and the ``ema_state_dict``
entries name the averaged copy's. Whatever the hooks do with the entries is
recorded as plain data (:func:`pack_refs`): which stored part each dict
holds, under which key prefix. A load rebuilds the stand-ins
(:func:`unpack_refs`) and reads the parts they name.

Parts: ``'model'`` is the checkpoint directory's own DCP data; any other
part is a DCP directory of that name inside it, holding the same model
keys (written through the model, see :mod:`mmpar.checkpoint.shadow`).
"""
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

#: The key of the plain-data file that records the stand-ins.
REFS_KEY = 'tensor_refs'
MODEL_PART = 'model'


@dataclass(frozen=True)
class StoredTensor:
    """The tensor ``key`` of the plain model in part ``part`` of the
    sharded checkpoint ``path`` ('' while it is being written)."""
    path: str
    part: str
    key: str


def stand_ins(part: str, keys: Iterable[str], prefix: str = '',
              path: str = '') -> Dict[str, StoredTensor]:
    """``{prefix + key: StoredTensor(path, part, key)}`` in key order."""
    return OrderedDict(
        (prefix + key, StoredTensor(path, part, key)) for key in keys)


def stored_part(entries) -> Optional[str]:
    """The one part the stand-ins among ``entries`` (a dict) name; None if
    there are none.

    Raises:
        ValueError: they name several parts (a hook mixed them).
    """
    if not isinstance(entries, dict):
        return None
    parts = {v.part for v in entries.values() if isinstance(v, StoredTensor)}
    if len(parts) > 1:
        raise ValueError('a sharded checkpoint stores each state dict in '
                         f'one part; a hook mixed the parts {sorted(parts)}')
    return parts.pop() if parts else None


def pack_refs(plain: dict) -> None:
    """Replace the stand-ins in ``plain``'s top-level dicts by a record
    under :data:`REFS_KEY` (in place): per dict, the part and the key
    prefix; the dict keeps its other entries, or goes if it has none."""
    refs = {}
    for name, value in list(plain.items()):
        part = stored_part(value)
        if part is None:
            continue
        stored = {k: v for k, v in value.items()
                  if isinstance(v, StoredTensor)}
        key, ref = next(iter(stored.items()))
        refs[name] = dict(part=part, prefix=key[:len(key) - len(ref.key)])
        rest = {k: v for k, v in value.items() if k not in stored}
        if rest:
            plain[name] = rest
        else:
            del plain[name]
    plain[REFS_KEY] = refs


def unpack_refs(plain: dict, path: str, keys: Iterable[str]) -> None:
    """Undo :func:`pack_refs` for checkpoint ``path`` (in place): each
    recorded dict gets its stand-ins for ``keys`` back after its other
    entries. A checkpoint without the record gets ``state_dict`` naming the
    model part."""
    refs = plain.pop(REFS_KEY, None) or {
        'state_dict': dict(part=MODEL_PART, prefix='')}
    keys = list(keys)
    for name, ref in refs.items():
        merged = OrderedDict(plain.get(name) or {})
        merged.update(stand_ins(ref['part'], keys, ref['prefix'], path))
        plain[name] = merged
