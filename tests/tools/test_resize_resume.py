"""Resize on resume: 4 -> 2 -> 4 data ranks in the middle of an epoch, with
the same global batch, the 4 -> 2 step through ``tools/dist_train.sh
--resume``.

Run A trains one epoch of 96 samples on 4 ranks (batch 4: 6 iterations of
16) and checkpoints every 2 iterations (full format). Run B, the tool,
resumes A's iteration-2 checkpoint on 2 ranks with batch 8 under FSDP2 and
saves sharded checkpoints; run C resumes B's iteration-4 checkpoint on 4
ranks with batch 4 (DDP). A and C run in the 4-rank pool (``run_dist``).
Every rank records the ids it reads and its loss
(tests/sample_recording.py). A: 1-2, B: 3-4, C: 5-6 reads each id of the
epoch exactly once, each resumed iteration reads the same 16 ids as A's, and
the mean loss stays within ``LOSS_RTOL`` of A's (the same mean gradient,
summed in another order).
"""
import collections

from mmengine.config import Config

from tests.e2e import ROOT, VIT_FSDP2, run_tool, tool_env
from tests.sample_recording import read_records
from tests.trained import SMALL_MODEL

JOB_TIMEOUT_S = 400
NUM_SAMPLES, GLOBAL_BATCH = 96, 16
# Relative; measured: at most 1e-7 here (float32 sums in another order).
LOSS_RTOL = 1e-4


def _config(path, *lines) -> str:
    path.write_text('\n'.join([
        f"_base_ = '{ROOT / 'configs/vit_digits/vit_digits.py'}'",
        f'model = dict(**{SMALL_MODEL})',
        "custom_imports = dict(imports=['tests.sample_recording'], "
        'allow_failed_imports=False)',
        'train_dataloader = dict(batch_size=4, dataset=dict('
        f"type='RecordedDigits', num_samples={NUM_SAMPLES}))",
        'train_cfg = dict(max_epochs=1)',
        'val_dataloader = val_cfg = val_evaluator = None',
        "default_hooks = dict(checkpoint=dict(type='CheckpointHook', "
        'by_epoch=False, interval=2))',
        "custom_hooks = [dict(type='RecordSamples')]",
    ] + list(lines)) + '\n')
    return str(path)


def _train_here(config, work_dir, name, **resume):
    """Train in this process (a rank of the pool)."""
    from mmpar.runner import Runner
    cfg = Config.fromfile(config)
    cfg.update(launcher='pytorch', work_dir=str(work_dir),
               experiment_name=name, **resume)
    Runner.from_cfg(cfg).train()


def _train_tool(config, ranks, work_dir, *args):
    proc = run_tool(['bash', 'tools/dist_train.sh', config, ranks,
                     '--work-dir', work_dir] + list(args),
                    timeout=JOB_TIMEOUT_S, env=tool_env())
    return proc.stdout + proc.stderr


def test_resize_4_to_2_to_4_reads_each_sample_once(tmp_path, run_dist):
    config = _config(tmp_path / 'cfg.py')
    straight, resized, regrown = (tmp_path / name for name in 'ABC')
    run_dist(_train_here, config, straight, f'A{id(tmp_path)}',
             world_size=4)
    fsdp2 = _config(tmp_path / 'fsdp2.py', f'model_wrapper_cfg = {VIT_FSDP2}',
                    "checkpoint_format = 'sharded'")
    log = _train_tool(fsdp2, 2, resized, '--resume', straight / 'iter_2.pth',
                 '--cfg-options', 'train_dataloader.batch_size=8')
    assert 'resumed epoch: 0, iter: 2' in log, log[-3000:]
    run_dist(_train_here, config, regrown, f'C{id(tmp_path)}',
             resume=True, load_from=str(resized / 'iter_4'), world_size=4)

    a, b, c = (read_records(d) for d in (straight, resized, regrown))
    assert sorted(a) == list(range(1, 7))
    assert sorted(b) == [3, 4, 5, 6] and sorted(c) == [5, 6]
    epoch = [i for it in (1, 2) for i in a[it][0]] + \
        [i for it in (3, 4) for i in b[it][0]] + \
        [i for it in (5, 6) for i in c[it][0]]
    assert collections.Counter(epoch) == collections.Counter(
        range(NUM_SAMPLES))
    for resumed in (b, c):
        for it, (ids, loss) in resumed.items():
            assert len(ids) == GLOBAL_BATCH
            assert sorted(ids) == sorted(a[it][0]), it
            assert abs(loss - a[it][1]) <= LOSS_RTOL * abs(a[it][1]), \
                (it, loss, a[it][1])
