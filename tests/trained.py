"""Small ViT runs under mmpar's Runner, and the trained runs tests share.

Several files need the same run: a checkpoint of each wrapper in each format
(resume exactly, resume under another wrapper or world size, convert), or
the default example trained on 2 ranks by ``tools/dist_train.sh``. Training
each once per session (``trained_run`` and ``default_two_rank_run`` in
tests/conftest.py) instead of once per file keeps the suite fast. Their work
directories are **read-only** to tests: a test that resumes from one writes
into its own ``tmp_path`` (``resume=True, load_from=<shared checkpoint>``),
so no test depends on another having run first.

"Train to k, resume, compare with a straight run" is done with one straight
run that also writes the checkpoint the resumed run starts from.
"""
from pathlib import Path
from typing import Callable, Dict, Tuple

from mmengine.config import Config

from mmpar.models import DigitsViT
from tests.e2e import DEFAULT_CONFIG, ROOT, run_tool

CONFIGS = {
    'MMDistributedDataParallel': 'configs/vit_digits/vit_digits.py',
    'MMFullyShardedDataParallel': 'configs/vit_digits/vit_digits_fsdp.py',
    'MMFullyShard': 'configs/vit_digits/vit_digits_fsdp2.py',
}
# A checkpoint saved by one process, unwrapped (the default config).
ONE = 'one process'
# Small enough for seconds per epoch on 2 CPU ranks: 3 iterations per epoch
# at 2 ranks (1,437 images / (2 x 256)), 6 on one process.
SMALL_MODEL = dict(embed_dim=16, depth=2, num_heads=2)
BATCH = 256
NO_VAL = dict(val_cfg=None, val_dataloader=None, val_evaluator=None)
# The shared runs train this many epochs and keep every epoch's checkpoint.
SHARED_EPOCHS = 3


def config_of(wrapper: str) -> str:
    return CONFIGS['MMDistributedDataParallel' if wrapper == ONE else wrapper]


def small_cfg(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    cfg = Config.fromfile(str(ROOT / config))
    cfg.model.update(SMALL_MODEL)
    cfg.train_dataloader.batch_size = BATCH
    cfg.val_dataloader.batch_size = 180
    cfg.train_cfg.max_epochs = max_epochs
    cfg.default_hooks.logger.interval = 1
    cfg.launcher = 'pytorch'
    cfg.work_dir = str(work_dir)
    cfg.checkpoint_format = fmt
    cfg.experiment_name = name  # unique: MMEngine keeps loggers by name
    cfg.update(extra)
    return cfg


def train(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    """Train (or resume) in this process; returns the Runner."""
    from mmpar.runner import Runner
    cfg = small_cfg(config, work_dir, max_epochs, name, fmt, **extra)
    runner = Runner.from_cfg(cfg)
    runner.train()
    return runner


def train_dist(config, work_dir, max_epochs, name, fmt='sharded', **extra):
    """:func:`train` on every rank of a pool (returns nothing to pickle)."""
    train(config, work_dir, max_epochs, name, fmt, **extra)


def plain_model() -> DigitsViT:
    return DigitsViT(image_size=8, patch_size=2, mlp_ratio=2.0,
                     **SMALL_MODEL)


def checkpoint_path(work_dir, epoch: int, fmt: str) -> Path:
    return Path(work_dir) / (f'epoch_{epoch}' +
                             ('.pth' if fmt == 'full' else ''))


class TrainedRuns:
    """``runs(wrapper, fmt)``: the work dir of :data:`SHARED_EPOCHS` epochs
    of the small ViT under ``wrapper`` (a :data:`CONFIGS` key, or
    :data:`ONE`) saving ``fmt`` checkpoints every epoch, with validation;
    trained on first use, then shared. Read-only."""

    def __init__(self, make_dir: Callable[[str], Path],
                 run_dist: Callable):
        self._make_dir = make_dir
        self._run_dist = run_dist
        self._done: Dict[Tuple[str, str], Path] = {}

    def __call__(self, wrapper: str, fmt: str) -> Path:
        key = (wrapper, fmt)
        if key not in self._done:
            work_dir = self._make_dir(
                f'shared_{wrapper.replace(" ", "_")}_{fmt}')
            name = f'shared_{wrapper}_{fmt}'
            if wrapper == ONE:
                train(config_of(wrapper), work_dir, SHARED_EPOCHS, name, fmt,
                      launcher='none')
            else:
                self._run_dist(train_dist, config_of(wrapper), work_dir,
                               SHARED_EPOCHS, name, fmt)
            self._done[key] = work_dir
        return self._done[key]


def train_default_two_ranks(work_dir: Path, epochs: int) -> Path:
    """``bash tools/dist_train.sh DEFAULT_CONFIG 2`` for ``epochs`` epochs
    (every epoch's checkpoint kept): torchrun and its ranks new
    interpreters, as in a user's shell (the suite's other tool processes
    fork from tests/fork_server.py)."""
    run_tool([
        'bash', 'tools/dist_train.sh', DEFAULT_CONFIG, 2, '--work-dir',
        work_dir, '--cfg-options', f'train_cfg.max_epochs={epochs}',
        f'default_hooks.checkpoint.max_keep_ckpts={epochs}'
    ], timeout=400, fresh=True)
    return work_dir
