"""What every mmpar wrapper shares: its declarations and the one step body.

DDP, FSDP1, FSDP2, naive and bucketed data parallel, the tensor-parallel DDP
and the pipeline all mix in :class:`StepMixin`, so the step contract
(MMEngine's BaseModel: ``data_preprocessor``, ``forward(mode=...)``,
``parse_losses``, the optim wrapper's accumulation) lives in one place and
cannot drift apart. A wrapper class *declares* what it is (class attributes
below); :func:`describe` turns that into the one description every other
module reads.
"""
from typing import Any, Callable, ClassVar, Dict, Optional, Tuple, Union

import torch
from mmengine.model import BaseModel, is_model_wrapper
from mmengine.optim import OptimWrapper as MMEngineOptimWrapper
from mmengine.optim import OptimWrapperDict
from torch import nn

from mmpar.optim import ParallelOptimMixin
from mmpar.optim.adopt import AdoptedOptimWrapper
from mmpar.parallel.sequence import SETTING_ATTR, shard_batch
from mmpar.wrappers import full_state
from mmpar.wrappers.buffers import check_buffer_sync, sync_buffers
from mmpar.wrappers.description import WrappedModel
from mmpar.wrappers.forced_sync import DEFAULT_BUCKET_CAP_MB, ForcedSyncBuckets

SYNC_STRATEGIES = ('single_auto_sync', 'multi_auto_sync', 'forced_sync')


