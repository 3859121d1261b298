"""The one place that decides how a model is parallelised, in a fixed order.

``parallelize`` applies, as torchtitan's and picotron's compose functions do:

1. tensor parallelism over ``mesh['tp']`` (``parallel.tp_plan``),
2. the pipeline split over ``mesh['pp']`` (``parallel.pipeline``),
3. activation checkpointing and ``torch.compile`` (today options of the FSDP
   wrappers),
4. the data-parallel wrapper over the data axis (``mesh['dp']``, or
   ``mesh['dp_replicate', 'dp_shard']`` for HSDP).

Step 2 (:mod:`mmpar.parallelize.pipeline`) cuts this rank's stages and
wraps each one in step 4. With ``tp > 1`` the data-parallel wrapper is the
one that composes with TP (:func:`mmpar.parallelize.tp_wrapper.
data_parallel_cfg_for_tp`: DDP becomes ``MMTensorParallelDDP``, FSDP1 is
refused). The module also gives the one answer to "does this wrapper shard
the parameters?".
"""
from typing import Optional

from mmengine.dist import broadcast
from torch import nn

from mmpar.failures import ConfigError
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.topology import ParallelTopology
from mmpar.parallelize.compile import apply_compile
from mmpar.parallelize.tensor import apply_tp
from mmpar.parallelize.tp_wrapper import data_parallel_cfg_for_tp
from mmpar.wrappers.builder import (DEFAULT_WRAPPER, build_model_wrapper,
                                    wrapper_class)
from mmpar.wrappers.full_state import FullStateMixin


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a wrapper that shards its parameters."""
    return isinstance(model, FullStateMixin)


def wrapper_shards(model_wrapper_cfg: Optional[dict]) -> bool:
    """Whether the wrapper this config builds shards its parameters."""
    cls = wrapper_class((model_wrapper_cfg or {}).get('type', DEFAULT_WRAPPER))
    return issubclass(cls, FullStateMixin)


def init_weights_before_sharding(model: nn.Module) -> None:
    """MMEngine's ``_init_model_weights``, on the plain model.

    MMEngine runs ``init_weights`` and broadcasts every tensor after
    wrapping, which aborts (gloo) or fails (``c10d.broadcast_ ... does not
    have a sharding strategy``) on sharded parameters. Here it runs before
    sharding; the Runner then skips its own version for sharded models.
    """
    if hasattr(model, 'init_weights'):
        model.init_weights()
        for tensor in model.state_dict().values():
            broadcast(tensor)


def _tensor_parallel(model: nn.Module, topology: ParallelTopology,
                     parallel: ParallelConfig) -> nn.Module:
    if not topology.dims.tp_enabled:
        return model
    return apply_tp(model, topology.mesh['tp'], parallel.tp_plan)


def _pipeline(model: nn.Module, topology: ParallelTopology,
              parallel: ParallelConfig, model_wrapper_cfg: dict) -> nn.Module:
    # Split over mesh['pp']; each stage gets the data-parallel wrapper.
    from mmpar.parallelize.pipeline import pipeline_parallelize
    return pipeline_parallelize(model, topology, parallel, model_wrapper_cfg,
                                _data_parallel)


def _data_parallel(model: nn.Module, model_wrapper_cfg: dict) -> nn.Module:
    # Wrappers find the data axis themselves (mmpar.parallel.data_mesh and
    # default_dp_group), so one built outside the Runner agrees with it.
    return build_model_wrapper(model_wrapper_cfg, model)


def parallelize(model: nn.Module,
                topology: Optional[ParallelTopology],
                parallel_cfg,
                model_wrapper_cfg: Optional[dict],
                compile_cfg=None) -> nn.Module:
    """Lay ``model`` out over the ranks: TP, PP, compile, then the DP wrapper.

    Args:
        model: the plain model, on its device.
        topology: this rank's topology (None: no process group; the model
            is returned unwrapped).
        parallel_cfg: the ``parallel`` section (dict, ParallelConfig or
            None).
        model_wrapper_cfg: the data-parallel wrapper to build.
        compile_cfg: ``model_compile`` (per-block ``torch.compile``), applied
            after the split and before the data-parallel wrapper, as
            torchtitan orders it; also without a topology (one process).

    Returns:
        The wrapped model.

    Raises:
        ConfigError: a technique the layout asks for that is not available.
    """
    if topology is None:
        return apply_compile(model, compile_cfg)
    parallel = ParallelConfig.from_cfg(parallel_cfg)
    if topology.dims.tp_enabled:
        model_wrapper_cfg = data_parallel_cfg_for_tp(model_wrapper_cfg,
                                                     topology.dims.tp)
    if topology.dims.tp_enabled or topology.dims.pp_enabled or \
            wrapper_shards(model_wrapper_cfg):
        # (pp: before the split, while every rank holds the whole model.)
        init_weights_before_sharding(model)
    model = _tensor_parallel(model, topology, parallel)
    if topology.dims.pp_enabled:
        if compile_cfg:
            raise ConfigError(
                f'model_compile={compile_cfg!r} with parallel.pp='
                f'{topology.dims.pp} is not supported yet; allowed: '
                'model_compile=None with pipeline parallelism')
        return _pipeline(model, topology, parallel, model_wrapper_cfg)
    model = apply_compile(model, compile_cfg)
    return _data_parallel(model, model_wrapper_cfg)
