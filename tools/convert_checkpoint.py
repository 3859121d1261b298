"""Turn a sharded checkpoint directory into one full checkpoint file.

    python tools/convert_checkpoint.py work_dirs/x/epoch_3 epoch_3.pth

Runs in one process with no process group. The output is mmpar's ``full``
format: the plain model's keys, name-keyed optimizer state, schedulers, loop
state; it loads with ``torch.load(weights_only=True)``, into a plain model
with ``strict=True``, and resumes training under any wrapper or none.
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.checkpoint import atomic_save, sharded_to_full  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('src', help='sharded checkpoint directory')
    parser.add_argument('dst', help='output file (.pth)')
    args = parser.parse_args(argv)
    if not osp.isdir(args.src):
        parser.error(f'src={args.src!r} is not a sharded checkpoint '
                     'directory (a full checkpoint file needs no conversion)')
    atomic_save(sharded_to_full(args.src), args.dst)
    print(f'wrote {args.dst}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
