"""``tools/verify.py``'s arguments and body."""
import argparse
import os.path as osp
from typing import List, Optional

import torch.distributed as dist

from mmpar.cli import CfgOptionsAction, load_config
from mmpar.dist import LAUNCHERS
from mmpar.failures import ConfigError
from mmpar.verify.against import ONE_PROCESS, parse_against
from mmpar.verify.choose import choose_reference
from mmpar.verify.run import (check_options, reference_config, run_layout,
                              run_reference)

# The line dist_verify.sh reads the reference's world size and --against
# from (``--choose-reference``).
CHOICE_PREFIX = 'verify-reference:'


def parse_verify_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Verify a layout against a reference (one process by '
        'default): bash tools/dist_verify.sh CONFIG N [options] '
        '(docs/verify.md)')
    parser.add_argument('config', help='config file')
    parser.add_argument(
        '--against', default=ONE_PROCESS, metavar='LAYOUT',
        help='the reference layout: one-process (default) or '
        'AXIS=SIZE[,AXIS=SIZE...][,wrapper=TYPE] over dp_replicate, '
        'dp_shard, ep, pp, cp, e.g. dp_shard=2')
    parser.add_argument(
        '--memory-budget', type=float, metavar='GIB',
        help='GiB per rank the reference may use: without --against, one '
        'process when its predicted peak fits, else the smallest dp_shard '
        'layout that fits')
    parser.add_argument('--choose-reference', type=int, metavar='N',
                        help='print the reference for the layout at N '
                        'ranks (its world size and --against) and exit '
                        '(dist_verify.sh runs it first)')
    parser.add_argument('--steps', type=int, default=3,
                        help='optimizer steps to compare (default 3)')
    parser.add_argument('--rtol', type=float, default=1e-3,
                        help='relative tolerance (default 1e-3)')
    parser.add_argument('--atol', type=float, default=1e-7,
                        help='absolute tolerance (default 1e-7)')
    parser.add_argument('--reference-world', type=int, metavar='N',
                        help='run only the reference, for the layout at N '
                        'ranks (dist_verify.sh runs it first)')
    parser.add_argument('--work-dir', help='the verify runs\' own work dir '
                        '(default work_dirs/verify/CONFIG_NAME)')
    parser.add_argument('--cfg-options', nargs='+', action=CfgOptionsAction,
                        help='override config keys (both runs)')
    parser.add_argument('--launcher', choices=LAUNCHERS, default='none')
    parser.add_argument('--local-rank', '--local_rank', type=int, default=0)
    return parser.parse_args(argv)


def verify_main(argv: Optional[List[str]] = None) -> int:
    """Run the reference (``--reference-world``) or the layout; returns the
    exit status: 0 when every step agrees, 1 when not."""
    args = parse_verify_args(argv)
    check_options(args.steps, args.rtol, args.atol, args.against)
    name = osp.splitext(osp.basename(args.config))[0]
    work_dir = args.work_dir or osp.join('work_dirs', 'verify', name)
    args.work_dir = None  # load_config must keep the user's own work dir
    cfg = load_config(args)
    for option in ('choose_reference', 'reference_world'):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise ConfigError(f'--{option.replace("_", "-")}={value}; '
                              'allowed: an int >= 1')
    if args.choose_reference is not None:
        against = choose_reference(cfg, args.choose_reference, args.against,
                                   args.memory_budget)
        reference_config(cfg, args.choose_reference, against)  # refuses
        print(f'{CHOICE_PREFIX} {parse_against(against).world_size} '
              f'{against}', flush=True)
        return 0
    if args.reference_world is not None:
        ranks = parse_against(args.against).world_size
        if ranks > 1 and args.launcher == 'none':
            raise ConfigError(
                f'--against={args.against!r}: the reference runs on {ranks} '
                'ranks in a launched job; allowed: bash tools/dist_verify.sh '
                'CONFIG N --against ... (which launches it), or --launcher '
                f'pytorch under torchrun --nproc_per_node {ranks}')
        path = run_reference(cfg, work_dir, args.steps, args.reference_world,
                             args.against)
        if path is not None:
            print(f'verify: reference of {args.steps} steps saved to {path}')
        return 0
    if args.launcher == 'none':
        raise ConfigError(
            '--launcher=none: the layout runs in a launched job; allowed: '
            'bash tools/dist_verify.sh CONFIG N (or --launcher pytorch / '
            'slurm / mpi under a launcher)')
    verdict = run_layout(cfg, work_dir, args.steps, args.rtol, args.atol,
                         args.against)
    if verdict is not None:
        print(verdict.text, flush=True)
    if verdict is not None and verdict.failed:
        # The other ranks may be waiting in a collective of the training
        # step this rank left: no broadcast, no barrier on the way out (they
        # would wait until the collective timeout); exit now, torchrun stops
        # the others.
        raise SystemExit(1)
    agree = [verdict.agree if verdict is not None else None]
    if dist.is_initialized():
        dist.broadcast_object_list(agree, src=0)
    return 0 if agree[0] else 1
