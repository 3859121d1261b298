"""The train/val/test step bodies every mmpar wrapper shares.

DDP, FSDP, naive and bucketed data parallel all mix in :class:`StepMixin`, so
the step contract (MMEngine's BaseModel: ``data_preprocessor``,
``forward(mode=...)``, ``parse_losses``, ``optim_wrapper.update_params``) and
the gradient-sync strategies live in one place and cannot drift apart.
"""
import contextlib
from typing import Any, ContextManager, Dict, Union

import torch
import torch.distributed as dist
from mmengine.optim import OptimWrapper
from torch import nn

from mmpar.parallelize.clip import clip_func_swapped, clip_grad_norm_
from mmpar.parallelize.tensor import local_grad

SYNC_STRATEGIES = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')


def check_sync_strategy(sync_strategy: str) -> str:
    """Return ``sync_strategy`` if it is known.

    Raises:
        ValueError: naming the bad value and the three allowed strategies.
    """
    if sync_strategy not in SYNC_STRATEGIES:
        raise ValueError(f'sync_strategy={sync_strategy!r} is not supported; '
                         f'allowed: {", ".join(SYNC_STRATEGIES)}')
    return sync_strategy


class _NoModel:
    """Stands in for the model in ``optim_wrapper.optim_context``.

    ``OptimWrapper.optim_context(model)`` enters ``model.no_sync()`` on
    non-final micro-batches and, for AMP wrappers, autocast. mmpar decides
    gradient sync itself (:meth:`StepMixin.grad_sync_context`, which must also
    cover backward), so it hands the optim wrapper an object with no
    ``no_sync`` and keeps only the autocast part.
    """


class StepMixin:
    """``train_step`` / ``val_step`` / ``test_step`` for a wrapper.

    A class using it must provide ``module`` (the wrapped BaseModel),
    ``no_sync()`` and ``process_group`` (None means the default group), and
    call :meth:`_init_steps` from its constructor.
    """

    module: nn.Module
    sync_strategy: str = 'single_auto_sync'
    # Process groups over which ranks hold different parameters, whose
    # gradient norms the global-norm clip must also combine (FSDP1's shard
    # group, the pipeline axis).
    clip_extra_groups: tuple = ()

    def _init_steps(self, sync_strategy: str = 'single_auto_sync') -> None:
        self.sync_strategy = check_sync_strategy(sync_strategy)

    # -- hooks a wrapper may override -------------------------------------
    @property
    def eval_forward_module(self) -> nn.Module:
        """What ``val_step``/``test_step`` call forward on.

        The wrapper itself by default: FSDP must run forward through its root
        so parameters are all-gathered. DDP overrides this with the plain
        module, as MMEngine does, because DDP's forward may broadcast buffers,
        a collective that has no place in evaluation.
        """
        return self

    def all_reduce_grads(self) -> None:
        """Average every gradient over the data-parallel group (forced sync).

        Wrappers whose gradients are sharded override this.
        """
        group = getattr(self, 'process_group', None)
        world_size = dist.get_world_size(group)
        grads = [
            local_grad(p) for p in self.module.parameters()
            if p.grad is not None
        ]
        for grad in grads:
            dist.all_reduce(grad, group=group)
            grad.div_(world_size)

    # -- the steps ----------------------------------------------------------
    def grad_sync_context(self,
                          optim_wrapper: OptimWrapper) -> ContextManager:
        """The gradient-sync context for this micro-batch.

        Covers forward *and* backward, so wrappers that read their sync flag
        during backward (naive, bucketed, FSDP) behave like DDP, which reads it
        at forward time.
        """
        if self.sync_strategy == 'multi_auto_sync':
            return contextlib.nullcontext()
        if self.sync_strategy == 'forced_sync':
            return self.no_sync()
        if optim_wrapper.should_sync():
            return contextlib.nullcontext()
        return self.no_sync()

    def train_step(self, data: Union[dict, tuple, list],
                   optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """One micro-batch: preprocess, forward, parse losses, update.

        Args:
            data: a batch from the dataloader.
            optim_wrapper: updates parameters; with ``accumulative_counts = k``
                the optimizer steps every k calls.

        Returns:
            The log variables from ``parse_losses``.
        """
        with self.grad_sync_context(optim_wrapper), \
                clip_func_swapped(optim_wrapper, self.clip_grad_norm):
            with optim_wrapper.optim_context(_NoModel()):
                data = self.module.data_preprocessor(data, training=True)
                losses = self._run_forward(self, data, mode='loss')
            parsed_loss, log_vars = self.module.parse_losses(losses)
            if self.sync_strategy == 'forced_sync':
                self._update_after_forced_sync(optim_wrapper, parsed_loss)
            else:
                optim_wrapper.update_params(parsed_loss)
        return log_vars

    def clip_grad_norm(self, params, max_norm: float, norm_type: float = 2.0,
                       **kwargs) -> torch.Tensor:
        """MMEngine's ``clip_func`` during a step: the one global-norm clip
        (:func:`mmpar.parallelize.clip.clip_grad_norm_`) over every axis."""
        return clip_grad_norm_(params, max_norm, norm_type,
                               extra_groups=self.clip_extra_groups, **kwargs)

    def _update_after_forced_sync(self, optim_wrapper: OptimWrapper,
                                  loss: torch.Tensor) -> None:
        # ``update_params`` with an all-reduce between backward and step.
        optim_wrapper.backward(optim_wrapper.scale_loss(loss))
        if optim_wrapper.should_update():
            self.all_reduce_grads()
            optim_wrapper.step()
            optim_wrapper.zero_grad()

    def val_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions for a validation batch (``mode='predict'``)."""
        data = self.module.data_preprocessor(data, training=False)
        return self._run_forward(self.eval_forward_module, data, 'predict')

    def test_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions for a test batch (``mode='predict'``)."""
        return self.val_step(data)

    @staticmethod
    def _run_forward(target: nn.Module, data: Any, mode: str) -> Any:
        # BaseModel._run_forward's unpacking, on a chosen module.
        if isinstance(data, dict):
            return target(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return target(*data, mode=mode)
        raise TypeError('the data preprocessor must return a dict, list or '
                        f'tuple, got {type(data).__name__}')
