"""Record, step by step, what a training run computes: for each module (by
its name in the plain model) a fingerprint of its forward output, for each
parameter a fingerprint of its gradient, the loss and the global grad norm.

:class:`FingerprintHook` is an MMEngine hook: it rides on the Runner's own
training (no second trainer) and sees the wrapped model through
``describe`` (a pipeline rank's stages, FSDP and tensor-parallel DTensors).
Every fingerprint is taken on the full tensor: a DTensor is gathered with
``full_tensor()``; a tensor-parallel module's plain local output, narrower
than the reference's along one dimension by the tp size, is all-gathered
over the tp group along it; the rows of a batch that data-parallel and
context-parallel ranks or micro-batches hold are summed (fingerprints of
outputs add up over rows, :mod:`mmpar.verify.fingerprint`). Rank 0 merges
the ranks' records at each step.
"""
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from mmengine.dist import is_distributed
from mmengine.hooks import Hook
from mmengine.logging import MessageHub
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, distribute_tensor

from mmpar.verify.fingerprint import row_fingerprint, tensor_fingerprint
from mmpar.verify.stage_probe import StageProbe
from mmpar.wrappers.base import describe
from mmpar.wrappers.local_state import (plain_named_modules,
                                        plain_named_parameters)

Shapes = Dict[Tuple[str, int], Tuple[int, ...]]


