"""mmpar's optim wrappers: MMEngine's, plus what a parallel layout needs.

A model wrapper cannot make MMEngine's ``OptimWrapper`` right on its own:
under FSDP1 torch's ``clip_grad_norm_`` clips each rank by its own shard's
norm, under pipeline parallelism by its own stages' norm, and with mixed
DTensor meshes it fails outright. So the optim wrapper owns the three things
that span the model wrapper and the optimizer, set up once:

* the **global-norm clip** (:func:`mmpar.optim.clip.clip_grad_norm_`),
  combined over the process groups the model wrapper declares
  (``clip_groups``), in place of torch's function from construction on;
* the **gradient-sync policy** under accumulation
  (:meth:`ParallelOptimMixin.grad_sync_context`, covering forward *and*
  backward, since the naive, bucketed and FSDP wrappers read their sync flag
  during backward), and the ``forced_sync`` hooks around the last backward
  and before the step;
* the **non-finite guard** (:mod:`mmpar.optim.nonfinite`), checked in
  ``backward`` on every rank and consulted in ``step``;
* the **token count** of a loss over counted tokens (:mod:`mmpar.optim.
  tokens`): each micro-batch backpropagates its token sum
  (:meth:`ParallelOptimMixin.loss_to_backward`), its count is summed over
  the gradient axis (:meth:`ParallelOptimMixin.count_tokens`), and ``step``
  divides the gradients by the window's count before clipping.

``bind(model)`` tells it the model wrapper once (the Runner does; a
wrapper's first ``train_step`` does it for scripts). Configs keep naming
``OptimWrapper`` / ``AmpOptimWrapper``: in the ``mmpar`` scope these names
are the classes here, and the Runner builds them for MMEngine's names too.
Any other MMEngine optim wrapper a model wrapper is handed gets the same
parts around it (:mod:`mmpar.optim.adopt`).
"""
import contextlib
from typing import ContextManager, Optional, Protocol

import torch
from mmengine.optim import AmpOptimWrapper as MMEngineAmpOptimWrapper
from mmengine.optim import OptimWrapper as MMEngineOptimWrapper

from mmpar import device
from mmpar.optim import tokens
from mmpar.optim.clip import clip_grad_norm_
from mmpar.optim.nonfinite import NonFiniteGuard
from mmpar.registry import OPTIM_WRAPPERS

CPU_AMP_DTYPES = ('bfloat16', )


class SteppedModel(Protocol):
    """What an optim wrapper reads from the model wrapper it is bound to
    (every mmpar wrapper provides it: :class:`mmpar.wrappers.StepMixin`)."""

    sync_strategy: str  # 'single_auto_sync', 'multi_auto_sync', 'forced_sync'
    clip_groups: tuple  # groups whose ranks hold different parameters
    grad_groups: tuple  # groups gradients are averaged over (dp x cp)

    def no_sync(self) -> ContextManager:
        ...

    def before_last_backward(self) -> None:
        """Called before the backward that ends an accumulation window."""

    def finish_grad_sync(self) -> None:
        """Called before every optimizer step (forced sync's all-reduce)."""


def clip_grad_norm_on_every_rank(optim_wrapper: MMEngineOptimWrapper) -> None:
    """MMEngine's ``OptimWrapper._clip_grad`` for a collective norm clip.

    MMEngine skips ``clip_func`` where no parameter has a gradient, but the
    global-norm clip is a collective: a rank without gradients (under FSDP1
    a rank whose flat shard holds only frozen parameters) must still join
    it, or the ranks go out of step and hang (one in the norm's all-reduce,
    the other in the next forward's all-gather). So it is called on every
    rank, with an empty list where there is nothing to clip, and the norm is
    logged as MMEngine logs it.
    """
    params = [
        p for group in optim_wrapper.optimizer.param_groups
        for p in group['params'] if p.requires_grad and p.grad is not None
    ]
    norm = optim_wrapper.clip_func(params, **optim_wrapper.clip_grad_kwargs)
    optim_wrapper.message_hub.update_scalar(
        f'train/{optim_wrapper.grad_name}', float(norm))


