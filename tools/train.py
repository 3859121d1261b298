"""Train from a config: python tools/train.py CONFIG [options]."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.cli import build_runner, parse_train_args, train_config  # noqa: E402
from mmpar.failures import fail_fast, run_and_exit  # noqa: E402


def main():
    # A failure is reported once, the process group torn down, exit 1.
    with fail_fast():
        build_runner(train_config(parse_train_args())).train()


if __name__ == '__main__':
    # Ends without the interpreter's teardown, which can abort a finished
    # run (mmpar.failures.exit_process says why).
    run_and_exit(main)
