"""Argument parsing and config preparation behind ``tools/train.py`` and
``tools/test.py``; kept here so tests can reach it."""
import argparse
import os
import os.path as osp
from typing import List, Optional

from mmengine.config import Config

from mmpar.cfg_options import CfgOptionsAction
from mmpar.dist import LAUNCHERS

AMP_WRAPPER = 'mmpar.AmpOptimWrapper'


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('--work-dir', help='where logs and checkpoints go')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=CfgOptionsAction,
        help='override config keys, e.g. train_cfg.max_epochs=3')
    parser.add_argument(
        '--launcher', choices=LAUNCHERS, default='none', help='job launcher')
    # torchrun passes --local-rank (older launchers --local_rank).
    parser.add_argument('--local-rank', '--local_rank', type=int, default=0)


def parse_train_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a model with mmpar')
    parser.add_argument('config', help='config file')
    parser.add_argument(
        '--resume',
        nargs='?',
        const='auto',
        help='resume: the newest checkpoint in the work dir (no value or '
        '"auto"), or a checkpoint path')
    parser.add_argument(
        '--amp', action='store_true', help='mixed precision (bf16 on CPU)')
    # OpenMMLab's usual train.py flags (mmpretrain, mmdet), same meaning.
    parser.add_argument(
        '--auto-scale-lr',
        action='store_true',
        help='scale the learning rate by the global batch size over '
        'auto_scale_lr.base_batch_size')
    parser.add_argument(
        '--no-validate',
        action='store_true',
        help='do not validate during training')
    parser.add_argument(
        '--no-pin-memory',
        action='store_true',
        help='pin_memory=False in every dataloader')
    parser.add_argument(
        '--no-persistent-workers',
        action='store_true',
        help='persistent_workers=False in every dataloader')
    _add_common(parser)
    _add_search(parser)
    args = parser.parse_args(argv)
    if args.search_only and not args.search:
        parser.error('--search-only needs --search')
    return args


def _add_search(parser: argparse.ArgumentParser) -> None:
    from mmpar.analysis.search_args import add_search_arguments
    search = parser.add_argument_group(
        'layout search (--search, in a launched job): every rank measures '
        'the layouts of the job, rank 0 writes the table and the fastest as '
        'a config, then the job trains with it (docs/layout_search.md)')
    search.add_argument('--search', action='store_true',
                        help='search the layouts before training')
    search.add_argument('--search-only', action='store_true',
                        help='stop after the search (do not train)')
    search.add_argument(
        '--memory-budget', type=float, metavar='GiB',
        help='memory per rank (device memory on an accelerator, resident '
        'memory on the CPU): layouts predicted over it are not run')
    add_search_arguments(search)


def parse_test_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test a checkpoint')
    parser.add_argument('config', help='config file')
    parser.add_argument(
        'checkpoint', help='checkpoint file or sharded checkpoint directory')
    _add_common(parser)
    return parser.parse_args(argv)


def load_config(args: argparse.Namespace) -> Config:
    """The config with ``--cfg-options``, work dir and launcher applied."""
    if not osp.isfile(args.config):
        raise FileNotFoundError(f'config file {args.config!r} does not exist')
    # custom_imports are imported by the Runner's config check, which names
    # a module that does not exist (Config.fromfile raises a bare ImportError).
    cfg = Config.fromfile(args.config, import_custom_modules=False)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    cfg.launcher = args.launcher
    os.environ.setdefault('LOCAL_RANK', str(args.local_rank))
    if args.work_dir:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir') is None:
        cfg.work_dir = osp.join('./work_dirs',
                                osp.splitext(osp.basename(args.config))[0])
    return cfg


def train_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args)
    if args.amp:
        wrapper_type = cfg.optim_wrapper.get('type', 'OptimWrapper')
        if wrapper_type not in ('OptimWrapper', 'AmpOptimWrapper',
                                AMP_WRAPPER):
            raise ValueError(f'--amp needs optim_wrapper.type OptimWrapper, '
                             f'got {wrapper_type!r}')
        cfg.optim_wrapper.type = AMP_WRAPPER
    if args.resume == 'auto':
        cfg.resume, cfg.load_from = True, None
    elif args.resume is not None:
        if not osp.exists(args.resume):
            raise FileNotFoundError(
                f'--resume {args.resume!r}: checkpoint does not exist')
        cfg.resume, cfg.load_from = True, args.resume
    _apply_openmmlab_flags(cfg, args)
    return cfg


DATALOADERS = ('train_dataloader', 'val_dataloader', 'test_dataloader')


def _apply_openmmlab_flags(cfg: Config, args: argparse.Namespace) -> None:
    """``--auto-scale-lr``, ``--no-validate``, ``--no-pin-memory`` and
    ``--no-persistent-workers`` as mmpretrain's and mmdet's train.py read
    them.

    Raises:
        ValueError: ``--auto-scale-lr`` on a config without
            ``auto_scale_lr.base_batch_size``.
    """
    if getattr(args, 'auto_scale_lr', False):
        scale = cfg.get('auto_scale_lr')
        if not isinstance(scale, dict) or 'base_batch_size' not in scale:
            raise ValueError(
                f'--auto-scale-lr needs auto_scale_lr.base_batch_size in the '
                f'config, got auto_scale_lr={scale!r}; allowed: e.g. '
                'auto_scale_lr = dict(base_batch_size=256)')
        cfg.auto_scale_lr.enable = True
    if getattr(args, 'no_validate', False):
        cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    for flag, key in (('no_pin_memory', 'pin_memory'),
                      ('no_persistent_workers', 'persistent_workers')):
        if getattr(args, flag, False):
            for name in DATALOADERS:
                if cfg.get(name) is not None:
                    cfg[name][key] = False


def test_config(args: argparse.Namespace) -> Config:
    if not osp.exists(args.checkpoint):
        raise FileNotFoundError(
            f'checkpoint {args.checkpoint!r} does not exist')
    cfg = load_config(args)
    cfg.load_from = args.checkpoint
    return cfg


def build_runner(cfg: Config):
    """mmpar's Runner, or the registered ``runner_type`` the config names."""
    from mmpar.registry import RUNNERS
    from mmpar.runner import Runner
    if 'runner_type' in cfg:
        return RUNNERS.build(cfg)
    return Runner.from_cfg(cfg)
