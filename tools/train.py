"""Train from a config: python tools/train.py CONFIG [options]."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.cli import build_runner, parse_train_args, train_config  # noqa: E402
from mmpar.failures import fail_fast, run_and_exit  # noqa: E402


def main():
    # A failure is reported once, the process group torn down, exit 1.
    with fail_fast():
        args = parse_train_args()
        cfg = train_config(args)
        if args.search:  # measure the layouts in this job first
            from mmpar.analysis.job_search import search_then_config
            cfg = search_then_config(cfg, args)
        if cfg is not None:
            build_runner(cfg).train()


if __name__ == '__main__':
    # Ends without the interpreter's teardown, which can abort a finished
    # run (mmpar.failures.exit_process says why).
    run_and_exit(main)