class StepMixin:
    """Declarations and ``train_step`` / ``val_step`` / ``test_step``.

    A class using it provides ``module`` (the wrapped BaseModel) and
    ``no_sync()``, and calls :meth:`_init_steps` from its constructor.
    """

    # -- what the class is, declared once (read through describe()) --------
    #: Parameters are sharded over the data axis (FSDP): they are
    #: initialised before sharding, and no rank holds them whole.
    shards_parameters: ClassVar[bool] = False
    #: Some tensors are only this rank's part (FSDP, TP DTensors): full
    #: checkpoints gather them and key optimizer state by names.
    holds_shards: ClassVar[bool] = False
    #: How compose hands it the data axis: ``'process_group'`` (a group) or
    #: ``'device_mesh'`` (1-D, or 2-D replicate x shard for HSDP).
    data_axis_arg: ClassVar[str] = 'process_group'
    #: The registered wrapper that plays this one's part around a
    #: tensor-parallel model; None: refused (see ``tensor_parallel_refusal``).
    tensor_parallel_wrapper: ClassVar[Optional[str]] = None
    tensor_parallel_refusal: ClassVar[str] = ''
    #: None: cannot wrap a pipeline stage; else the arguments a stage needs.
    pipeline_stage_args: ClassVar[Optional[dict]] = None
    #: More arguments for a stage whose parameters the schedule keeps
    #: gathered through the step (``parallel.pipeline.
    #: reshard_per_microbatch=False``, or a zero-bubble schedule).
    pipeline_held_stage_args: ClassVar[dict] = {}
    #: When a model built on the meta device gets real parameters:
    #: ``'before'`` the wrapper is built (it needs them: buckets,
    #: broadcasts), ``'after'`` (FSDP2 shards meta parameters, then only the
    #: local shards are allocated), or through the named constructor
    #: argument, unit by unit as it wraps (FSDP1's ``'param_init_fn'``).
    meta_materialize: ClassVar[str] = 'before'
    #: Takes ``expert_mesh`` (the ``efsdp`` mesh) and reduces the experts'
    #: gradients over it only, so it can wrap an expert-parallel model
    #: (``parallel.ep > 1``).
    expert_parallel: ClassVar[bool] = False
    #: Named by ``model_wrapper_cfg.type``; False: mmpar builds it itself
    #: (the pipeline wrapper, from ``parallel.pp`` and ``parallel.pipeline``).
    from_config: ClassVar[bool] = True
    #: Keyword arguments ``__init__`` passes on through an open ``**kwargs``
    #: (to a function it names, e.g. torch's ``fully_shard``): the config
    #: check allows them besides ``__init__``'s own. Empty: not declared.
    forwarded_kwargs: ClassVar[Tuple[str, ...]] = ()

    module: nn.Module
    # The data-parallel group gradients are reduced over (None: the world).
    process_group: Any = None
    sync_strategy: str = 'single_auto_sync'
    # Groups over which ranks hold different parameters, whose gradient
    # norms the global-norm clip combines (FSDP1's shard group, the pp axis).
    clip_groups: tuple = ()
    # Groups buffers are made equal over, one after the other (the gradient
    # axis dp x cp; a 2-D mesh's two dims). (None,) is the whole world.
    buffer_groups: tuple = (None, )
    # forced_sync's buckets; built by _init_forced_sync (which also lets them
    # start during the last backward) or on first use.
    _forced_sync: Optional[ForcedSyncBuckets] = None
    #: False: gradients are reduced inside backward (FSDP), so there is no
    #: separate all-reduce for ``forced_sync`` to force.
    supports_forced_sync: ClassVar[bool] = True
    #: The constructor arguments :meth:`check_cfg` checks besides
    #: ``sync_strategy`` and ``buffer_sync``: name -> function returning the
    #: value normalised, raising an error that names key and allowed values.
    cfg_checks: ClassVar[Dict[str, Callable]] = {}

    @classmethod
    def check_cfg(cls, cfg: dict) -> dict:
        """Validate wrapper arguments before any process-group work (the
        builder calls it; so do constructors, before their collectives).
        Model-dependent checks (class names in a wrap policy) run when the
        wrapper is built.

        Returns:
            A copy of ``cfg``, each checked value normalised.

        Raises:
            ValueError / TypeError: a bad value, naming key, value and the
                allowed values.
        """
        cfg = dict(cfg)
        checks = dict(sync_strategy=cls.check_sync_strategy,
                      buffer_sync=check_buffer_sync, **cls.cfg_checks)
        for key, check in checks.items():
            if key in cfg:
                cfg[key] = check(cfg[key])
        return cfg

    @classmethod
    def check_sync_strategy(cls, sync_strategy: str) -> str:
        """Return ``sync_strategy`` if it is known and this class runs it.

        Raises:
            ValueError: naming the bad value and the allowed strategies.
        """
        if sync_strategy not in SYNC_STRATEGIES:
            raise ValueError(
                f'sync_strategy={sync_strategy!r} is not supported; '
                f'allowed: {", ".join(SYNC_STRATEGIES)}')
        if sync_strategy == 'forced_sync' and not cls.supports_forced_sync:
            raise ValueError(
                f"sync_strategy='forced_sync' is not supported by "
                f'{cls.__name__}: FSDP reduce-scatters gradients inside '
                'backward, so there is no separate all-reduce to force; use '
                'single_auto_sync (one sync per accumulation window) or '
                'multi_auto_sync')
        return sync_strategy

    def _init_steps(self,
                    sync_strategy: str = 'single_auto_sync',
                    buffer_sync: Optional[str] = None) -> None:
        self.sync_strategy = self.check_sync_strategy(sync_strategy)
        # mmpar/wrappers/buffers.py: every data-parallel wrapper passes
        # 'broadcast' by default (DDP too: it broadcasts only before training
        # forwards, so the last one leaves each rank its own statistics).
        self.buffer_sync = check_buffer_sync(buffer_sync)
        self._buffers_in_sync = True

    # -- the description ----------------------------------------------------
    @property
    def state_module(self) -> nn.Module:
        """The module whose state-dict names are the plain model's."""
        return self.module

    @property
    def axes(self) -> Dict[str, Any]:
        """What it communicates over (``'reduce'``, or ``'shard'`` and
        ``'replicate'``): process groups."""
        return {'reduce': self.process_group}

    @property
    def description(self) -> WrappedModel:
        """What this wrapped model is (:func:`describe`)."""
        return WrappedModel(
            model=self.module,
            state_module=self.state_module,
            shards_parameters=self.shards_parameters,
            holds_shards=self.holds_shards,
            axes=self.axes,
            sync_buffers=self.sync_buffers,
            load_full_state=self.load_full_state_dict,
            reshard=self.reshard_parameters)

    @property
    def grad_groups(self) -> tuple:
        """The groups gradients are averaged over, one after the other: the
        gradient axis (``dp x cp``, the ranks that read different tokens),
        the same groups buffers are made equal over. A loss over counted
        tokens sums its count over them (:mod:`mmpar.optim.tokens`)."""
        return self.buffer_groups

    # -- full state (collectives when the wrapper holds shards) -------------
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The plain model's whole state dict (keys as the plain model's)."""
        return full_state.full_state_dict(self.state_module)

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a plain model's state dict (every rank)."""
        return full_state.load_full_state_dict(self.state_module, state_dict,
                                               strict)

    def full_optim_state_dict(self, optimizer) -> dict:
        """The optimizer state unsharded, keyed by parameter names; given an
        ``OptimWrapper``, its own entries (e.g. an AMP loss scaler) kept."""
        state = {}
        if isinstance(optimizer, MMEngineOptimWrapper):
            state, optimizer = optimizer.state_dict(), optimizer.optimizer
        state.update(full_state.full_optim_state_dict(self.state_module,
                                                      optimizer))
        return state

    def load_full_optim_state_dict(self, optimizer, state_dict: dict) -> None:
        """Load what :meth:`full_optim_state_dict` returned (every rank)."""
        full_state.load_full_optim_state_dict(self.state_module, optimizer,
                                              state_dict)

    # -- buffers ------------------------------------------------------------
    def sync_buffers(self) -> None:
        """Make buffers equal over the data axis (``buffer_sync``).

        Collective over the data axis: every data rank calls it at the same
        point (the first evaluation step after training, a checkpoint).
        """
        for group in self.buffer_groups:
            sync_buffers(self.module, self.buffer_sync, group)
        self._buffers_in_sync = True

    def reshard_parameters(self) -> None:
        """Free parameters a forward left gathered (``describe(model).
        reshard``); wrappers whose parameters are never gathered have
        nothing to do."""

    # -- what the optim wrapper asks (mmpar.optim.optim_wrapper) ------------
    def _init_forced_sync(
            self, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB) -> None:
        """Build forced_sync's buckets now, so they overlap the last backward.

        Call once the module and ``process_group`` are set; a no-op for the
        other sync strategies.
        """
        if self.sync_strategy == 'forced_sync':
            self._forced_sync = ForcedSyncBuckets(
                self.module.parameters(),
                self.process_group, bucket_cap_mb)

    def before_last_backward(self) -> None:
        """forced_sync: buckets may start during the backward that ends the
        accumulation window, as their gradients complete."""
        if self._forced_sync is not None:
            self._forced_sync.arm()

    def finish_grad_sync(self) -> None:
        """Before each optimizer step: forced_sync's one averaging."""
        if self.sync_strategy == 'forced_sync':
            self.all_reduce_grads()

    def all_reduce_grads(self) -> None:
        """Average every gradient over the data-parallel group now.

        In flattened buckets, one asynchronous all-reduce each
        (:class:`~mmpar.wrappers.forced_sync.ForcedSyncBuckets`). Wrappers
        whose gradients are already bucketed override this.
        """
        if not self.supports_forced_sync:
            raise NotImplementedError(
                f'{type(self).__name__} reduces gradients in backward; '
                'forced_sync is not supported')
        if self._forced_sync is None:
            self._forced_sync = ForcedSyncBuckets(
                self.module.parameters(),
                self.process_group)
        self._forced_sync.finish()

    # -- hooks a wrapper may override ---------------------------------------
    @property
    def eval_forward_module(self) -> nn.Module:
        """What ``val_step``/``test_step`` call forward on.

        The wrapper itself by default: FSDP must run forward through its root
        so parameters are all-gathered. DDP overrides this with the plain
        module, as MMEngine does, because DDP's forward may broadcast buffers,
        a collective that has no place in evaluation.
        """
        return self

    def forward_backward(self, data: Any, optim_wrapper) -> Dict[str, Any]:
        """Forward and backward of one batch; returns the log variables.

        Under context parallelism each rank keeps its chunks of the
        preprocessed batch (:func:`~mmpar.parallel.sequence.shard_batch`).
        A loss over counted tokens is backpropagated as its token sum and
        its count summed over the gradient axis
        (:meth:`~mmpar.optim.ParallelOptimMixin.count_tokens`); the optim
        wrapper's step divides by the window's count. The pipeline
        overrides this (a schedule runs both).
        """
        with optim_wrapper.optim_context(self.module):  # autocast, if AMP
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(self, shard_batch(self.module, data),
                                       mode='loss')
        loss, log_vars = self.module.parse_losses(losses)
        loss = optim_wrapper.loss_to_backward(loss, log_vars)
        log_vars = optim_wrapper.count_tokens(log_vars)
        optim_wrapper.backward(loss, terms=log_vars)
        return log_vars

    def predict(self, data: Any) -> list:
        """Predictions of a preprocessed batch; the pipeline overrides it."""
        return self._run_forward(self.eval_forward_module, data, 'predict')

    # -- the steps ----------------------------------------------------------
    def train_step(self, data: Union[dict, tuple, list],
                   optim_wrapper) -> Dict[str, torch.Tensor]:
        """One micro-batch: forward, backward and, at the end of an
        accumulation window, the optimizer step.

        Args:
            data: a batch from the dataloader.
            optim_wrapper: what MMEngine's wrappers take: an MMEngine
                ``OptimWrapper`` / ``AmpOptimWrapper`` or any subclass
                (adopted, :meth:`parallel_optim_wrapper`), or one of
                mmpar's; with ``accumulative_counts = k`` it steps every k
                calls.

        Returns:
            The log variables from ``parse_losses``.

        Raises:
            TypeError: not an optim wrapper, or an ``OptimWrapperDict``.
        """
        optim_wrapper = self.parallel_optim_wrapper(optim_wrapper)
        self._buffers_in_sync = False
        with optim_wrapper.grad_sync_context():
            log_vars = self.forward_backward(data, optim_wrapper)
        if optim_wrapper.should_update():
            optim_wrapper.step()
            optim_wrapper.zero_grad()
        return log_vars

    def parallel_optim_wrapper(self, optim_wrapper) -> ParallelOptimMixin:
        """``optim_wrapper`` with mmpar's parallel parts, bound to this
        model: mmpar's own as it is; an MMEngine one adopted
        (:class:`~mmpar.optim.adopt.AdoptedOptimWrapper`), the same adapter
        on every call, so its token window and guard persist.

        Raises:
            TypeError: an ``OptimWrapperDict`` (a model stepping several
                optimizers runs its own ``train_step``; MMEngine's wrappers
                refuse it too), or not an optim wrapper.
        """
        if isinstance(optim_wrapper, ParallelOptimMixin):
            if optim_wrapper.model is not self:
                optim_wrapper.bind(self)
            return optim_wrapper
        if isinstance(optim_wrapper, OptimWrapperDict):
            raise TypeError(
                f'{type(self).__name__}.train_step takes one optim wrapper, '
                'not an OptimWrapperDict: a model that steps several '
                'optimizers (a GAN) implements its own train_step, which '
                'runs unwrapped (world size 1); mmpar does not wrap it')
        adopted = self.__dict__.setdefault('_adopted_optim_wrappers', {})
        entry = adopted.get(id(optim_wrapper))
        if entry is None or entry.inner is not optim_wrapper:
            entry = AdoptedOptimWrapper(optim_wrapper)
            entry.bind(self)
            adopted[id(optim_wrapper)] = entry
        return entry

    def val_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions for a validation batch: the model's own ``val_step``
        where MMEngine's DDP would call it (:meth:`_models_own_step`), else
        ``BaseModel``'s (preprocess, ``mode='predict'``)."""
        return self._evaluate('val_step', data)

    def test_step(self, data: Union[dict, tuple, list]) -> list:
        """Predictions for a test batch: the model's own ``test_step``, as
        :meth:`val_step`."""
        return self._evaluate('test_step', data)

    def _evaluate(self, step: str, data: Union[dict, tuple, list]) -> list:
        if not self._buffers_in_sync:
            self.sync_buffers()
        own_step = self._models_own_step(step)
        if own_step is not None:
            return own_step(data)
        return self.predict(shard_batch(
            self.module, self.module.data_preprocessor(data, training=False)))

    def _models_own_step(self, step: str) -> Optional[Callable]:
        """The model's ``val_step``/``test_step`` when its class defines one
        of its own (test-time augmentation, custom inference) and it can run
        on the plain module, as MMEngine's DDP calls it: where evaluation
        runs forward on the module itself and no context-parallel split of
        the batch is due. Else None: the wrapper's forward (FSDP1, whose root
        all-gathers; MMEngine's FSDP wrapper does not call it either)."""
        if (self.eval_forward_module is not self.module
                or getattr(self.module, SETTING_ATTR, None) is not None):
            return None
        if getattr(type(self.module), step, None) is getattr(BaseModel, step):
            return None
        return getattr(self.module, step, None)

    def prepare_as_pipeline_stage(self) -> None:
        """Called when the wrapper wraps a pipeline stage, whose forward and
        backward torch's schedule runs on the plain module; a wrapper whose
        backward hooks expect its own forward stands aside here."""

    @staticmethod
    def _run_forward(target: nn.Module, data: Any, mode: str) -> Any:
        # BaseModel._run_forward's unpacking, on a chosen module.
        if isinstance(data, dict):
            return target(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return target(*data, mode=mode)
        raise TypeError('the data preprocessor must return a dict, list or '
                        f'tuple, got {type(data).__name__}')


def describe(model: nn.Module) -> WrappedModel:
    """What ``model`` is: an mmpar wrapper (or the pipeline) says so itself;
    an MMEngine wrapper holds a plain module; anything else is a plain
    module."""
    if isinstance(model, StepMixin):
        return model.description
    inner = model.module if is_model_wrapper(model) else model
    return WrappedModel(model=inner, state_module=inner)


def mesh_groups(mesh) -> Tuple:
    """A DeviceMesh's groups, one per dim, outermost first."""
    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim))
