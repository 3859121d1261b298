"""Plot training curves from MMEngine's scalar logs (OpenMMLab convention).

python tools/analyze_logs.py plot_curve WORK_DIR/TS/vis_data/scalars.json \
    [MORE.json ...] --keys loss acc --out curve.png [--legend ddp fsdp]
"""
import argparse
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.analysis.curves import plot_curve  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description='Analyse training logs')
    commands = parser.add_subparsers(dest='command', required=True)
    curve = commands.add_parser('plot_curve', help='plot logged values')
    curve.add_argument('log_files', nargs='+', help='scalars.json files')
    curve.add_argument('--keys', nargs='+', default=['loss'])
    curve.add_argument('--out', required=True, help='image file to write')
    curve.add_argument('--legend', nargs='+', help='a label per log file')
    curve.add_argument('--title')
    args = parser.parse_args(argv)
    try:
        out = plot_curve(args.log_files, args.keys, args.out, args.legend,
                         args.title)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f'error: {err}\n')
    print(f'wrote {out}')


if __name__ == '__main__':
    main()
