"""Verify a layout against one process (docs/verify.md):
    bash tools/dist_verify.sh CONFIG N [--steps K] [--rtol R] [--atol A]
runs the reference (python tools/verify.py CONFIG --reference-world N),
then the layout on N ranks; exit 0 when every step agrees, 1 when not."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.failures import fail_fast, run_and_exit  # noqa: E402
from mmpar.verify.cli import verify_main  # noqa: E402


def main():
    with fail_fast():
        code = verify_main()
    sys.exit(code)


if __name__ == '__main__':
    run_and_exit(main)
