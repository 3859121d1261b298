from mmpar.checkpoint import CheckpointLoadError, load_checkpoint_file
from mmpar.runner.checkpoint import PlainCheckpointHook
from mmpar.runner.checkpoint_hook import AsyncCheckpointHook
from mmpar.runner.loops import (FastResumeIterBasedTrainLoop,
                                SkippableInfiniteSampler)
from mmpar.runner.nonfinite import NonFiniteLossError, NonFiniteLossHook
from mmpar.runner.permuted_sampler import PermutedInfiniteSampler
from mmpar.runner.runner import Runner
from mmpar.runner.throughput import ThroughputHook

__all__ = [
    'Runner', 'PlainCheckpointHook', 'AsyncCheckpointHook', 'CheckpointLoadError',
    'load_checkpoint_file', 'FastResumeIterBasedTrainLoop',
    'SkippableInfiniteSampler', 'NonFiniteLossHook', 'NonFiniteLossError',
    'ThroughputHook', 'PermutedInfiniteSampler'
]
