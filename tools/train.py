"""Train from a config: python tools/train.py CONFIG [options]."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.cli import (build_runner, destroy_process_group,  # noqa: E402
                       parse_train_args, train_config)


def main():
    cfg = train_config(parse_train_args())
    try:
        build_runner(cfg).train()
    finally:
        destroy_process_group()


if __name__ == '__main__':
    main()
