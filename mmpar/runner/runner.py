"""``mmpar.Runner``: MMEngine's Runner with the few changes mmpar needs.

Overrides: the whole config checked (and the ``parallel`` section parsed)
once before any process-group work; start-up through
:func:`mmpar.dist.init_dist` and one topology, held here and handed down;
model wrapping through :func:`mmpar.parallelize.compose.parallelize`; mmpar's
optim wrappers, bound to the model; plain-data checkpoints in any layout.
"""
import inspect
import os.path as osp
from typing import Callable, Optional, Union

from mmengine.dist import barrier, is_distributed, is_main_process
from mmengine.model import is_model_wrapper, revert_sync_batchnorm
from mmengine.model.utils import convert_sync_batchnorm
from mmengine.runner import CheckpointLoader
from mmengine.runner import EpochBasedTrainLoop as MMEngineEpochBasedTrainLoop
from mmengine.runner import Runner as MMEngineRunner
from torch import nn

import mmpar.checkpoint as ckpt
from mmpar.checkpoint.background import BackgroundSave, stage
from mmpar.checkpoint.format import (MMENGINE_CHECKPOINT_HOOK,
                                     sharded_hook_names)
from mmpar.checkpoint.latest import job_start, mark_job_start
from mmpar.config_check import check_config
from mmpar.datasets.tokenizer import check_model_vocabulary
from mmpar.device import local_device
from mmpar.dist import (check_launcher, init_dist, restart_attempt,
                        usable_backend)
from mmpar.parallel.seed import setup_parallelism
from mmpar.parallelize.compose import parallelize
from mmpar.parallelize.meta import MetaInit, build_on_meta
from mmpar.parallelize.resolved import resolve_plan
from mmpar.registry import RUNNERS
from mmpar.runner import data_axis
from mmpar.runner.checkpoint import PlainCheckpointHook, checkpoint_extras
from mmpar.runner.checkpoint_hook import with_async_hook
from mmpar.runner.data_position import META_KEY as POSITION_KEY
from mmpar.runner.data_position import restore_position
from mmpar.runner.even_data import check_even_work
from mmpar.runner.ema import EMAHooks
from mmpar.runner.init_weights import DeferredInit
from mmpar.runner.optim import build_parallel_optim_wrapper
from mmpar.runner.param_groups import names_rules, plain_view
from mmpar.runner.run_config import RunConfig
from mmpar.wrappers.base import describe

_RUNNER_SIGNATURE = inspect.signature(MMEngineRunner.__init__)


