"""Dry-run a config at world size N: groups, wrapper, FSDP units, memory.

    python tools/plan.py CONFIG --world-size 8 [--rank R] [--cfg-options k=v]

Starts no processes and needs no GPU (one process on torch's fake process
group). Exits 2 with ``error: ...`` naming the config key on a bad config.
"""
import argparse
import sys

from mmengine.config import Config, DictAction


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('config', help='config file')
    parser.add_argument('--world-size', type=int, required=True)
    parser.add_argument('--rank', type=int, default=0,
                        help='the rank whose groups and memory are shown')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override config keys, e.g. parallel.use_fsdp=True')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mmpar.parallel.plan import PlanError, format_plan, make_plan
    from mmpar.parallel import ParallelismError
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    try:
        plan = make_plan(cfg, args.world_size, args.rank)
    except (PlanError, ParallelismError, ValueError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 2
    print(f'plan for {args.config}')
    print(format_plan(plan))
    return 0


if __name__ == '__main__':
    sys.exit(main())
