"""Which checkpoint in a work directory to resume from."""
import glob
import os
import os.path as osp
import re
from typing import Callable, List, Optional, Tuple

from mmpar.checkpoint.files import is_complete_file
from mmpar.checkpoint.sharded import is_complete_sharded_checkpoint


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a whole torch zip archive (a cheap check: a
    truncated file has no readable central directory), or a complete
    sharded checkpoint directory."""
    if osp.isdir(path):
        return is_complete_sharded_checkpoint(path)
    return is_complete_file(path)


#: Written in the work dir by the first attempt of a torchrun job
#: (:func:`mark_job_start`): its modification time is the job's start, its
#: text torchrun's run id.
JOB_MARKER = '.mmpar_job_start'


def _run_id() -> str:
    return os.environ.get('TORCHELASTIC_RUN_ID', '')


def mark_job_start(work_dir: str) -> None:
    """Record in ``work_dir`` that a job starts now (its first attempt, on
    rank 0, before any save), replacing an older job's record atomically."""
    marker = osp.join(work_dir, JOB_MARKER)
    tmp = f'{marker}.{os.getpid()}.tmp'
    with open(tmp, 'w') as file:
        file.write(_run_id())
    os.replace(tmp, marker)


def job_start(work_dir: str) -> float:
    """When the job whose restart this is started (:func:`mark_job_start`);
    infinity, so that no checkpoint counts as the job's, when the record is
    missing or names another torchrun run id."""
    marker = osp.join(work_dir, JOB_MARKER)
    try:
        with open(marker) as file:
            run_id = file.read().strip()
        started = osp.getmtime(marker)
    except OSError:
        return float('inf')
    return started if run_id == _run_id() else float('inf')


def _step_order(path: str) -> Tuple[int, float]:
    """The step ``epoch_N`` / ``iter_N`` names (-1 for another name), then
    the modification time: a copy of a work dir that did not keep times
    still orders its checkpoints as they were saved."""
    match = re.match(r'(?:epoch|iter)_(\d+)', osp.basename(path))
    return (int(match.group(1)) if match else -1, osp.getmtime(path))


def complete_checkpoints(work_dir: str,
                         warn: Optional[Callable[[str], None]] = None,
                         since: Optional[float] = None) -> List[str]:
    """The complete ``epoch_*`` / ``iter_*`` checkpoints (files or sharded
    directories) in ``work_dir`` and in the folder of the one
    ``last_checkpoint`` names (CheckpointHook's ``out_dir``), newest first:
    the one ``last_checkpoint`` names (if complete), then the others by the
    step in their names, the modification time breaking ties.

    Args:
        work_dir: the directory to look in.
        warn: told about each incomplete (truncated) checkpoint skipped;
            unfinished saves (``*.tmp``) are skipped silently.
        since: only checkpoints modified at or after this time (a
            restart's :func:`job_start`: those its job wrote).
    """

    def recent(path: str) -> bool:
        return since is None or osp.getmtime(path) >= since

    found: List[str] = []
    # CheckpointHook's out_dir keeps checkpoints outside the work dir:
    # where last_checkpoint points is searched too, even when the
    # checkpoint it names is bad.
    folders = [work_dir]
    pointer = osp.join(work_dir, 'last_checkpoint')
    if osp.isfile(pointer):
        with open(pointer) as file:
            pointed = file.read().strip()
        if is_complete_checkpoint(pointed) and recent(pointed):
            found.append(pointed)
        if pointed and osp.abspath(osp.dirname(pointed)) != \
                osp.abspath(work_dir):
            folders.append(osp.dirname(pointed))
    # Temporary files and directories of unfinished saves end in '.tmp'.
    candidates = [
        path for folder in folders for pattern in ('epoch_*', 'iter_*')
        for path in glob.glob(osp.join(folder, pattern))
        if not path.endswith('.tmp')
    ]
    for path in sorted(candidates, key=_step_order, reverse=True):
        if path in found or not recent(path):
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