@RUNNERS.register_module()
class Runner(MMEngineRunner):
    """MMEngine's Runner for CPU and GPU, one process or many.

    Takes exactly MMEngine's arguments (see ``mmengine.runner.Runner``); a
    plain MMEngine config runs unchanged.
    """

    def __init__(self, *args, **kwargs):
        bound = _RUNNER_SIGNATURE.bind_partial(None, *args, **kwargs)
        given = bound.arguments
        if given.get('cfg'):
            # Its text formatted once, not at every log, dump and save.
            given['cfg'] = RunConfig.of(given['cfg'])
        check_launcher(given.get('launcher', 'none'))
        cfg = given.get('cfg') or {}
        # The whole config checked, and its parallel parts resolved once
        # (the layout too when the launcher says the world size): the plan
        # setup_env, build_model and wrap_model hand down.
        self.plan = check_config(cfg) if cfg else resolve_plan()
        # What load_or_resume reads (MMEngine keeps them private).
        self._asked = dict(resume=given.get('resume', False),
                           load_from=given.get('load_from'))
        # 'full' or 'sharded' (mmpar/checkpoint/format.py; checked above).
        self.checkpoint_format = cfg.get('checkpoint_format', 'full')
        # What build_model recorded, for a model built on the meta device;
        # the run's one topology (setup_env builds it).
        self.meta_init: Optional[MetaInit] = None
        self.topology = None
        # A sharded or split model's init_weights, kept for where MMEngine
        # runs it (train(), after the train loop is built).
        self._deferred_init: Optional[DeferredInit] = None
        # EMAHook's averaged copy under any layout (mmpar/runner/ema.py).
        self._ema = EMAHooks()
        # The model before its layout, parameter-free: what the optimizer
        # constructor's rules see (mmpar/runner/param_groups.py), for an
        # optim_wrapper config with rules.
        self._plain_view: Optional[nn.Module] = None
        # The checkpoint write in flight (async_save), at most one.
        self.checkpoint_writes = BackgroundSave()
        super().__init__(*bound.args[1:], **bound.kwargs)

    def setup_env(self, env_cfg: dict) -> None:
        if self.distributed and not is_distributed():
            # MMEngine fills a missing env_cfg with backend='nccl': only what
            # the config itself says is the user's choice.
            given = (self.cfg.get('env_cfg') or {}).get('dist_cfg') or {}
            dist_cfg = dict(env_cfg.get('dist_cfg') or {})
            dist_cfg['backend'] = usable_backend(given.get('backend'))
            init_dist(self.launcher, **dist_cfg)
        super().setup_env(env_cfg)
        # The one topology of the run: compose hands its groups and meshes
        # to every technique and wrapper.
        if is_distributed():
            # (Resolved by check_config when the launcher said the size.)
            self.plan = self.plan.at_world(self.world_size)
        self.topology = setup_parallelism(self.plan.parallel,
                                          self.plan.given_wrapper_cfg,
                                          self.plan.dims)

    def _shards_or_splits(self) -> bool:
        """Whether the layout shards or splits the model."""
        return self.topology is not None and self.plan.builds_on_meta

    def build_model(self, model: Union[nn.Module, dict]) -> nn.Module:
        """MMEngine's; a model the layout shards or splits is built on the
        meta device (``meta_init``, default True): parameters cost nothing
        until compose materialises this rank's share. Its ``init_weights``
        waits for ``train()`` (:mod:`mmpar.runner.init_weights`)."""
        if not isinstance(model, dict) or \
                not self.plan.meta_init or \
                not self._shards_or_splits():
            return super().build_model(model)
        built, self.meta_init = build_on_meta(
            lambda: super(Runner, self).build_model(model),
            init_weights=False)
        self._deferred_init = DeferredInit.of_meta(built, self.meta_init)
        return built

    def wrap_model(self, model_wrapper_cfg: Optional[dict],
                   model: nn.Module) -> nn.Module:
        if is_model_wrapper(model):
            return super().wrap_model(model_wrapper_cfg, model)
        if self.meta_init is None:
            if self._shards_or_splits():
                # Built whole: a copy of the plain model to initialise in
                # train() (mmpar.runner.init_weights).
                self._deferred_init = DeferredInit.of_whole(
                    model, local_device())
            model = model.to(local_device())
        if names_rules(self.optim_wrapper):
            self._plain_view = plain_view(model)
        if self.world_size == 1:
            self.logger.info('World size 1: the model is not wrapped.')
            return parallelize(revert_sync_batchnorm(model), None,
                               plan=self.plan)
        sync_bn = self.cfg.get('sync_bn')
        if sync_bn is not None:
            model = convert_sync_batchnorm(model, sync_bn)
        # TP, PP, activation checkpointing, compile, the data-parallel
        # wrapper, then (meta-built) this rank's parameters, in that order.
        return parallelize(model, self.topology, plan=self.plan,
                           meta_init=self.meta_init, device=local_device())

    def train(self) -> nn.Module:
        # MMEngine 0.10's train() reads the same top-level key
        # `activation_checkpointing` as attribute paths of the model and
        # would wrap them a second time (failing on mmpar's class names);
        # parallelize applied it already (compose's step 3).
        ac_cfg = self.cfg.pop('activation_checkpointing', None)
        if restart_attempt() == 0 and is_main_process():
            # A training job starts (not val or test, whose runs on the same
            # work dir must not move it): what a restart may resume.
            mark_job_start(self.work_dir)
        try:
            model = super().train()
            # A background checkpoint write is complete when train()
            # returns (its failure raised here).
            self.checkpoint_writes.wait()
            return model
        finally:
            if ac_cfg is not None:
                self.cfg['activation_checkpointing'] = ac_cfg

    def test(self) -> dict:
        """MMEngine's test; the checkpoint it loads (``load_from``, what
        ``tools/test.py CONFIG CHECKPOINT`` gives) must hold every parameter
        of the model: one it lacks would be evaluated at its random
        initialisation, a result of no checkpoint at all (MMEngine only
        warns)."""
        self._loading_to_evaluate = True
        try:
            return super().test()
        finally:
            self._loading_to_evaluate = False

    def build_optim_wrapper(self, optim_wrapper):
        """MMEngine's, building mmpar's optim wrappers (for MMEngine's names
        too) and binding them to the model: they own the global-norm clip
        over every axis, the gradient-sync policy and the non-finite guard.
        """
        return build_parallel_optim_wrapper(
            super().build_optim_wrapper, optim_wrapper, self.model,
            self._plain_view)

    # MMEngine's private step (no public hook), where train() initialises
    # the model: after the train loop, the optim wrapper, the val loop and
    # the hooks' before_run, whose random draws come first.
    def _init_model_weights(self) -> None:
        if self._deferred_init is not None:
            # Sharded or split: MMEngine's init_weights and broadcast would
            # run on shards; the plain model's stand-in is initialised and
            # loaded instead, with the same draws.
            deferred, self._deferred_init = self._deferred_init, None
            deferred.run(self.model)
            return
        if describe(self.model).holds_shards:
            # No init_weights, or it ran in an earlier train(); MMEngine's
            # broadcast would abort on sharded parameters.
            return
        super()._init_model_weights()

    def build_dataloader(self, dataloader, seed=None, diff_rank_seed=False):
        """MMEngine's, with the sampler sharding by the data-parallel rank
        and size (tensor/pipeline peers read the same batches)."""
        loader = super().build_dataloader(dataloader, seed, diff_rank_seed)
        return data_axis.shard_loader_by_data_rank(
            loader, self.topology)

    def build_evaluator(self, evaluator):
        """MMEngine's, with results collected over the data axis only."""
        return data_axis.evaluate_metrics_on_data_axis(
            super().build_evaluator(evaluator),
            self.topology)

    def scale_lr(self, optim_wrapper, auto_scale_lr=None) -> None:
        """MMEngine's, counting the global batch over the data axis only.

        MMEngine takes ``world_size * batch_size``; tensor- and pipeline-
        parallel peers read the same batch, so the real global batch is
        ``dp_size * batch_size``. Rescaling ``base_batch_size`` by
        ``world_size / dp_size`` gives MMEngine's formula that ratio.
        """
        topology = self.topology
        if auto_scale_lr and auto_scale_lr.get('enable') and \
                topology is not None and topology.dp_size != self.world_size:
            auto_scale_lr = dict(auto_scale_lr)
            auto_scale_lr['base_batch_size'] = (
                auto_scale_lr['base_batch_size'] * self.world_size /
                topology.dp_size)
        super().scale_lr(optim_wrapper, auto_scale_lr)

    def build_train_loop(self, loop):
        """MMEngine's, except that a loop without a ``type`` is one of
        mmpar's, which resume at the exact sample: ``IterBasedTrainLoop``
        for ``by_epoch=False``, ``EpochBasedTrainLoop`` for
        ``by_epoch=True`` (:mod:`mmpar.runner.loops`)."""
        if isinstance(loop, dict) and 'type' not in loop and \
                loop.get('by_epoch') in (True, False):
            by_epoch = loop['by_epoch']
            loop = {k: v for k, v in loop.items() if k != 'by_epoch'}
            loop['type'] = ('mmpar.EpochBasedTrainLoop' if by_epoch else
                            'mmpar.IterBasedTrainLoop')
        built = super().build_train_loop(loop)
        by_epoch = isinstance(built, MMEngineEpochBasedTrainLoop)
        check_even_work(built.dataloader, 'train_dataloader',
                        every_rank_steps=not by_epoch, same_count=by_epoch)
        check_model_vocabulary(built.dataloader.dataset,
                               describe(self.model).model, 'train_dataloader')
        return built

    def build_val_loop(self, loop):
        """MMEngine's, refusing data on which the ranks of a model with
        collectives in its forward would wait for each other
        (:mod:`mmpar.runner.even_data`)."""
        return self._even_eval(super().build_val_loop(loop), 'val')

    def build_test_loop(self, loop):
        """As :meth:`build_val_loop`, for the test loop."""
        return self._even_eval(super().build_test_loop(loop), 'test')

    def _even_eval(self, loop, name: str):
        described = describe(self.model)
        dims = self.topology.dims if self.topology is not None else None
        collective_forward = (
            described.holds_shards or described.shards_parameters or
            dims is not None and (self.topology.dp_size != dims.world_size
                                  or dims.ep_enabled))
        check_even_work(getattr(loop, 'dataloader', None),
                        f'{name}_dataloader', every_rank_steps=False,
                        same_count=collective_forward)
        return loop

    def call_hook(self, fn_name: str, **kwargs) -> None:
        """MMEngine's, except that an ``EMAHook``'s ``before_run`` builds
        its averaged copy from this rank's part of a sharded or pipelined
        model (:mod:`mmpar.runner.ema`)."""
        if fn_name != 'before_run':
            return super().call_hook(fn_name, **kwargs)
        for hook in self.hooks:  # MMEngine's loop
            if hasattr(hook, fn_name):
                with self._ema.building(self, hook):
                    try:
                        getattr(hook, fn_name)(self, **kwargs)
                    except TypeError as e:
                        raise TypeError(f'{e} in {hook}') from None

    def register_hooks(self, default_hooks=None, custom_hooks=None) -> None:
        if self.checkpoint_format == 'sharded':
            # Sharded checkpoints are directories: epoch_N, not epoch_N.pth.
            default_hooks = sharded_hook_names(
                default_hooks or dict(checkpoint=MMENGINE_CHECKPOINT_HOOK))
        # async_save=True: the hook that moves last_checkpoint only once the
        # background write is complete.
        default_hooks = with_async_hook(default_hooks)
        super().register_hooks(default_hooks, custom_hooks)
        self.register_hook(PlainCheckpointHook())

    def load_checkpoint(self,
                        filename: str,
                        map_location: Union[str, Callable] = 'cpu',
                        strict: bool = False,
                        revise_keys: list = [(r'^module.', '')]) -> dict:
        """Load a checkpoint into the model (``weights_only=True``).

        Local files go through :func:`mmpar.checkpoint.load_checkpoint_file`
        (clear errors on missing or corrupt files); URLs and other schemes
        through MMEngine; a directory is a sharded checkpoint, loaded by
        every rank; Hugging Face weights (``save_pretrained`` directory or
        ``.safetensors`` file) load as a full checkpoint of the plain model.
        """
        if ckpt.is_hf_checkpoint(filename):
            # Hugging Face weights (a save_pretrained directory or a
            # .safetensors file) become this model's plain state dict, then
            # take the full-checkpoint path below (every layout).
            checkpoint = dict(
                state_dict=ckpt.read_hf_state_dict(filename, self.model))
        elif ckpt.is_sharded_checkpoint(filename):
            checkpoint = ckpt.load_sharded(
                self.model, self.optim_wrapper, filename, strict,
                after_read=self._after_load_hooks)
            self._has_loaded = True
            self.logger.info(f'Load sharded checkpoint from {filename}')
            return checkpoint
        elif '://' in filename:
            checkpoint = CheckpointLoader.load_checkpoint(filename,
                                                          map_location)
        else:
            checkpoint = ckpt.load_checkpoint_file(filename, map_location)
        self._after_load_hooks(checkpoint)
        checkpoint = ckpt.load_model_state(
            self.model, checkpoint, strict, revise_keys,
            every_parameter=getattr(self, '_loading_to_evaluate', False),
            source=filename)
        # Name-keyed (full) optimizer state, as sharded runs save it, becomes
        # this process's own form for MMEngine's resume.
        ckpt.localize_optim_state(self.model, self.optim_wrapper, checkpoint,
                                  resuming=getattr(self, '_resuming', False))
        self._has_loaded = True
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint

    def save_checkpoint(self,
                        out_dir: str,
                        filename: str,
                        file_client_args: Optional[dict] = None,
                        save_optimizer: bool = True,
                        save_param_scheduler: bool = True,
                        meta: Optional[dict] = None,
                        by_epoch: bool = True,
                        backend_args: Optional[dict] = None,
                        async_save: bool = False) -> None:
        """Save a checkpoint atomically; called on every rank.

        MMEngine's version runs on rank 0 only, which cannot gather sharded
        (FSDP) state. Here all ranks build the checkpoint, rank 0 writes it
        to a temporary file and renames it into place, and the ranks meet
        at a barrier, so ``last_checkpoint`` (written by CheckpointHook after
        this returns) only ever names a complete file.

        With ``async_save`` this returns once the state is staged (copied to
        host memory); the write and the rename go on in the background
        (``runner.checkpoint_writes``, :mod:`mmpar.checkpoint.background`),
        and :class:`~mmpar.runner.checkpoint_hook.CheckpointHook` moves
        ``last_checkpoint`` when it is done. Any save first waits for the
        one in flight.
        """
        if file_client_args is not None or backend_args is not None:
            raise ValueError('mmpar saves checkpoints to local paths only; '
                             'remove file_client_args / backend_args from '
                             'the CheckpointHook config')
        # At most one save in flight; its failure is raised here.
        self.checkpoint_writes.wait()
        background = self.checkpoint_writes if async_save else None
        # Buffers (BatchNorm statistics) equal on every data rank first, so
        # full and sharded checkpoints hold the same ones (buffer_sync).
        describe(self.model).sync_buffers()
        extras = checkpoint_extras(self, meta, by_epoch, save_param_scheduler)
        path = osp.join(out_dir, filename)
        if self.checkpoint_format == 'sharded':
            ckpt.save_sharded(self.model, self.optim_wrapper, path, extras,
                              save_optimizer, self._before_save_sharded,
                              shadows=self._ema.shadows(),
                              background=background)
            return
        checkpoint = ckpt.collect_checkpoint(self.model, self.optim_wrapper,
                                             extras, save_optimizer)
        # An EMAHook's averaged copy of a sharded model is gathered here, on
        # every rank, for its rank-0 before_save_checkpoint.
        with self._ema.full_states_staged(self.model):
            if is_main_process():
                self._before_save_hooks(checkpoint)
                if background is None:
                    ckpt.atomic_save(checkpoint, path)
                else:
                    staged = stage(checkpoint)
                    background.start(
                        path, lambda: ckpt.atomic_save(staged, path))
        if background is None:
            barrier()

    def _before_save_hooks(self, checkpoint: dict) -> None:
        self.call_hook('before_save_checkpoint', checkpoint=checkpoint)

    def _before_save_sharded(self, plain: dict) -> None:
        with self._ema.stand_ins_staged(plain['model_keys']):
            self._before_save_hooks(plain)

    def _after_load_hooks(self, checkpoint: dict) -> None:
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)

    def resume(self, filename: str, *args, **kwargs) -> None:
        """MMEngine's resume, then the data position (the first sample not
        trained on, on any number of data ranks with the same global batch:
        :mod:`mmpar.runner.data_position`) and every rank's saved RNG states
        (when the world size matches), so training and random draws continue
        where they stopped.

        Raises:
            ConfigError: a checkpoint saved in the middle of the data,
                resumed with another global batch.
        """
        self._resuming = True  # (load_checkpoint: the optimizer state counts)
        try:
            super().resume(filename, *args, **kwargs)
        finally:
            self._resuming = False
        restore_position(
            self, getattr(self, '_loaded_meta', {}).get(POSITION_KEY))
        ckpt.restore_rng_states(
            getattr(self, '_loaded_rng_states', None), self.rank,
            self.world_size, self.logger.warning)

    def load_or_resume(self) -> None:
        """As MMEngine's, but ``resume='auto'`` takes the newest *complete*
        checkpoint, not whatever ``last_checkpoint`` names, and a restarted
        torchrun attempt (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from
        the newest complete checkpoint its job wrote even without
        ``resume`` (the first attempt's start, ``resume``, ``load_from`` or
        scratch, when there is none): the first attempt records its start
        in the work dir, and a checkpoint older than that (a finished
        earlier run's, one a ``--resume PATH`` rolled back from) is not
        this job's. A checkpoint that fails to load is skipped for the
        previous one, with a warning."""
        if self._has_loaded:
            return
        auto = self._asked['resume'] and self._asked['load_from'] is None
        restarted = restart_attempt() > 0
        if auto or restarted:
            # resume='auto' took the newest of any run on the first attempt
            # too; otherwise only this job's checkpoints are its progress.
            since = None if auto else job_start(self.work_dir)
            for path in ckpt.complete_checkpoints(self.work_dir,
                                                  self.logger.warning,
                                                  since):
                try:
                    self.resume(path)
                except ckpt.CheckpointLoadError as err:
                    self.logger.warning(f'{err} Trying the previous one.')
                    continue
                how = 'Restart' if restarted else 'Auto'
                self.logger.info(f'{how} resumed from the latest checkpoint '
                                 f'{path}.')
                return
            if auto:
                self.logger.info('No complete checkpoint in the work dir: '
                                 'training starts from scratch.')
                return
        super().load_or_resume()