def tensor_leaves(value: Any) -> List[torch.Tensor]:
    """The tensors in a module's output (tuples, lists, dicts), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensor_leaves(item)]
    return []


def tp_split_dim(local: Tuple[int, ...], full: Tuple[int, ...],
                 tp: int) -> Optional[int]:
    """The dimension a tp module's plain local output of shape ``local``
    is split along over ``tp`` ranks, against the reference's ``full``
    shape; None when it is whole.

    The last dimension first (a colwise split), then the ones before it (a
    sequence-parallel split); never the batch, dimension 0: data ranks and
    micro-batches hold part of it too, and with as many data ranks as tp
    ranks a whole output would look split there.
    """
    if len(local) != len(full):
        return None
    for dim in range(len(local) - 1, 0, -1):
        if local[dim] != full[dim] and local[dim] * tp == full[dim]:
            return dim
    return None


class FingerprintHook(Hook):
    """Fingerprint every training step of the Runner it is registered in.

    Args:
        reference_shapes: the reference run's full output shapes,
            ``{(module, output index): shape}``: a local output narrower
            along one dimension by the tp size is gathered along it. None
            for the reference run itself.

    After training, :attr:`steps` (rank 0; one dict a step: ``outputs``
    ``{module: [(fingerprint, rows, elements) per output]}``, ``order``,
    ``grads`` ``{parameter: (fingerprint, rows, elements)}``,
    ``grad_order`` (the order gradients were ready in; the reference run
    only), ``loss``,
    ``grad_norm``), :attr:`shapes` and :attr:`touches` (what the layout
    does to each module: placements of its parameters, its pipeline stage).
    """
    priority = 'LOWEST'

    def __init__(self, reference_shapes: Optional[Shapes] = None):
        self.reference_shapes = reference_shapes or {}
        self.steps: List[dict] = []
        self.shapes: Shapes = {}
        self.touches: Dict[str, List[str]] = {}
        self.running: List[str] = []  # modules entered, not left
        self._tp = None
        # Per tp module: the weight row (output column) each gathered
        # column of its output is; None where they are in order.
        self._columns: Dict[str, Optional[torch.Tensor]] = {}
        self._probe: Optional[StageProbe] = None
        self._held: Dict[str, list] = {}  # the stages' shape probe
        self._new_step()

    def _new_step(self) -> None:
        self._outputs: Dict[str, list] = {}
        self._order: List[str] = []
        self._grads: Dict[str, tuple] = {}
        self._grad_order: List[str] = []
        self._losses: List[float] = []

    # -- installing ---------------------------------------------------------
    def before_train(self, runner) -> None:
        topology = getattr(runner, 'topology', None)
        if topology is not None and topology.dims.tp > 1:
            self._tp = topology.tp
        self._model = runner.model
        for name, module in plain_named_modules(runner.model):
            module.register_forward_pre_hook(self._entered(name))
            module.register_forward_hook(self._left(name))
            self.touches[name] = self._placements(module)
        pipeline = describe(runner.model).pipeline
        if pipeline is not None:
            # After the modules' hooks: a stage module's own output is
            # recorded while the probe still says whether the call is
            # torch's shape inference (its hook, run last, ends that).
            self._probe = StageProbe(pipeline.stage_modules,
                                     runner.model.num_microbatches)
        if not self.reference_shapes:  # the reference
            # The order gradients are ready in, which names the module a
            # gradient first differs at (the root's own parameters, used
            # first, are ready last). A parallel reference's parameters may
            # be views of a flat one (FSDP1), which take no such hook.
            for name, param in plain_named_parameters(runner.model):
                if param.requires_grad and param.is_leaf:
                    param.register_post_accumulate_grad_hook(
                        self._grad_ready(name))
        runner.optim_wrapper.optimizer.register_step_pre_hook(
            lambda *_: self._record_grads())

    @staticmethod
    def _placements(module: nn.Module) -> List[str]:
        found = []
        for leaf, param in module.named_parameters(recurse=False):
            if isinstance(param, DTensor):
                names = param.device_mesh.mesh_dim_names or ()
                for i, placement in enumerate(param.placements):
                    axis = names[i] if i < len(names) else f'mesh dim {i}'
                    found.append(f'{axis}: {placement} of {leaf}')
        return found

    def _entered(self, name: str):
        def hook(module, args):
            self.running.append(name)
        return hook

    def _left(self, name: str):
        def hook(module, args, output):
            if self.running and self.running[-1] == name:
                self.running.pop()
            self._record_output(name, output, module)
        return hook

    def _grad_ready(self, name: str):
        def hook(param):
            if name not in self._grad_order:
                self._grad_order.append(name)
        return hook

    # -- recording ------------------------------------------------------------
    def _full(self, name: str, index: int, tensor: torch.Tensor,
              module: Optional[nn.Module] = None):
        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
        want = self.reference_shapes.get((name, index))
        if self._tp is None or want is None:
            return tensor
        dim = tp_split_dim(tuple(tensor.shape), want, self._tp.world_size)
        if dim is None:
            return tensor
        whole = torch.cat(self._gather_tp(tensor), dim)
        if dim == whole.dim() - 1 and module is not None:
            columns = self._output_columns(name, module, whole.shape[-1])
            if columns is not None:  # back in the weight's row order
                ordered = torch.empty_like(whole)
                ordered[..., columns.to(whole.device)] = whole
                return ordered
        return whole

    def _gather_tp(self, tensor: torch.Tensor) -> List[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self._tp.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self._tp.group)
        return parts

    def _output_columns(self, name: str, module: nn.Module,
                        width: int) -> Optional[torch.Tensor]:
        """The row of ``module``'s weight that each column of its gathered
        output is: a split that packs several parts (a fused q/k/v, gate
        and up: ``dict(style='colwise', fused=3)``) gives each rank a slice
        of every part, so the tp ranks' outputs side by side are not the
        reference's order. Found once per module by laying out the row
        numbers as its weight is (collective over tp: every tp rank runs
        the module)."""
        if name not in self._columns:
            weight = getattr(module, 'weight', None)
            columns = None
            if isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 \
                    and weight.shape[0] == width:
                rows = distribute_tensor(
                    torch.arange(width, device=weight.device_mesh.device_type),
                    weight.device_mesh, weight.placements,
                    src_data_rank=None).to_local()
                columns = torch.cat(self._gather_tp(rows)).cpu()
                if torch.equal(columns, torch.arange(width)):
                    columns = None
            self._columns[name] = columns
        return self._columns[name]

    def _record_output(self, name: str, output: Any,
                       module: Optional[nn.Module] = None) -> None:
        leaves = [t for t in tensor_leaves(output) if t.is_floating_point()]
        if not leaves:
            return
        if name not in self._outputs:
            self._order.append(name)
            self._outputs[name] = [None] * len(leaves)
        store = self._held if self._probe and self._probe.active \
            else self._outputs
        for index, tensor in enumerate(leaves):
            tensor = self._full(name, index, tensor, module)
            if tensor.dim() == 0:  # a scalar (a loss): compared as the loss
                continue
            self.shapes.setdefault((name, index), tuple(tensor.shape))
            _add(store, name, len(leaves), index,
                 (row_fingerprint(tensor), _rows(tensor), tensor.numel()))

    def _record_grads(self) -> None:
        root = describe(self._model).state_module
        if not isinstance(root, FullyShardedDataParallel):
            self._fingerprint_grads()
            return
        # FSDP1's gradients are views into this rank's part of a flat
        # gradient; its public summon_full_params shows each parameter's
        # whole gradient under the plain name (collective: every rank's
        # optimizer step runs this hook).
        with FullyShardedDataParallel.summon_full_params(
                root, writeback=False, with_grads=True):
            self._fingerprint_grads()

    def _fingerprint_grads(self) -> None:
        for name, param in plain_named_parameters(self._model):
            grad = param.grad
            if grad is None or name in self._grads:
                continue
            if isinstance(grad, DTensor):
                grad = grad.full_tensor()
            self._grads[name] = (tensor_fingerprint(grad), _rows(grad),
                                 grad.numel())

    def after_train_iter(self, runner, batch_idx: int, data_batch=None,
                         outputs=None) -> None:
        if outputs and 'loss' in outputs:
            self._losses.append(float(outputs['loss'].detach()))
        probing = self._probe is not None and self._probe.first_step
        if probing:
            self._probe.batch_done()
        if not self._grads:  # accumulating: no optimizer step yet
            return
        if probing:
            if not self._probe.was_probe():  # real micro-batches: count them
                _add_all(self._outputs, self._held)
            self._held = {}
        step = dict(outputs=self._outputs, order=self._order,
                    grads=self._grads, grad_order=self._grad_order,
                    losses=self._losses,
                    grad_norm=_logged_grad_norm())
        self._new_step()
        merged = merge_ranks(gather_to_rank0(step))
        if merged is not None:
            self.steps.append(merged)

    def after_train(self, runner) -> None:
        parts = gather_to_rank0(dict(shapes=self.shapes,
                                     touches=self.touches))
        if parts is None:
            return
        for part in parts:
            for key, shape in part['shapes'].items():
                self.shapes.setdefault(key, shape)
            for name, found in part['touches'].items():
                if found:
                    self.touches[name] = sorted(
                        set(self.touches.get(name, ())) | set(found))


def _rows(tensor: torch.Tensor) -> float:
    # Rows of the last dimension (a 1-D tensor: one value a row).
    return float(tensor.numel() // max(tensor.shape[-1], 1)
                 if tensor.dim() > 1 else tensor.numel())


def _add(store: Dict[str, list], name: str, num_outputs: int, index: int,
         entry: tuple) -> None:
    """Add one call's ``(fingerprint, rows, elements)`` of output
    ``index`` to ``store[name]`` (fingerprints add up over calls)."""
    slots = store.setdefault(name, [None] * num_outputs)
    if index >= len(slots):
        return
    old = slots[index]
    slots[index] = entry if old is None else tuple(
        a + b for a, b in zip(old, entry))


def _add_all(store: Dict[str, list], calls: Dict[str, list]) -> None:
    """:func:`_add` every output of ``calls`` (``{module: slots}``)."""
    for name, slots in calls.items():
        store.setdefault(name, [None] * len(slots))
        for index, entry in enumerate(slots):
            if entry is not None:
                _add(store, name, len(slots), index, entry)


def _logged_grad_norm() -> Optional[float]:
    """The global grad norm the optim wrapper's clip logged at this step
    (before clipping); None without ``clip_grad``."""
    try:
        return float(MessageHub.get_current_instance().get_scalar(
            'train/grad_norm').current())
    except KeyError:
        return None


def gather_to_rank0(obj: Any) -> Optional[list]:
    """Every rank's ``obj`` on rank 0 (a list), None on the others."""
    if not is_distributed():
        return [obj]
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, parts, dst=0)
    return parts


def merge_ranks(parts: Optional[list]) -> Optional[dict]:
    """One step of every rank as one record: output fingerprints, rows and
    elements summed over the ranks that ran the module (the comparison
    divides out replication, ``rows / reference rows``), a gradient from
    the first rank holding it, the loss averaged over the ranks that report
    it (each data rank is replicated alike over the other axes)."""
    if parts is None:
        return None
    outputs: Dict[str, list] = {}
    order: List[str] = []
    grads: Dict[str, tuple] = {}
    losses = []
    for part in parts:
        order += [name for name in part['order'] if name not in outputs]
        _add_all(outputs, {name: part['outputs'][name]
                           for name in part['order']})
        for name, entry in part['grads'].items():
            grads.setdefault(name, entry)
        if part['losses']:
            losses.append(sum(part['losses']) / len(part['losses']))
    norms = [p['grad_norm'] for p in parts if p['grad_norm'] is not None]
    if not norms:  # no clip: the norm of the (unclipped) full gradients
        norms = [sum(float(g[0][1]) for g in grads.values())**0.5]
    return dict(outputs=outputs, order=order, grads=grads,
                grad_order=parts[0]['grad_order'],
                loss=sum(losses) / len(losses) if losses else None,
                grad_norm=norms[0])
