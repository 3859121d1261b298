"""Which checkpoint in a work directory to resume from."""
import glob
import os.path as osp
from typing import Callable, List, Optional

from mmpar.checkpoint.files import is_complete_file
from mmpar.checkpoint.sharded import is_complete_sharded_checkpoint


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a whole torch zip archive (a cheap check: a
    truncated file has no readable central directory), or a complete
    sharded checkpoint directory."""
    if osp.isdir(path):
        return is_complete_sharded_checkpoint(path)
    return is_complete_file(path)


def complete_checkpoints(work_dir: str,
                         warn: Optional[Callable[[str], None]] = None
                         ) -> List[str]:
    """The complete ``epoch_*`` / ``iter_*`` checkpoints (files or sharded
    directories) in ``work_dir``, newest first: the one ``last_checkpoint``
    names (if complete), then the others by modification time.

    Args:
        work_dir: the directory to look in.
        warn: told about each incomplete (truncated) checkpoint skipped;
            unfinished saves (``*.tmp``) are skipped silently.
    """
    found: List[str] = []
    pointer = osp.join(work_dir, 'last_checkpoint')
    if osp.isfile(pointer):
        with open(pointer) as file:
            pointed = file.read().strip()
        if is_complete_checkpoint(pointed):
            found.append(pointed)
    # Temporary files and directories of unfinished saves end in '.tmp'.
    candidates = [
        path for pattern in ('epoch_*', 'iter_*')
        for path in glob.glob(osp.join(work_dir, pattern))
        if not path.endswith('.tmp')
    ]
    for path in sorted(candidates, key=osp.getmtime, reverse=True):
        if path in found:
            continue
        if is_complete_checkpoint(path):
            found.append(path)
        elif warn is not None:
            warn(f'skipping checkpoint {path}: it is truncated or '
                 'incomplete')
    return found


def find_latest_complete_checkpoint(work_dir: str) -> Optional[str]:
    """The newest complete ``epoch_*.pth`` / ``iter_*.pth`` file or sharded
    ``epoch_*`` / ``iter_*`` directory in ``work_dir``.

    Unlike MMEngine's ``find_latest_checkpoint`` it does not trust the
    ``last_checkpoint`` pointer alone: a pointer to a missing or truncated
    file falls back to the newest complete checkpoint.
    """
    found = complete_checkpoints(work_dir)
    return found[0] if found else None
