"""``mmpar.Runner``: MMEngine's Runner with the few changes mmpar needs.

Overrides: start-up through :func:`mmpar.dist.init_dist`, model wrapping
through mmpar's ``MODEL_WRAPPERS``, plain-data checkpoints, and validation of
the launcher and wrapper config before any process-group work.
"""
import inspect
from typing import Callable, Optional, Union

import torch
from mmengine.dist import is_distributed
from mmengine.model import is_model_wrapper, revert_sync_batchnorm
from mmengine.model.utils import convert_sync_batchnorm
from mmengine.runner import Runner as MMEngineRunner
from mmengine.runner.checkpoint import (_load_checkpoint,
                                        _load_checkpoint_to_model)
from torch import nn

from mmpar.dist import check_launcher, init_dist, local_rank, uses_cuda
from mmpar.registry import RUNNERS
from mmpar.runner import sharded
from mmpar.runner.checkpoint import PlainCheckpointHook, load_checkpoint_file
from mmpar.wrappers.builder import build_model_wrapper, check_wrapper_cfg

_RUNNER_SIGNATURE = inspect.signature(MMEngineRunner.__init__)


@RUNNERS.register_module()
class Runner(MMEngineRunner):
    """MMEngine's Runner for CPU and GPU, one process or many.

    Takes exactly MMEngine's arguments (see ``mmengine.runner.Runner``); a
    plain MMEngine config runs unchanged.
    """

    def __init__(self, *args, **kwargs):
        given = _RUNNER_SIGNATURE.bind_partial(None, *args, **kwargs).arguments
        check_launcher(given.get('launcher', 'none'))
        # MMEngine reads the wrapper config from ``cfg``, not an argument.
        check_wrapper_cfg((given.get('cfg') or {}).get('model_wrapper_cfg'))
        super().__init__(*args, **kwargs)

    def setup_env(self, env_cfg: dict) -> None:
        if self.distributed and not is_distributed():
            dist_cfg = dict(env_cfg.get('dist_cfg') or {})
            if dist_cfg.get('backend') == 'nccl' and \
                    not torch.cuda.is_available():
                raise ValueError(
                    "env_cfg.dist_cfg.backend='nccl' needs CUDA, which is not "
                    "available; allowed here: 'gloo', or leave it unset")
            init_dist(self.launcher, **dist_cfg)
        super().setup_env(env_cfg)

    def wrap_model(self, model_wrapper_cfg: Optional[dict],
                   model: nn.Module) -> nn.Module:
        if is_model_wrapper(model):
            return super().wrap_model(model_wrapper_cfg, model)
        model = model.to(self._device())
        if self.world_size == 1:
            self.logger.info('World size 1: the model is not wrapped.')
            return revert_sync_batchnorm(model)
        sync_bn = self.cfg.get('sync_bn')
        if sync_bn is not None:
            model = convert_sync_batchnorm(model, sync_bn)
        if model_wrapper_cfg is None and self.cfg.get('find_unused_parameters'):
            model_wrapper_cfg = dict(find_unused_parameters=True)
        if sharded.wrapper_shards(model_wrapper_cfg):
            sharded.init_weights_before_sharding(model)
        return build_model_wrapper(model_wrapper_cfg, model)

    def _init_model_weights(self) -> None:
        if sharded.is_sharded(self.model):
            return  # done in wrap_model, before the parameters were sharded
        super()._init_model_weights()

    def save_checkpoint(self, *args, **kwargs) -> None:
        # MMEngine's save_checkpoint is rank-0 only; a sharded model's full
        # state is gathered by every rank first.
        if not sharded.is_sharded(self.model):
            return super().save_checkpoint(*args, **kwargs)
        with sharded.full_state_for_saving(self):
            super().save_checkpoint(*args, **kwargs)

    @staticmethod
    def _device() -> torch.device:
        if uses_cuda():
            return torch.device('cuda', local_rank())
        return torch.device('cpu')

    def register_hooks(self, default_hooks=None, custom_hooks=None) -> None:
        super().register_hooks(default_hooks, custom_hooks)
        self.register_hook(PlainCheckpointHook())

    def load_checkpoint(self,
                        filename: str,
                        map_location: Union[str, Callable] = 'cpu',
                        strict: bool = False,
                        revise_keys: list = [(r'^module.', '')]) -> dict:
        """Load a checkpoint into the model (``weights_only=True``).

        Local files go through :func:`load_checkpoint_file` (clear errors on
        missing or corrupt files); URLs and other schemes through MMEngine.
        """
        if '://' in filename:
            checkpoint = _load_checkpoint(filename, map_location=map_location)
        else:
            checkpoint = load_checkpoint_file(filename, map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model.module if is_model_wrapper(
            self.model) else self.model
        if sharded.is_sharded(self.model):
            checkpoint = sharded.load_full_checkpoint(self, checkpoint, strict,
                                                      revise_keys)
        else:
            checkpoint = _load_checkpoint_to_model(
                model, checkpoint, strict, revise_keys=revise_keys)
        self._has_loaded = True
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint
