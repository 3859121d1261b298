"""Evaluate a checkpoint: python tools/test.py CONFIG CHECKPOINT [options]."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.cli import (build_runner, destroy_process_group,  # noqa: E402
                       parse_test_args, test_config)


def main():
    cfg = test_config(parse_test_args())
    try:
        build_runner(cfg).test()
    finally:
        destroy_process_group()


if __name__ == '__main__':
    main()
