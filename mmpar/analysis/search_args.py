"""The layout search's command-line flags, shared by ``tools/train.py
--search`` (the search in the launched job) and its local front
``tools/plan.py --search``."""
import argparse
import os.path as osp
from typing import Optional

CHECKPOINTING_CHOICES = ('none', 'selective', 'full')


def add_search_arguments(group) -> None:
    """The tuning flags of the search (``--search`` and ``--memory-budget``
    are each tool's own: their help differs)."""
    group.add_argument('--trial-steps', type=int, default=5, metavar='K',
                       help='timed steps per candidate (default 5)')
    group.add_argument('--warmup-steps', type=int, default=2, metavar='W',
                       help='untimed steps before them (default 2)')
    group.add_argument(
        '--early-stop', type=float, default=1.3, metavar='X',
        help='stop a candidate whose first 2 timed steps are all slower '
        'than X times the best so far (default 1.3; 0: never)')
    group.add_argument(
        '--confirm', type=int, default=3, metavar='C',
        help='run the C fastest candidates within 1.5x of the best '
        '(stopped early or not) --confirm-rounds more times, interleaved, '
        'and rank them on their fastest trial (default 3; 0: one pass)')
    group.add_argument(
        '--confirm-rounds', type=int, default=2, metavar='R',
        help='confirm rounds: each close candidate runs up to R more '
        'trials; after the first round only those within 5%% of the '
        'fastest (default 2)')
    group.add_argument(
        '--sweep', type=int, default=0, metavar='R',
        help='measure every candidate that fits (every checkpointing mode) '
        'R times, interleaved, without early stop or confirm rounds: the '
        'exhaustive sweep the search is benchmarked against (default 0: '
        'search)')
    group.add_argument(
        '--checkpointing', nargs='+', default=list(CHECKPOINTING_CHOICES),
        choices=CHECKPOINTING_CHOICES,
        help='activation checkpointing modes to try')
    group.add_argument(
        '--schedules', nargs='+', default=None, metavar='NAME',
        help='pipeline schedules to try (default 1F1B GPipe '
        'Interleaved1F1B)')
    group.add_argument(
        '--microbatches', nargs='+', type=int, default=None, metavar='M',
        help='pipeline micro-batch counts to try (default pp and 2 pp)')
    group.add_argument(
        '--out', metavar='DIR',
        help='where the best config, search.json and the trial logs go '
        '(default work_dirs/<config name>_search)')


def search_argument_error(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the search flags (naming the flag, its value and
    what is allowed), None when nothing is."""
    checks = [('trial_steps', args.trial_steps >= 1, 'an int >= 1'),
              ('warmup_steps', args.warmup_steps >= 1, 'an int >= 1'),
              ('memory_budget', args.memory_budget is None or
               args.memory_budget > 0, 'GiB > 0'),
              ('early_stop', args.early_stop == 0 or args.early_stop > 1,
               '0 (never) or a factor > 1'),
              ('confirm', args.confirm >= 0, 'an int >= 0'),
              ('confirm_rounds', args.confirm_rounds >= 0, 'an int >= 0'),
              ('sweep', args.sweep >= 0, 'an int >= 0'),
              ('microbatches', all(m >= 1 for m in args.microbatches or []),
               'ints >= 1'),
              # tools/plan.py's own (the job's is its launch's).
              ('world_size', getattr(args, 'world_size', 1) >= 1,
               'an int >= 1')]
    for key, ok, allowed in checks:
        if not ok:
            return (f'--{key.replace("_", "-")}={getattr(args, key)} '
                    f'is not allowed; allowed: {allowed}')
    return None


def default_out(config_path: str) -> str:
    """``--out`` when not given: ``work_dirs/<config name>_search``."""
    stem = osp.splitext(osp.basename(config_path))[0]
    return osp.join('work_dirs', f'{stem}_search')


def search_flags(args: argparse.Namespace) -> list:
    """``args``' search flags as a command line (what the local front hands
    to the launched job)."""
    flags = []
    for name in ('trial_steps', 'warmup_steps', 'early_stop', 'confirm',
                 'confirm_rounds', 'sweep', 'checkpointing', 'schedules',
                 'microbatches', 'memory_budget', 'out'):
        value = getattr(args, name)
        if value is not None and value != []:
            flags += [f'--{name.replace("_", "-")}',
                      *(value if isinstance(value, list) else [value])]
    return [str(flag) for flag in flags]
