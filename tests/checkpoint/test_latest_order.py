"""The fallback after a bad newest checkpoint goes by the step the names
say, not by modification time (a work dir copied without its times)."""
import os

import torch

from mmpar.checkpoint.files import atomic_save
from mmpar.checkpoint.latest import complete_checkpoints


def test_fallback_orders_by_the_step_in_the_name(tmp_path):
    # Copied in the wrong order: iter_6 has the newest time, iter_12 the
    # oldest; iter_12 (which last_checkpoint names) is truncated.
    for age, step in enumerate((6, 9, 10, 12)):
        path = tmp_path / f'iter_{step}.pth'
        atomic_save(dict(w=torch.ones(1)), str(path))
        os.utime(path, (1000 - age, 1000 - age))
    twelve = tmp_path / 'iter_12.pth'
    twelve.write_bytes(twelve.read_bytes()[:50])
    (tmp_path / 'last_checkpoint').write_text(str(twelve))
    assert complete_checkpoints(str(tmp_path)) == [
        str(tmp_path / f'iter_{step}.pth') for step in (10, 9, 6)]


def test_same_step_is_ordered_by_time(tmp_path):
    older, newer = tmp_path / 'epoch_3.pth', tmp_path / 'iter_3.pth'
    for when, path in ((100, older), (200, newer)):
        atomic_save(dict(w=torch.ones(1)), str(path))
        os.utime(path, (when, when))
    assert complete_checkpoints(str(tmp_path)) == [str(newer), str(older)]


def test_fallback_searches_the_folder_last_checkpoint_names(tmp_path):
    # CheckpointHook(out_dir=...): the checkpoints are not in the work dir.
    work, out = tmp_path / 'work', tmp_path / 'out' / 'work'
    work.mkdir()
    out.mkdir(parents=True)
    for step in (1, 2):
        atomic_save(dict(w=torch.ones(1)), str(out / f'iter_{step}.pth'))
    newest = out / 'iter_2.pth'
    newest.write_bytes(newest.read_bytes()[:50])
    (work / 'last_checkpoint').write_text(str(newest))
    assert complete_checkpoints(str(work)) == [str(out / 'iter_1.pth')]
