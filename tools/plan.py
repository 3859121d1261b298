"""Dry-run a config at world size N: groups, wrapper, FSDP units, memory.

    python tools/plan.py CONFIG --world-size 8 [--rank R] [--cfg-options k=v]

Starts no processes and needs no GPU. See docs/topology.md. With
``--search [--memory-budget GiB] [--trial-steps K] [--out DIR] ...`` it is a
front for the search inside a launched job: it runs ``bash
tools/dist_train.sh CONFIG N --search --search-only`` with the same flags on
this node, which measures the layouts and writes the fastest
(docs/layout_search.md).
"""
import os.path as osp
import sys

sys.path.insert(0, osp.dirname(osp.dirname(osp.abspath(__file__))))

from mmpar.analysis.plan_report import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main())
