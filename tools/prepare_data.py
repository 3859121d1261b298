"""Tokenize local text / JSONL / Parquet files into a token shard:
python tools/prepare_data.py OUT_PREFIX FILES... [--tokenizer ...]
(docs/data.md)."""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.datasets.prepare import main  # noqa: E402

if __name__ == '__main__':
    main()
