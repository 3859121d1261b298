"""Train K steps of a config at its layout and at the reference layout
(one process, or the layout ``--against`` names) through mmpar's own
Runner, each with a :class:`~mmpar.verify.recorder.FingerprintHook`, in
the verify work dir, and compare them (docs/verify.md)."""
import copy
import os
import os.path as osp
import time
from typing import Optional

import torch
import torch.distributed as dist
from mmengine.config import Config

from mmpar.config_check import check_config
from mmpar.failures import ConfigError, is_peer_failure
from mmpar.parallel.axes import AXES, SAMPLE_AXES
from mmpar.verify.against import ONE_PROCESS, against_config, parse_against
from mmpar.verify.compare import Verdict, compare, touching
from mmpar.verify.recorder import FingerprintHook

AGAINST = (ONE_PROCESS, 'AXIS=SIZE[,AXIS=SIZE...][,wrapper=TYPE]')
REFERENCE_FILE = 'reference.pt'
REPORT_FILE = 'report.txt'


def check_options(steps: int, rtol: float, atol: float,
                  against: str) -> None:
    """Raises ConfigError naming the bad option, its value and what is
    allowed."""
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f'--steps={steps!r}; allowed: an int >= 1')
    for name, value in (('--rtol', rtol), ('--atol', atol)):
        if not value >= 0:
            raise ConfigError(f'{name}={value!r}; allowed: a number >= 0')
    parse_against(against)


def short_run(cfg: Config, work_dir: str, steps: int, role: str) -> Config:
    """``cfg`` as a K-step run in ``work_dir``: iteration-based, no
    validation, testing or checkpoints, nothing resumed. The user's config
    is not changed. Under gradient accumulation
    (``optim_wrapper.accumulative_counts``) a step is that many batches."""
    cfg = copy.deepcopy(cfg)
    cfg.work_dir = work_dir
    # Unique: MMEngine keeps loggers and message hubs by name.
    cfg.experiment_name = f'verify_{role}_{time.time_ns()}'
    batches = (cfg.get('optim_wrapper') or {}).get('accumulative_counts', 1)
    if not isinstance(batches, int) or batches < 1:
        batches = 1  # the Runner's config check names the bad value
    cfg.train_cfg = dict(by_epoch=False, max_iters=steps * batches)
    for key in ('val_cfg', 'val_dataloader', 'val_evaluator', 'test_cfg',
                'test_dataloader', 'test_evaluator'):
        cfg[key] = None
    hooks = cfg.get('default_hooks') or {}
    hooks['checkpoint'] = None
    hooks.setdefault('logger', dict(type='LoggerHook'))
    if hooks['logger'] is not None:
        hooks['logger']['interval'] = 1
    cfg.default_hooks = hooks
    cfg.log_processor = dict(cfg.get('log_processor') or {}, by_epoch=False)
    cfg.resume = False
    return cfg


def _dims(cfg: Config, world_size: int):
    """The layout's sizes at ``world_size``, by the Runner's own config
    check."""
    # The check looks names up in the registries: the samplers, hooks and
    # loops mmpar registers are there once mmpar.runner is imported (the
    # Runner's own check runs after it is; verify checks before).
    import mmpar.runner  # noqa: F401
    return check_config(cfg, world_size=world_size).dims


def reference_config(cfg: Config, world_size: int,
                     against: str = ONE_PROCESS) -> Config:
    """The reference for the layout at ``world_size``, reading the same
    global batch. One process: ``parallel`` and the wrapper dropped, the
    per-rank batch times the layout's data-parallel size. A parallel
    ``against`` (:func:`~mmpar.verify.against.parse_against`): the config at
    that layout (:func:`~mmpar.verify.against.against_config`), checked at
    its world size.

    Raises:
        ConfigError: a bad ``against``, or one the Runner's config check
            refuses (the message names ``--against``).
    """
    # The ranks that read different samples (the data axes and the expert
    # axis): the reference's batch is that many per-rank batches.
    size = _dims(cfg, world_size).size_of(SAMPLE_AXES)
    reference = parse_against(against)
    if reference.sizes:
        ref = against_config(cfg, reference,
                             cfg.train_dataloader.batch_size * size, against)
        try:
            _dims(ref, reference.world_size)
        except ValueError as err:  # ConfigError, ParallelismError
            raise ConfigError(f'--against={against!r}: {err}') from None
        return ref
    cfg = copy.deepcopy(cfg)
    cfg.pop('parallel', None)
    cfg.pop('model_wrapper_cfg', None)
    cfg.launcher = 'none'
    cfg.train_dataloader.batch_size = cfg.train_dataloader.batch_size * size
    return cfg


def _train(cfg: Config, hook: FingerprintHook) -> float:
    from mmpar.cli import build_runner
    runner = build_runner(cfg)
    runner.register_hook(hook)
    start = time.perf_counter()
    runner.train()
    return time.perf_counter() - start


