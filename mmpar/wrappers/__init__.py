"""Model wrappers: one per file, all sharing :mod:`mmpar.wrappers.base`
(declarations, the description every other module reads, the step body)."""
from mmpar.wrappers.base import SYNC_STRATEGIES, StepMixin, describe
from mmpar.wrappers.bucket import MMBucketDataParallel
from mmpar.wrappers.builder import (DEFAULT_WRAPPER, build_model_wrapper,
                                    check_wrapper_cfg, default_wrapper_cfg,
                                    wrapper_class)
from mmpar.wrappers.ddp import MMDistributedDataParallel
from mmpar.wrappers.description import PipelineParts, WrappedModel
from mmpar.wrappers.fsdp import MMFullyShardedDataParallel
from mmpar.wrappers.fully_shard import MMFullyShard
from mmpar.wrappers.naive import MMNaiveDataParallel
from mmpar.wrappers.tp_replicate import MMTensorParallelDDP

__all__ = [
    'DEFAULT_WRAPPER', 'SYNC_STRATEGIES', 'StepMixin', 'PipelineParts',
    'WrappedModel', 'build_model_wrapper', 'check_wrapper_cfg',
    'default_wrapper_cfg', 'describe', 'wrapper_class',
    'MMDistributedDataParallel', 'MMNaiveDataParallel', 'MMBucketDataParallel',
    'MMFullyShardedDataParallel', 'MMFullyShard', 'MMTensorParallelDDP'
]
