"""Which data-parallel wrapper a tensor-parallel model gets.

Each wrapper class declares the wrapper that plays its part around a TP
model (``tensor_parallel_wrapper``, :class:`mmpar.wrappers.StepMixin`):
DDP and the bucketed wrapper become ``MMTensorParallelDDP`` (local shards
all-reduced over the data axis, full checkpoints), FSDP2 and
``MMTensorParallelDDP`` stay, FSDP1 and the naive wrapper are refused.
"""
from mmpar.wrappers.builder import DEFAULT_WRAPPER, declared

# DDP arguments with no meaning for the by-hand replication: unused
# parameters are found by the bucket flags, buffers are broadcast once at
# wrap time, gradients always live in the buckets.
_DDP_ONLY_KEYS = ('find_unused_parameters', 'broadcast_buffers',
                  'gradient_as_bucket_view', 'static_graph', 'device_ids')
# What the replicating wrapper (MMTensorParallelDDP) takes.
_REPLICATE_KEYS = ('sync_strategy', 'process_group', 'bucket_cap_mb',
                   'grad_dtype', 'buffer_sync')


def data_parallel_cfg_for_tp(model_wrapper_cfg: dict, tp: int) -> dict:
    """The wrapper config to build around a tensor-parallel model.

    Args:
        model_wrapper_cfg: the config's wrapper (None: the default DDP).
        tp: the tensor-parallel size, for messages.

    Returns:
        A new dict; the input is not mutated.

    Raises:
        ValueError: a wrapper (or DDP argument) that cannot replicate a TP
            model, naming the key, the value and what to use instead.
    """
    cfg = dict(model_wrapper_cfg or {})
    given = cfg.pop('type', DEFAULT_WRAPPER)
    cls = declared(given)
    where = f'model_wrapper_cfg.type={given!r} with parallel.tp={tp}'
    target = cls.tensor_parallel_wrapper
    if target is None:
        raise ValueError(f'{where}: {cls.tensor_parallel_refusal}' if
                         cls.tensor_parallel_refusal else
                         f'{where} is not supported; allowed: '
                         'MMDistributedDataParallel (default), '
                         'MMBucketDataParallel, MMFullyShard')
    if target == cls.__name__:
        return dict(type=given, **cfg)
    for key in list(cfg):
        if key in _DDP_ONLY_KEYS:
            cfg.pop(key)
        elif key not in _REPLICATE_KEYS:
            raise ValueError(
                f'model_wrapper_cfg.{key}={cfg[key]!r}: not supported with '
                f'parallel.tp={tp} (the TP model is replicated by '
                f'{target}); allowed: {", ".join(_REPLICATE_KEYS)}')
    return dict(type=target, **cfg)
