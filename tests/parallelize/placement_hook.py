"""A hook for the placement test: each rank writes where it runs and which
ranks share its tensor-parallel group (imported through custom_imports)."""
import json
import os
import os.path as osp

import torch.distributed as dist
from mmengine.hooks import Hook

from mmpar.registry import HOOKS


@HOOKS.register_module()
class RecordPlacement(Hook):
    """Writes ``placement_rank{R}.json`` into the work dir before training:
    the node (torchrun's ``GROUP_RANK``), local rank and tp group."""

    def before_train(self, runner) -> None:
        from mmpar.parallel import parallel_group_info
        topology = parallel_group_info()
        record = dict(
            rank=dist.get_rank(),
            node=int(os.environ['GROUP_RANK']),
            local_rank=int(os.environ['LOCAL_RANK']),
            tp_ranks=list(topology.tp.global_ranks))
        path = osp.join(runner.work_dir,
                        f'placement_rank{dist.get_rank()}.json')
        with open(path, 'w') as f:
            json.dump(record, f)
