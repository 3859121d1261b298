"""The train/val/test steps of a pipelined model: torch's schedules run them.

:class:`MMPipelineParallel` holds this rank's stages (each already wrapped by
the data-parallel wrapper over the data axis, or plain) and replaces the
forward/backward of the usual step with one ``schedule.step`` per batch:

* every pp rank runs the data preprocessor (all pp peers read the same
  batch); the first stage feeds ``inputs`` to the schedule, the last stage
  gets the batch's *indices* as the schedule's ``target``, so its loss
  function finds each micro-batch's data samples (of any type) by index:
  only tensors pass between stages;
* every pp rank cuts its context-parallel chunks out of the batch (cp > 1);
* the batch entries the model names in ``pipeline_kwargs`` (the Llama's
  ``doc_ids``) go to the schedule as keyword tensors: torch cuts them per
  micro-batch and every stage's forward gets its micro-batch's rows;
* the last stage's loss is the model's ``pipeline_loss`` + ``parse_losses``,
  divided by MMEngine's accumulation factor (``optim_wrapper.scale_loss``)
  and weighted by the micro-batch's share of the batch, so the gradients are
  those of the batch mean, as in one process (torch's own ``scale_grads``
  would also divide gradients accumulated by earlier batches: the parity
  test caught it); a loss over counted tokens is backpropagated as its
  token sum instead (the optim wrapper divides by the window's count,
  :mod:`mmpar.optim.tokens`); a batch the micro-batch count does not divide
  is padded and the padding left out of the loss;
* the logged loss is broadcast from the last stage over the pp group and
  handed to ``optim_wrapper.record_backward``: the schedule already ran the
  backward; the optim wrapper counts it for accumulation and its
  non-finite guard checks the same loss on every stage;
* the rest is the step every wrapper shares (:class:`~mmpar.wrappers.base.
  StepMixin`): the optim wrapper's step syncs the replicated stages'
  gradients (:meth:`MMPipelineParallel.finish_grad_sync`) and clips by the
  global norm summed over the pp group (``clip_groups``).
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from mmpar.optim.tokens import TOKENS_KEY, is_token_counted
from mmpar.parallel.sequence import shard_batch
from mmpar.parallelize.pipeline.schedules import check_evaluates
from mmpar.parallelize.pipeline.split import pipeline_kwargs
from mmpar.registry import MODEL_WRAPPERS
from mmpar.wrappers.base import StepMixin
from mmpar.wrappers.description import PipelineParts, WrappedModel


def split_data(data: Any) -> Tuple[torch.Tensor, Any]:
    """``(inputs, rest)`` of a preprocessed batch: ``rest`` is a dict (the
    other keys) or a tuple (the other items)."""
    if isinstance(data, dict):
        rest = dict(data)
        if 'inputs' not in rest:
            raise TypeError('a pipelined model needs the preprocessed batch '
                            f'to have "inputs"; got keys {list(data)}')
        return rest.pop('inputs'), rest
    if isinstance(data, (list, tuple)):
        return data[0], tuple(data[1:])
    raise TypeError('the data preprocessor must return a dict, list or '
                    f'tuple, got {type(data).__name__}')


def _take(value: Any, index: torch.Tensor) -> Any:
    # One micro-batch's share of a batch-sized value.
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device))
    if isinstance(value, (list, tuple)):
        return [value[i] for i in index.tolist()]
    return value


def _pad_rows(value: torch.Tensor, pad: int) -> torch.Tensor:
    # A batch padded to a multiple of the micro-batch count repeats its
    # last row.
    if not pad:
        return value
    return torch.cat([value, value[-1:].expand(pad, *value.shape[1:])])


def _call(fn, outputs, rest: Any, index: Optional[torch.Tensor]):
    if isinstance(rest, dict):
        rest = {k: v if index is None else _take(v, index)
                for k, v in rest.items()}
        return fn(outputs, **rest)
    rest = rest if index is None else [_take(v, index) for v in rest]
    return fn(outputs, *rest)


@MODEL_WRAPPERS.register_module()
class MMPipelineParallel(StepMixin, nn.Module):
    """This rank's pipeline stages and the steps that run a schedule.

    Built by :func:`mmpar.parallelize.pipeline.pipeline_parallelize`, not
    from a config.

    torch's ``PipelineStage`` runs each stage's plain module: FSDP2's
    sharded module inside ``MMFullyShard`` (torch drives its gradient sync),
    else the unwrapped stage. DDP is not handed to torch: its reducer breaks
    on a pipeline (torch 2.13: "rebuilt params size" on the second step,
    after the stage's shape inference and with several stages per rank;
    silently wrong with ``static_graph``). The gradients of replicated
    stages are all-reduced once per optimizer step instead
    (:meth:`finish_grad_sync`, mmpar's ``forced_sync`` path).

    Args:
        stages: this rank's stage modules (data-parallel wrapped or plain),
            in the order of ``stage_indices``.
        stage_indices: their global stage indices.
        num_stages: stages in the whole pipeline.
        schedule: the schedule's registered name.
        schedule_cls: the torch schedule class.
        num_microbatches: micro-batches per training batch.
        pp_group: the pipeline group; ``pp_ranks`` its global ranks.
        last_holder: the pp rank (index in the group) of the last stage.
        device: where activations live.
        stage_modules: the stages unwrapped (what torch's stages run).
        clip_groups: groups over which ranks hold different parameters
            besides the pp group (from the data wrapper).
        stage_cls: torch's ``PipelineStage`` or mmpar's
            :class:`~.stage.MicrobatchReshardStage` (FSDP2 stages reshard
            and reduce-scatter after every micro-batch).
    """

    # Data-parallel sync happens in the stages (FSDP2) or at the step
    # (finish_grad_sync): never a no_sync window at this level.
    sync_strategy = 'multi_auto_sync'
    from_config = False

    def __init__(self, stages: Sequence[nn.Module], stage_indices: List[int],
                 num_stages: int, schedule: str, schedule_cls: type,
                 num_microbatches: int, pp_group, pp_ranks: List[int],
                 last_holder: int, device: torch.device,
                 stage_modules: Sequence[nn.Module],
                 clip_groups: tuple = (),
                 stage_cls: type = PipelineStage):
        super().__init__()
        self._init_steps('multi_auto_sync', None)
        self.stages = nn.ModuleList(stages)
        self.stage_modules = list(stage_modules)
        self.stage_indices = list(stage_indices)
        self.num_stages = num_stages
        self.schedule_name = schedule
        self.schedule_cls = schedule_cls
        self.num_microbatches = num_microbatches
        self.pp_group = pp_group
        self.pp_ranks = list(pp_ranks)
        self.last_holder = last_holder
        self.device = device
        self.clip_groups = tuple(clip_groups) + (pp_group, )
        self.has_first = 0 in self.stage_indices
        self.has_last = num_stages - 1 in self.stage_indices
        self.stage_cls = stage_cls
        self._schedules: Dict[tuple, Any] = {}
        self._step_state: Dict[str, Any] = {}

    # -- the model the user wrote (any stage copy serves) -------------------
    @property
    def model(self) -> nn.Module:
        """This rank's stage copy of the user's model (the last stage's when
        this rank holds it: it has ``pipeline_head``'s modules)."""
        i = self.stage_indices.index(self.num_stages - 1) \
            if self.has_last else 0
        return self.stage_modules[i]

    @property
    def module(self) -> nn.Module:
        """The model MMEngine's Runner and hooks see (a wrapper's
        ``module``): this rank's stage copy of the user's model, a
        ``BaseModel`` with ``train_step``, whatever the number of stages."""
        return self.model

    @property
    def data_preprocessor(self) -> nn.Module:
        return self.model.data_preprocessor

    @property
    def _wrapped(self) -> List[StepMixin]:
        """The stages the data-parallel wrapper wrapped."""
        return [s for s in self.stages if isinstance(s, StepMixin)]

    @property
    def description(self) -> WrappedModel:
        wrapped = self._wrapped
        return WrappedModel(
            model=self.model,
            state_module=None,
            shards_parameters=any(s.shards_parameters for s in wrapped),
            holds_shards=True,
            axes=dict(wrapped[0].axes) if wrapped else {},
            pipeline=PipelineParts(tuple(self.stages),
                                   tuple(self.stage_modules),
                                   tuple(self.stage_indices), self.pp_group),
            sync_buffers=self.sync_buffers,
            reshard=self.reshard_parameters)

    def reshard_parameters(self) -> None:
        """Each wrapped stage's (FSDP2 stages keep their parameters
        gathered after an evaluation forward)."""
        for stage in self._wrapped:
            stage.reshard_parameters()

    @property
    def grad_groups(self) -> tuple:
        """The stages' gradient axis (every stage of a rank is wrapped over
        the same one); none when the stages are not wrapped (pp alone)."""
        wrapped = self._wrapped
        return wrapped[0].grad_groups if wrapped else ()

    def sync_buffers(self) -> None:
        """Each wrapped stage's buffers over its data axis."""
        for stage in self._wrapped:
            stage.sync_buffers()
        self._buffers_in_sync = True

    def finish_grad_sync(self) -> None:
        """Average the gradients of every replicated stage (its wrapper does
        not see torch's backward): FSDP2 stages sync inside the schedule."""
        for stage in self._wrapped:
            if not stage.shards_parameters:
                stage.all_reduce_grads()

    # -- schedules ----------------------------------------------------------
    def _schedule(self, train: bool, microbatches: int, batch: int):
        """A schedule (and its stages) per (mode, micro-batch count, batch
        size): torch stages size their buffers on the first batch they see
        (an epoch's last, smaller batch gets its own)."""
        key = (train, microbatches, batch)
        if key not in self._schedules:
            stages = [
                self.stage_cls(module, index, self.num_stages, self.device,
                               group=self.pp_group)
                for module, index in zip(self.stage_modules,
                                         self.stage_indices)
            ]
            loss_fn = self._microbatch_loss if train else None
            arg = stages if len(stages) > 1 else stages[0]
            self._schedules[key] = self.schedule_cls(
                arg, microbatches, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def _microbatch_loss(self, outputs: torch.Tensor,
                         index: torch.Tensor) -> torch.Tensor:
        state = self._step_state
        real = index < state['batch']  # padding rows have index >= batch
        if not bool(real.any()):
            # All padding: no loss, but a graph for the schedule's backward.
            return outputs.sum() * 0.0
        model = self.model
        losses = _call(model.pipeline_loss, outputs[real], state['rest'],
                       index[real])
        loss, log_vars = model.parse_losses(losses)
        optim_wrapper = state['optim_wrapper']
        backward = optim_wrapper.loss_to_backward(loss, log_vars)
        values = {k: float(v.detach()) for k, v in log_vars.items()}
        if is_token_counted(log_vars):
            # A token sum: the micro-batches' sums add up to the batch's,
            # and the optim wrapper divides by the window's count. Logged
            # terms are weighted by the micro-batch's tokens.
            state['log_vars'].append((values, values[TOKENS_KEY]))
            return backward
        weight = float(real.sum()) / state['batch']
        state['log_vars'].append((values, weight))
        # Weighted by the micro-batch's share of the real batch here, not
        # divided by torch (scale_grads=False): torch divides every .grad
        # after the step, which would also shrink gradients accumulated by
        # earlier batches. The weights make the sum the batch mean.
        return backward * weight

    def _batch_parts(self, data: Any) -> Tuple[torch.Tensor, Any, dict]:
        """``(inputs, rest, stage_kwargs)``: ``stage_kwargs`` are the
        entries the model names in ``pipeline_kwargs`` (every stage gets
        them), left out of ``rest`` (what the loss and predictions get)."""
        inputs, rest = split_data(data)
        names = pipeline_kwargs(self.model)
        if not names or not isinstance(rest, dict):
            return inputs, rest, {}
        stage_kwargs = {k: rest.pop(k) for k in names
                        if rest.get(k) is not None}
        return inputs, rest, stage_kwargs

    def _run(self, data: Any, train: bool, extra: Optional[dict] = None):
        """One schedule step (``train``) or forward-only pass over a batch.

        A batch that ``num_microbatches`` does not divide (an epoch's last)
        is padded by repeating its last sample; the padding's outputs are
        left out of the loss and the predictions. torch's stages need
        micro-batches of one size, at least one per stage.
        """
        inputs, rest, stage_kwargs = self._batch_parts(data)
        batch, m = inputs.shape[0], self.num_microbatches
        pad = -batch % m
        inputs, stage_kwargs = _pad_rows(inputs, pad), {
            k: _pad_rows(v, pad).to(self.device)
            for k, v in stage_kwargs.items()}
        self._step_state = dict(rest=rest, log_vars=[], batch=batch, pad=pad,
                                microbatches=m, **(extra or {}))
        schedule = self._schedule(train, m, batch + pad)
        args = (inputs.to(self.device), ) if self.has_first else ()
        if train:
            target = torch.arange(batch + pad, device=self.device) \
                if self.has_last else None
            return schedule.step(*args, target=target, return_outputs=False,
                                 **stage_kwargs)
        outputs = schedule.eval(*args, **stage_kwargs)
        return None if outputs is None else outputs[:batch]

    def _from_last(self, obj: Any) -> Any:
        """``obj`` of the rank holding the last stage, on every pp rank."""
        box = [obj]
        dist.broadcast_object_list(
            box, src=self.pp_ranks[self.last_holder], group=self.pp_group)
        return box[0]

    # -- the steps (the body is StepMixin's) -------------------------------
    def forward_backward(self, data: Any, optim_wrapper) -> Dict[str, Any]:
        """One batch through the schedule: every micro-batch's forward and
        backward; returns the log variables, averaged over micro-batches,
        equal on every pp rank."""
        with optim_wrapper.optim_context(self.model):  # autocast, if AMP
            data = self.data_preprocessor(data, training=True)
            self._run(shard_batch(self.model, data), True,
                      dict(optim_wrapper=optim_wrapper))
        log_vars = None
        if self.has_last:
            state = self._step_state
            # The real micro-batches of this step (on its first batch
            # torch's stage also calls the loss while it infers shapes).
            size = (state['batch'] + state['pad']) // state['microbatches']
            real = -(-state['batch'] // size)  # micro-batches with real rows
            parts = state['log_vars'][-real:]
            total = sum(w for _, w in parts)
            log_vars = {
                k: sum(p[k] * w for p, w in parts) / (total or 1.0)
                for k in parts[0][0]
            }
            if TOKENS_KEY in log_vars:
                log_vars[TOKENS_KEY] = total  # counts add up
        log_vars = {k: torch.tensor(v, device=self.device)
                    for k, v in self._from_last(log_vars).items()}
        # Every stage holds its last stage's counts now: summed over each
        # stage's gradient axis, every rank adds the same window count.
        log_vars = optim_wrapper.count_tokens(log_vars)
        optim_wrapper.record_backward(
            optim_wrapper.scale_loss(log_vars['loss'].to(self.device)),
            terms=log_vars)
        return log_vars

    def predict(self, data: Any) -> list:
        """Predictions of a preprocessed batch, forward-only through the
        stages, on every pp rank."""
        # check_config refuses a val loop at start-up; a test run (which
        # it cannot tell from a training one) stops here.
        check_evaluates(self.schedule_name, 'a val/test step was called')
        _, rest, _ = self._batch_parts(data)
        outputs = self._run(data, False)
        preds = _call(self.model.pipeline_predict, outputs, rest, None) \
            if self.has_last else None
        # Every pp rank returns them (MMEngine's val loop reads the last
        # output); the evaluator counts only the last pp rank's
        # (mmpar.runner.data_axis), once per data rank.
        return self._from_last(preds)

    def forward(self, *args, **kwargs):
        raise RuntimeError('MMPipelineParallel runs through train_step, '
                           'val_step and test_step (a pipeline schedule), '
                           'not forward')
