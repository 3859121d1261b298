"""Which data-parallel wrapper a tensor-parallel model gets.

Kept apart from :mod:`mmpar.parallelize.tensor` (which splits layers and
knows nothing of wrappers) because it needs the wrapper classes, whose
shared steps need the tensor helpers: one module each way, no circle.
"""
TP_DDP_WRAPPER = 'MMTensorParallelDDP'
# DDP arguments with no meaning for the by-hand replication: unused
# parameters are found by the bucket flags, buffers are broadcast once at
# wrap time, gradients always live in the buckets.
_DDP_ONLY_KEYS = ('find_unused_parameters', 'broadcast_buffers',
                  'gradient_as_bucket_view', 'static_graph', 'device_ids')
_REPLICATE_KEYS = ('sync_strategy', 'process_group', 'bucket_cap_mb',
                   'grad_dtype')


def data_parallel_cfg_for_tp(model_wrapper_cfg: dict, tp: int) -> dict:
    """The wrapper config to build around a tensor-parallel model.

    * ``MMDistributedDataParallel`` (the default) and
      ``MMBucketDataParallel`` become ``MMTensorParallelDDP``: local shards
      all-reduced over the data axis, full checkpoints;
    * ``MMFullyShard`` (FSDP2) and ``MMTensorParallelDDP`` stay;
    * FSDP1, the naive wrapper and any other wrapper are refused.

    Args:
        model_wrapper_cfg: the config's wrapper (None: the default DDP).
        tp: the tensor-parallel size, for messages.

    Returns:
        A new dict; the input is not mutated.

    Raises:
        ValueError: a wrapper (or DDP argument) that cannot replicate a TP
            model, naming the key, the value and what to use instead.
    """
    from mmpar.wrappers import (MMBucketDataParallel,
                                MMDistributedDataParallel,
                                MMFullyShardedDataParallel, MMFullyShard,
                                MMTensorParallelDDP)
    from mmpar.wrappers.builder import DEFAULT_WRAPPER, wrapper_class
    cfg = dict(model_wrapper_cfg or {})
    given = cfg.pop('type', DEFAULT_WRAPPER)
    cls = wrapper_class(given)
    where = f'model_wrapper_cfg.type={given!r} with parallel.tp={tp}'
    if issubclass(cls, (MMFullyShard, MMTensorParallelDDP)):
        return dict(type=given, **cfg)
    if issubclass(cls, MMFullyShardedDataParallel):
        raise ValueError(
            f'{where}: torch FSDP1 does not compose with tensor parallelism '
            "reliably; allowed: type='MMFullyShard' (FSDP2 over the data "
            "axis) or 'MMDistributedDataParallel'")
    if not issubclass(cls, (MMDistributedDataParallel, MMBucketDataParallel)):
        raise ValueError(
            f'{where} is not supported; allowed: MMDistributedDataParallel '
            '(default), MMBucketDataParallel, MMFullyShard')
    for key in list(cfg):
        if key in _DDP_ONLY_KEYS:
            cfg.pop(key)
        elif key not in _REPLICATE_KEYS:
            raise ValueError(
                f'model_wrapper_cfg.{key}={cfg[key]!r}: not supported with '
                f'parallel.tp={tp} (the TP model is replicated by '
                f'{TP_DDP_WRAPPER}); allowed: {", ".join(_REPLICATE_KEYS)}')
    return dict(type=TP_DDP_WRAPPER, **cfg)