class ParallelOptimMixin:
    """The parallel parts of mmpar's optim wrappers (see the module doc)."""

    model: Optional[SteppedModel] = None
    nonfinite_guard: Optional[NonFiniteGuard] = None
    # Tokens counted since the last step over the gradient axis (None: no
    # token-counted loss in this window).
    _window_tokens: Optional[float] = None

    def _init_parallel(self) -> None:
        # Norm clipping goes through the one global clip from the start;
        # value clipping is element-wise, right on shards as it is.
        if getattr(self, 'clip_func', None) is torch.nn.utils.clip_grad_norm_:
            self.clip_func = self.clip_grad_norm

    def bind(self, model: SteppedModel) -> None:
        """Work for ``model`` (a model wrapper) from now on.

        Raises:
            ValueError: already bound to another model.
        """
        if self.model is not None and self.model is not model:
            raise ValueError(
                'this optim wrapper is already bound to another model '
                'wrapper; build one optim wrapper per model')
        self.model = model

    def set_nonfinite_guard(self, guard: Optional[NonFiniteGuard]) -> None:
        """Check every loss with ``guard`` (None: stop checking)."""
        self.nonfinite_guard = guard

    def clip_grad_norm(self, params, max_norm: float,
                       norm_type: float = 2.0, **kwargs) -> torch.Tensor:
        """The global-norm clip over every axis of the bound model."""
        groups = self.model.clip_groups if self.model is not None else ()
        return clip_grad_norm_(params, max_norm, norm_type,
                               extra_groups=groups, **kwargs)

    def _clip_grad(self) -> None:
        """MMEngine's ``_clip_grad``, but the global-norm clip runs on every
        rank (:func:`clip_grad_norm_on_every_rank`); a value clip as
        MMEngine's."""
        # MMEngine's private hook: its step has no public seam between the
        # gradients and the optimizer's step.
        if self.clip_func != self.clip_grad_norm:
            super()._clip_grad()
            return
        clip_grad_norm_on_every_rank(self)

    def grad_sync_context(self) -> ContextManager:
        """Whether this micro-batch's backward syncs gradients: the bound
        model's ``no_sync()`` or nothing, by its ``sync_strategy``."""
        model = self.model
        if model is None or model.sync_strategy == 'multi_auto_sync':
            return contextlib.nullcontext()
        if model.sync_strategy == 'forced_sync' or not self.should_sync():
            return model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, terms: Optional[dict] = None,
                 **kwargs) -> None:
        """Check ``loss`` (guard), then MMEngine's backward.

        Args:
            loss: the scaled loss.
            terms: the loss terms, for the guard's message.
            **kwargs: passed to ``loss.backward``.
        """
        self._check(loss, terms)
        if self.model is not None and self.should_sync():
            self.model.before_last_backward()
        super().backward(loss, **kwargs)

    def loss_to_backward(self, loss: torch.Tensor,
                         log_vars: dict) -> torch.Tensor:
        """What one micro-batch backpropagates.

        MMEngine's ``scale_loss(loss)`` (divided by the accumulation count);
        for a loss over counted tokens (``log_vars`` holds ``num_tokens``)
        its token sum: :meth:`step` divides the gradients by the tokens of
        the whole window, which :meth:`count_tokens` adds up.
        """
        if not tokens.is_token_counted(log_vars):
            return self.scale_loss(loss)
        return tokens.token_sum(loss, log_vars)

    def count_tokens(self, log_vars: dict) -> dict:
        """Add a micro-batch's token count to the window, summed over the
        ranks that read different tokens (the bound model's
        ``grad_groups``: collective over them).

        Returns:
            The log variables over those ranks (token-weighted means, the
            summed count): what one process logs for the micro-batch.
            ``log_vars`` itself for a loss without a count.
        """
        if not tokens.is_token_counted(log_vars):
            return log_vars
        log_vars, count = tokens.reduce_token_log_vars(
            log_vars, self._grad_groups())
        self._window_tokens = (self._window_tokens or 0.0) + count
        return log_vars

    def _grad_groups(self) -> tuple:
        return self.model.grad_groups if self.model is not None else ()

    def _normalise_by_tokens(self) -> None:
        """Gradients of the window's token sums, averaged over the gradient
        axis (``G`` ranks), times ``G / N``: the gradient of the loss over
        the ``N`` tokens counted."""
        if self._window_tokens is None:
            return
        factor = tokens.group_size(self._grad_groups()) / max(
            self._window_tokens, 1.0)
        self._window_tokens = None
        tokens.scale_grads(
            (p for group in self.param_groups for p in group['params']),
            factor)

    def record_backward(self, loss: torch.Tensor,
                        terms: Optional[dict] = None) -> None:
        """Count a backward that ran elsewhere (a pipeline schedule ran it
        micro-batch by micro-batch) as ``backward`` would: the guard checks
        ``loss`` and the accumulation counter advances."""
        self._check(loss, terms)
        # MMEngine's backward counts here; no public way to count without
        # running a backward.
        self._inner_count += 1

    def _check(self, loss: torch.Tensor, terms: Optional[dict]) -> None:
        if self.nonfinite_guard is not None:
            self.nonfinite_guard.check(loss, terms)

    def step(self, **kwargs) -> None:
        """The model's last gradient sync (always: forced sync's buckets may
        already be in flight), the guard's skip, the division by the
        window's token count, then MMEngine's step (clip, optimizer step):
        the clip sees the final gradients."""
        if self.model is not None:
            self.model.finish_grad_sync()
        if self.nonfinite_guard is not None and \
                not self.nonfinite_guard.allow_step():
            self._window_tokens = None
            return
        self._normalise_by_tokens()
        super().step(**kwargs)

    def zero_grad(self, **kwargs) -> None:
        """MMEngine's, and the window's token count starts again."""
        self._window_tokens = None
        super().zero_grad(**kwargs)


