"""``MMTensorParallelDDP``: data parallelism over a tensor-parallel model.

torch's DDP does not take DTensor parameters, and its private DDP+TP
transform (``torch.distributed.tensor.parallel.ddp``) trains but leaves the
tensor-parallel weights out of ``state_dict()`` (measured), so checkpoints
would silently lose them. Replicating a TP model over the data axis only
needs each rank's *local shards* all-reduced over the data group (ranks at
the same tp coordinate hold the same shard): the bucketed wrapper does
exactly that for DTensor parameters. This class declares that its tensors
are tensor-parallel shards (full checkpoints gather them), and is what
``MMDistributedDataParallel`` and ``MMBucketDataParallel`` configs become
when ``parallel.tp > 1``
(:func:`mmpar.parallelize.tp_wrapper.data_parallel_cfg_for_tp`).
"""
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.bucket import MMBucketDataParallel


@MODEL_WRAPPERS.register_module()
class MMTensorParallelDDP(MMBucketDataParallel):
    """Bucketed all-reduce of local shards over the data axis, for TP models.

    Takes :class:`MMBucketDataParallel`'s arguments (``bucket_cap_mb``,
    ``grad_dtype``, ``process_group``, ``sync_strategy``). Checkpoints are
    gathered to the plain model's keys and shapes.
    """

    holds_shards = True
    pipeline_stage_args = {}
