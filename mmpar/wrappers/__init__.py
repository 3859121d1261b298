"""Model wrappers: one per file, all sharing :mod:`mmpar.wrappers.base`."""
from mmpar.wrappers.base import SYNC_STRATEGIES, StepMixin
from mmpar.wrappers.bucket import MMBucketDataParallel
from mmpar.wrappers.builder import build_model_wrapper, check_wrapper_cfg
from mmpar.wrappers.ddp import MMDistributedDataParallel
from mmpar.wrappers.fsdp import MMFullyShardedDataParallel
from mmpar.wrappers.fully_shard import MMFullyShard
from mmpar.wrappers.naive import MMNaiveDataParallel
from mmpar.wrappers.tp_replicate import MMTensorParallelDDP

__all__ = [
    'SYNC_STRATEGIES', 'StepMixin', 'build_model_wrapper', 'check_wrapper_cfg',
    'MMDistributedDataParallel', 'MMNaiveDataParallel', 'MMBucketDataParallel',
    'MMFullyShardedDataParallel', 'MMFullyShard', 'MMTensorParallelDDP'
]