@OPTIM_WRAPPERS.register_module(name='OptimWrapper')
class OptimWrapper(ParallelOptimMixin, MMEngineOptimWrapper):
    """MMEngine's ``OptimWrapper`` for every parallel layout.

    Takes MMEngine's arguments (``optimizer``, ``accumulative_counts``,
    ``clip_grad``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_parallel()


@OPTIM_WRAPPERS.register_module(name='AmpOptimWrapper')
class AmpOptimWrapper(ParallelOptimMixin, MMEngineAmpOptimWrapper):
    """MMEngine's AMP optim wrapper for every layout, plus bf16 on CPU.

    MMEngine 0.10.7's ``AmpOptimWrapper`` refuses to start without an
    accelerator, although its ``autocast`` does bf16 on CPU. bf16 keeps
    fp32's exponent range, so CPU training needs no loss scaling: on CPU this
    wrapper uses a disabled ``GradScaler``.

    Args:
        loss_scale: as MMEngine's (used on accelerators only).
        dtype: autocast dtype; on CPU only ``'bfloat16'`` (the default there).
        use_fsdp: use ``ShardedGradScaler`` (accelerators only).
        **kwargs: passed to ``OptimWrapper``.

    Raises:
        ValueError: a CPU ``dtype`` other than bfloat16.
    """

    def __init__(self, loss_scale='dynamic', dtype=None, use_fsdp=False,
                 **kwargs):
        if device.uses_accelerator():
            super().__init__(loss_scale, dtype, use_fsdp, **kwargs)
        else:
            dtype = dtype or 'bfloat16'
            name = str(dtype).replace('torch.', '')
            if name not in CPU_AMP_DTYPES:
                raise ValueError(
                    f'optim_wrapper.dtype={dtype!r} is not supported for AMP '
                    f'on CPU; allowed: {", ".join(CPU_AMP_DTYPES)}')
            MMEngineOptimWrapper.__init__(self, **kwargs)
            self._scale_update_param = None
            self.loss_scaler = torch.amp.GradScaler('cpu', enabled=False)
            self.cast_dtype = torch.bfloat16
        self._init_parallel()
