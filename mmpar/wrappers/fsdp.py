"""``MMFullyShardedDataParallel``: torch FSDP1 with MMEngine's steps."""
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

from mmpar.device import current_device, uses_accelerator
from mmpar.parallel.mesh import fallback_data_mesh
from mmpar.parallel.sharding import (HYBRID, SHARDING_STRATEGIES, UNHYBRID,
                                     is_hybrid)
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers import fsdp_args as args
from mmpar.wrappers import full_state
from mmpar.wrappers.base import StepMixin
from mmpar.wrappers.dp_base import broadcast_module_state
from mmpar.wrappers.policies import check_wrap_policy, resolve_wrap_policy


@MODEL_WRAPPERS.register_module()
class MMFullyShardedDataParallel(StepMixin, FullyShardedDataParallel):
    """FSDP (torch's ``FullyShardedDataParallel``) plus the mmpar steps.

    ``val_step``/``test_step`` call forward through this FSDP root, which
    all-gathers the parameters (the inner module alone holds only shards).

    Args:
        module: the model (an MMEngine ``BaseModel``).
        sync_strategy: ``'single_auto_sync'`` (reduce-scatter on the last
            micro-batch of an accumulation window) or ``'multi_auto_sync'``
            (every micro-batch). ``'forced_sync'`` is rejected.
        sharding_strategy: a ``ShardingStrategy`` or its name; default
            FULL_SHARD.
        process_group: FSDP's group, or for HYBRID strategies a
            ``(shard_group, replicate_group)`` tuple; wins over
            ``device_mesh``.
        device_mesh: the data axis as a mesh: 1-D (shard over it) or 2-D
            ``(replicate, shard)``: HSDP, FULL_SHARD becoming HYBRID_SHARD.
            The Runner passes the layout's data axis. None (and no
            ``process_group``): the whole world, for HYBRID split into shard
            groups of ``hybrid_shard_size`` consecutive ranks (default: one
            node's, ``LOCAL_WORLD_SIZE``).
        hybrid_shard_size: ranks per shard group for HYBRID strategies
            with neither ``process_group`` nor ``device_mesh``.
        cpu_offload: None, bool or ``CPUOffload`` (needs CUDA).
        fsdp_auto_wrap_policy: None, a registered name, ``dict(type=NAME,
            **kwargs)`` or a callable (see :mod:`mmpar.wrappers.policies`).
        backward_prefetch: None, ``'pre'``, ``'post'``, the enum names or a
            ``BackwardPrefetch``.
        mixed_precision: None, ``MixedPrecision`` or a dict of dtype names.
        sync_module_states: broadcast rank 0's parameters at wrap time.
        buffer_sync: ``'broadcast'`` (default), ``'average'`` or None: how
            buffers (BatchNorm statistics) are made equal over the data axis
            before evaluation and checkpoints (:mod:`mmpar.wrappers.buffers`).
        use_orig_params: default True, so optimizers and parameter groups see
            the model's own parameters.
        device_id: None picks ``torch.device('cpu')`` on CPU (FSDP refuses
            CPU without it) and the current CUDA device on CUDA.
        **kwargs: any other ``FullyShardedDataParallel`` argument.

    Raises:
        ValueError / TypeError: a bad argument, naming key, value and allowed
            values.
    """

    shards_parameters = True
    holds_shards = True
    data_axis_arg = 'device_mesh'
    meta_materialize = 'param_init_fn'
    supports_forced_sync = False
    cfg_checks = dict(sharding_strategy=args.normalize_sharding_strategy,
                      cpu_offload=args.normalize_cpu_offload,
                      fsdp_auto_wrap_policy=check_wrap_policy,
                      backward_prefetch=args.normalize_backward_prefetch,
                      mixed_precision=args.normalize_mixed_precision)
    tensor_parallel_refusal = (
        'torch FSDP1 does not compose with tensor parallelism reliably; '
        "allowed: type='MMFullyShard' (FSDP2 over the data axis) or "
        "'MMDistributedDataParallel'")

    def __init__(self,
                 module: nn.Module,
                 sync_strategy: str = 'single_auto_sync',
                 sharding_strategy: Union[str, ShardingStrategy, None] = None,
                 process_group=None,
                 device_mesh: Optional[DeviceMesh] = None,
                 hybrid_shard_size: Optional[int] = None,
                 cpu_offload=None,
                 fsdp_auto_wrap_policy=None,
                 backward_prefetch=None,
                 mixed_precision=None,
                 sync_module_states: bool = False,
                 use_orig_params: bool = True,
                 device_id=None,
                 buffer_sync: Optional[str] = 'broadcast',
                 **kwargs) -> None:
        # Each argument is normalised once below (with check_cfg's errors).
        self._init_steps(sync_strategy, buffer_sync)
        strategy = args.normalize_sharding_strategy(sharding_strategy)
        offload = args.normalize_cpu_offload(cpu_offload)
        if offload is not None and offload.offload_params and not uses_accelerator():
            raise ValueError(
                'cpu_offload=True needs CUDA: FSDP pins the offloaded '
                'parameters in host memory, which fails without an '
                'accelerator (on CPU the parameters already live in host '
                'memory); use cpu_offload=None')
        strategy, process_group = self._data_axis(
            strategy, process_group, device_mesh, hybrid_shard_size)
        if device_id is None:
            device_id = current_device()
        if sync_module_states and not uses_accelerator():
            # torch's FSDP1 refuses sync_module_states for CPU modules
            # ("requires them to be on GPU", even with device_id=cpu). The
            # broadcast it would do is this one: rank 0's state to every
            # rank. A model built on the meta device (param_init_fn) needs
            # none: every rank fills it with the one-process values.
            if kwargs.get('param_init_fn') is None:
                broadcast_module_state(module)
            sync_module_states = False
        super().__init__(
            module,
            process_group=process_group,
            sharding_strategy=strategy,
            cpu_offload=offload,
            auto_wrap_policy=resolve_wrap_policy(fsdp_auto_wrap_policy,
                                                 module),
            backward_prefetch=args.normalize_backward_prefetch(
                backward_prefetch),
            mixed_precision=args.normalize_mixed_precision(mixed_precision),
            sync_module_states=sync_module_states,
            use_orig_params=use_orig_params,
            device_id=device_id,
            **kwargs)
        # (shard, replicate) for HYBRID, else the one group.
        self._groups = process_group if isinstance(process_group, tuple) \
            else (process_group, )
        self.buffer_groups = self._groups

    @staticmethod
    def _data_axis(strategy, process_group, mesh, shard_size):
        """(strategy, process group) over the data axis.

        Explicit groups win; else the data mesh decides: a 2-D mesh
        (replicate x shard) makes a FULL_SHARD / SHARD_GRAD_OP wrapper HSDP
        (HYBRID_SHARD / _HYBRID_SHARD_ZERO2), the layout deciding, so FSDP1
        agrees with FSDP2 and DDP about the data axis; a HYBRID strategy on
        a 1-D mesh is the plain strategy it then equals.

        torch FSDP1 silently switches to NO_SHARD over the shard group when
        that group has one rank, which then never syncs gradients across the
        replicate group (measured: ranks end with different gradients). A
        one-rank side of the hybrid is therefore rewritten to the plain
        strategy it is equivalent to.

        Raises:
            ValueError: NO_SHARD on a 2-D mesh (it replicates over the whole
                data axis: give the 1-D one); a HYBRID strategy with a
                process group that is not a (shard, replicate) pair.
        """
        name = strategy.name
        if process_group is None:
            if mesh is None:
                mesh = fallback_data_mesh(is_hybrid(strategy), shard_size)
            if mesh.ndim == 1:
                return (ShardingStrategy[UNHYBRID.get(name, name)],
                        mesh.get_group())
            if not SHARDING_STRATEGIES[name].shards:
                raise ValueError(
                    f'sharding_strategy={name!r} replicates over the whole '
                    'data axis; allowed: a 1-D device_mesh, got '
                    f'{mesh.mesh_dim_names}')
            process_group = (mesh.get_group(1), mesh.get_group(0))
            if not is_hybrid(name):  # its hybrid twin
                strategy = ShardingStrategy[HYBRID[name]]
        elif not is_hybrid(strategy):
            return strategy, process_group
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(f'process_group={process_group!r}: a HYBRID '
                             'sharding strategy needs a (shard_group, '
                             'replicate_group) tuple or None')
        shard, replicate = process_group
        if dist.get_world_size(shard) == 1:
            return ShardingStrategy.NO_SHARD, replicate
        if dist.get_world_size(replicate) == 1:
            # The plain strategy of the hybrid one, from the one table.
            return ShardingStrategy[UNHYBRID[strategy.name]], shard
        return strategy, process_group

    def reshard_parameters(self) -> None:
        """Free the gathered flat parameters a forward kept.

        FSDP1 keeps the root's parameters gathered after its forward (for
        the backward, which frees them); after an evaluation forward they
        stay, and the next forward uses them without gathering again, so an
        edit of the local shards in between would be lost (measured).
        """
        # FSDP1's private _is_root: None before its lazy init (no public).
        if self._is_root is None:
            return  # before the first forward (lazy init): none gathered
        # Private: torch 2.13's FSDP1 has no public call that frees them.
        from torch.distributed.fsdp._runtime_utils import _reshard
        for module in FullyShardedDataParallel.fsdp_modules(self):
            handle = module._handle  # FSDP1's private flat-param handle
            if handle is not None and handle.uses_sharded_strategy:
                _reshard(module, handle, free_unsharded_flat_param=True)

    @property
    def clip_groups(self) -> tuple:
        """The shard group, for the global-norm clip.

        FSDP1's flat parameters are plain tensors holding this rank's shard,
        so torch's ``clip_grad_norm_`` (MMEngine's) would clip each rank by
        its own, too small norm; the one clip
        (:func:`mmpar.optim.clip.clip_grad_norm_`) sums the shards' norms
        over this group. NO_SHARD keeps whole gradients: nothing to sum.
        """
        if self.sharding_strategy == ShardingStrategy.NO_SHARD:
            return ()
        return (self.process_group, )

    @property
    def state_module(self) -> nn.Module:
        return self  # the FSDP root

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        # Flat parameters are no DTensors: torch's API cuts them.
        return full_state.load_through_torch(self, state_dict, strict)

    @property
    def axes(self) -> dict:
        if self.sharding_strategy == ShardingStrategy.NO_SHARD:
            return {'reduce': self.process_group}
        return dict(zip(('shard', 'replicate'), self._groups))