def run_reference(cfg: Config, work_dir: str, steps: int,
                  world_size: int, against: str = ONE_PROCESS
                  ) -> Optional[str]:
    """Train the reference (at a parallel ``against``: in a launched job
    of its world size) and save its records on rank 0; returns the file
    there, None on the other ranks."""
    hook = FingerprintHook()
    ref = short_run(reference_config(cfg, world_size, against),
                    osp.join(work_dir, 'reference'), steps, 'reference')
    seconds = _train(ref, hook)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    path = osp.join(work_dir, REFERENCE_FILE)
    torch.save(dict(steps=hook.steps, shapes=hook.shapes,
                    world_size=world_size, num_steps=steps,
                    against=parse_against(against).label,
                    seconds=seconds), path)
    return path


def _load_reference(work_dir: str, world_size: int, steps: int,
                    against: str) -> dict:
    path = osp.join(work_dir, REFERENCE_FILE)
    if not osp.isfile(path):
        raise ConfigError(
            f'no reference at {path!r}; run it first (bash '
            'tools/dist_verify.sh CONFIG N does): python tools/verify.py '
            f'CONFIG --reference-world {world_size} --steps {steps} '
            f'--against {against}')
    saved = torch.load(path, weights_only=False)
    label = parse_against(against).label
    found = (saved['world_size'], saved['num_steps'],
             saved.get('against', ONE_PROCESS))
    if found != (world_size, steps, label):
        raise ConfigError(
            f'{path!r} is a reference for {found[0]} ranks, {found[1]} '
            f'steps and --against {found[2]}, not --steps {steps} at '
            f'{world_size} against {label}; allowed: rerun it with '
            f'--reference-world {world_size} --steps {steps} --against '
            f'{label}')
    return saved


def axes_line(cfg: Config, world_size: int) -> str:
    """The layout's axes larger than 1, e.g. ``layout pp=2 x tp=2 at 4
    ranks``."""
    dims = _dims(cfg, world_size)
    sizes = [f'{axis}={getattr(dims, axis)}' for axis in AXES
             if getattr(dims, axis) > 1]
    return 'layout ' + (' x '.join(sizes) or 'one rank') + \
        f' at {world_size} ranks'


def run_layout(cfg: Config, work_dir: str, steps: int, rtol: float,
               atol: float, against: str = ONE_PROCESS) -> Optional[Verdict]:
    """Train at the layout (a launched job), compare on rank 0 and write
    the report there; returns the verdict on rank 0 and on a rank whose run
    raised (which writes the report itself), None on the others."""
    world_size = int(os.environ.get('WORLD_SIZE', '1'))
    saved = _load_reference(work_dir, world_size, steps, against)
    shapes = saved['shapes']
    hook = FingerprintHook(reference_shapes=shapes)
    run = short_run(cfg, osp.join(work_dir, 'layout'), steps, 'layout')
    from mmpar.cli import build_runner
    runner = build_runner(run)
    runner.register_hook(hook)
    failure = None
    start = time.perf_counter()
    try:
        runner.train()
    except Exception as err:  # noqa: B902 - reported as the verdict
        failure = (len(hook.steps), list(hook.running), err)
    seconds = time.perf_counter() - start
    verdict = None
    if failure is not None:
        step, running, err = failure
        if is_peer_failure(err):
            # Another rank failed first and writes the report; this one
            # only lost its peer.
            return Verdict(False, 0.0, [
                f'step {step}: another rank of the layout failed (its '
                f'report is in {osp.join(work_dir, REPORT_FILE)})'],
                failed=True)
        # The innermost module running, or the one mmpar's tp dry run
        # names (it runs the first forward on a meta copy).
        module = getattr(err, 'module', None) or (
            running[-1] if running else None)
        lines = [f'step {step}: the layout failed' +
                 (f' in module `{module}`' if module else '') +
                 f': {type(err).__name__}: {str(err).splitlines()[0][:300]}']
        lines.append('  layout on it: ' + touching(
            module, hook.touches, (cfg.get('parallel') or {}).get('tp_plan'),
            axes_line(cfg, world_size)))
        verdict = Verdict(False, 0.0, lines, failed=True)
    elif not dist.is_initialized() or dist.get_rank() == 0:
        verdict = compare(
            saved['steps'], hook.steps, rtol=rtol, atol=atol,
            touches=hook.touches,
            tp_plan=(cfg.get('parallel') or {}).get('tp_plan'),
            axes_line=axes_line(cfg, world_size))
    if verdict is not None and failure is None:
        torch.save(dict(steps=hook.steps, touches=hook.touches),
                   osp.join(work_dir, 'layout.pt'))
    if verdict is not None:
        reference = parse_against(against)
        at = f' ({reference.label} at {reference.world_size} ranks)' \
            if reference.sizes else ''
        verdict.lines.append(
            f'cost: reference {saved["seconds"]:.1f} s{at}, layout '
            f'{seconds:.1f} s for {steps} steps (with fingerprints)')
        with open(osp.join(work_dir, REPORT_FILE), 'w') as f:
            f.write(verdict.text + '\n')
    return verdict
