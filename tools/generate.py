"""Print text from a trained language model.

    python tools/generate.py CONFIG CHECKPOINT --prompt "ROMEO:" \
        --max-new-tokens 200 [--temperature 0.8] [--top-k 40] [--seed 0]

CHECKPOINT is a full checkpoint file or a sharded checkpoint directory.
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.generation import main  # noqa: E402

if __name__ == '__main__':
    print(main())
