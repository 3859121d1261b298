"""MMEngine's own optim wrappers under mmpar's model wrappers.

Code written for MMEngine's model wrappers hands ``train_step`` an
``mmengine.optim.OptimWrapper``: MMEngine's ``Runner`` (``runner_type``),
a downstream project's loop, the optim-wrapper subclasses downstream
projects register. mmpar's step body needs what :class:`~mmpar.optim.
optim_wrapper.ParallelOptimMixin` adds (the global-norm clip over every
axis, the gradient-sync policy, the non-finite guard, token-counted
losses). :class:`AdoptedOptimWrapper` adds them *around* the caller's
object instead of replacing it: every call goes to that object's own
methods, so a subclass's ``backward`` / ``step`` / ``optim_context`` run
and its counters (``inner_count``, the accumulation window) advance as the
caller expects. Nothing of the object is replaced; only while one ``step``
runs does its norm clip (MMEngine's ``clip_func`` attribute, torch's
``clip_grad_norm_``, and MMEngine's ``_clip_grad``, which calls it) go
through the global one on every rank, which a sharded or split model needs
to clip as one process would.
"""
import contextlib
import functools
from typing import Iterator

import torch
from mmengine.optim import OptimWrapper as MMEngineOptimWrapper

from mmpar.failures import ConfigError
from mmpar.optim.optim_wrapper import (ParallelOptimMixin,
                                       clip_grad_norm_on_every_rank)


class _Forward:
    """What :class:`ParallelOptimMixin`'s ``super()`` calls reach, forwarded
    to ``self.inner`` (the rest of MMEngine's ``OptimWrapper`` interface is
    forwarded by :meth:`AdoptedOptimWrapper.__getattr__`)."""

    inner: MMEngineOptimWrapper

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.inner.backward(loss, **kwargs)

    def step(self, **kwargs) -> None:
        with self._global_norm_clip():
            self.inner.step(**kwargs)

    def zero_grad(self, **kwargs) -> None:
        self.inner.zero_grad(**kwargs)

    @property
    def _inner_count(self) -> int:
        # The caller's accumulation counter: record_backward advances it.
        return self.inner._inner_count

    @_inner_count.setter
    def _inner_count(self, value: int) -> None:
        self.inner._inner_count = value

    @contextlib.contextmanager
    def _global_norm_clip(self) -> Iterator[None]:
        inner = self.inner
        if getattr(inner, 'clip_func', None) is not \
                torch.nn.utils.clip_grad_norm_:
            yield  # no clip, a value clip (element-wise), or the caller's
            return
        # MMEngine's _clip_grad calls self.clip_func: for this step only, the
        # global norm (torch's would clip FSDP1 by each rank's shard, a
        # pipeline stage by its own stage's norm), called on every rank as
        # mmpar's own wrappers call it (MMEngine's _clip_grad skips a rank
        # without gradients, which would leave the others in the
        # collective). A subclass's own _clip_grad is left to run.
        inner.clip_func = self.clip_grad_norm
        own_clip = type(inner)._clip_grad is not \
            MMEngineOptimWrapper._clip_grad
        if not own_clip:
            inner._clip_grad = functools.partial(
                clip_grad_norm_on_every_rank, inner)
        try:
            yield
        finally:
            inner.clip_func = torch.nn.utils.clip_grad_norm_
            if not own_clip:
                del inner._clip_grad


class AdoptedOptimWrapper(ParallelOptimMixin, _Forward):
    """An MMEngine optim wrapper with mmpar's parallel parts around it.

    Args:
        optim_wrapper: MMEngine's ``OptimWrapper`` or ``AmpOptimWrapper``,
            or any subclass; used as it is (see the module doc).

    Raises:
        TypeError: not an MMEngine optim wrapper.
        ConfigError: a subclass with its own ``update_params``.
    """

    def __init__(self, optim_wrapper: MMEngineOptimWrapper):
        if not isinstance(optim_wrapper, MMEngineOptimWrapper):
            raise TypeError(
                'a model wrapper\'s train_step takes an optim wrapper '
                '(mmengine.optim.OptimWrapper, AmpOptimWrapper or a '
                f'subclass); got {type(optim_wrapper).__name__}')
        if type(optim_wrapper).update_params is not \
                MMEngineOptimWrapper.update_params:
            # mmpar's step body calls backward, step and zero_grad itself
            # (the gradient sync policy, the clip over every axis, the
            # non-finite guard around them): an own update_params would be
            # skipped, silently.
            raise ConfigError(
                f'optim_wrapper: {type(optim_wrapper).__name__} overrides '
                'update_params, which a parallel wrapper\'s train_step does '
                'not call (it calls backward, step and zero_grad, which a '
                'subclass may override); allowed: move the change into '
                'backward or step, or train at world size 1 (no wrapper)')
        self.inner = optim_wrapper

    def __getattr__(self, name: str):
        # Everything else (scale_loss, should_update, optim_context,
        # param_groups, state_dict, ...) is the caller's object's. Only
        # reached for names not found above.
        if name == 'inner':
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f'AdoptedOptimWrapper({self.inner!r})'
