"""mmpar's own tensor-parallel styles, next to torch's Colwise/Rowwise/
SequenceParallel: ``replicate`` (a module kept whole as Replicate DTensors),
``prepare_input`` (a module's inputs laid out once for every split layer
inside it), fused ``colwise`` (a projection packing k outputs, such as
timm's ``qkv``) and ``replicate_sharded_input`` (a norm applied to this
rank's heads). ``module_plan`` (:mod:`mmpar.parallelize.module_plan`) builds
them from plain data; see docs/tensor_parallel.md.
"""
import inspect
from functools import partial
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Placement, Replicate,
                                      distribute_module, distribute_tensor)
from torch.distributed.tensor.parallel import (ColwiseParallel,
                                               ParallelStyle, SequenceParallel)
# Private: torch's layout for "k equal parts, each sharded on its own" (what
# FSDP2 x TP and transformers' packed_colwise use); no public placement says
# it (docs/architecture.md, private names).
from torch.distributed.tensor.placement_types import _StridedShard


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every tp rank, as Replicate DTensors.

    Inputs become Replicate DTensors (a DTensor input is redistributed,
    e.g. all-gathered from a sequence shard), outputs are local tensors
    unless ``use_local_output=False``. Useful for norms between split
    layers when the plan has no sequence parallelism.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__()
        self.use_local_output = use_local_output

    def _prepare_input(self, module, inputs, device_mesh):
        placements = [Replicate()] * device_mesh.ndim
        return tuple(
            (x.redistribute(placements=placements) if isinstance(x, DTensor)
             else DTensor.from_local(x, device_mesh, placements,
                                     run_check=False))
            if hasattr(x, 'shape') else x for x in inputs)

    def _prepare_output(self, module, outputs, device_mesh):
        if self.use_local_output and isinstance(outputs, DTensor):
            return outputs.to_local()
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, input_fn=self._prepare_input,
            output_fn=self._prepare_output)


def positional_parameters(module: nn.Module) -> Tuple[List[str], bool]:
    """``(names of forward's positional parameters, whether it takes
    *args)``: where a ``prepare_input`` layout may point."""
    names, var_args = [], False
    for param in inspect.signature(module.forward).parameters.values():
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
        var_args |= param.kind == param.VAR_POSITIONAL
    return names, var_args


class PrepareInput(ParallelStyle):
    """Lay out a module's inputs once, for every split layer inside it.

    torch's ``PrepareModuleInput`` pattern (torchtitan's Llama plan: the
    attention's input ``Shard(1)`` -> ``Replicate()``, then q/k/v column
    split with a replicated input): the block input is all-gathered once and
    reused by q/k/v, and in backward their input gradients (``Partial``)
    add up before one reduce-scatter (one all-reduce without sequence
    parallelism), instead of one collective per projection.

    Two differences from torch's class: positional arguments past
    ``input_layouts`` are left alone (Llama's ``Attention(x, cos, sin)``
    needs only ``x``'s layout), and the layout at position i applies to
    ``forward``'s i-th parameter whether the caller passes it by position
    or by name (transformers' decoder layer calls
    ``self_attn(hidden_states=...)``).

    Args:
        input_layouts: per positional parameter, the layout the caller's
            tensor has (a plain tensor is taken as this rank's part of it),
            or None to leave that argument alone.
        desired_input_layouts: per position, the layout the module gets
            (None where ``input_layouts`` is None).
        use_local_output: give the module local tensors. Default False: the
            split layers must see the DTensor for their gradients to add up
            before the one reduction.
    """

    def __init__(self, *, input_layouts: Sequence[Optional[Placement]],
                 desired_input_layouts: Sequence[Optional[Placement]],
                 use_local_output: bool = False):
        super().__init__()
        if len(input_layouts) != len(desired_input_layouts):
            raise ValueError(
                f'input_layouts={tuple(input_layouts)} and '
                f'desired_input_layouts={tuple(desired_input_layouts)} '
                'must have the same length')
        self.layouts = tuple(zip(input_layouts, desired_input_layouts))
        self.use_local_output = use_local_output

    def _prepare(self, value, layout: Placement, desired: Placement,
                 mesh: DeviceMesh, where: str):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f'prepare_input: {where} is a '
                             f'{type(value).__name__}, not a tensor; give '
                             'it the layout None to leave it alone')
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, mesh, (layout, ),
                                       run_check=False)
        if tuple(value.placements) != (desired, ):
            value = value.redistribute(placements=(desired, ))
        return value.to_local() if self.use_local_output else value

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        names, _ = positional_parameters(module)
        owner = type(module).__name__

        def prepare(_, args, kwargs):
            args = list(args)
            for index, (layout, desired) in enumerate(self.layouts):
                if layout is None:
                    continue
                if index < len(args):
                    args[index] = self._prepare(
                        args[index], layout, desired, device_mesh,
                        f'{owner} argument {index}')
                elif index < len(names) and names[index] in kwargs:
                    name = names[index]
                    kwargs[name] = self._prepare(
                        kwargs[name], layout, desired, device_mesh,
                        f'{owner} argument {name!r}')
            return tuple(args), kwargs

        module.register_forward_pre_hook(prepare, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(layouts={self.layouts}, '
                f'use_local_output={self.use_local_output})')


class FusedColwiseParallel(ColwiseParallel):
    """Column-split a Linear whose output packs ``fused`` equal parts.

    timm's attention computes q, k and v with one ``qkv`` Linear (weight rows
    ``[q; k; v]``) and reshapes its output to ``(..., 3, heads, head_dim)``;
    a SwiGLU MLP packs ``[gate; up]`` and chunks in two. Plain colwise gives
    rank 0 the first rows (all of q and half of k at tp=2); here each part is
    split on its own, so rank r holds ``[q_r; k_r; v_r]`` and its output
    packs the same parts for its own heads. The weight and bias are DTensors
    with torch's strided layout (``_StridedShard(0, split_factor=fused)``),
    so gathering them (full checkpoints, ``full_tensor()``) gives the
    original row order back, and a full checkpoint loads into the parts.

    Args:
        fused: the number of equal parts the output packs (3 for q/k/v).
        input_layouts: as torch's ColwiseParallel.
        output_layouts: None (default): this rank's part of every packed
            part, side by side; ``Replicate()``: the whole output.
        use_local_output: as torch's ColwiseParallel.
    """

    def __init__(self, *, fused: int, input_layouts=None,
                 output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts,
                         use_local_output=use_local_output)
        self.fused = fused
        self.packed = _StridedShard(0, split_factor=fused)
        self.output_layouts = (output_layouts, )

    def _partition_linear_fn(self, name, module, device_mesh):
        for name, param in module.named_parameters():
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param, device_mesh, [self.packed],
                                  src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_packed_input(input_layouts, desired_input_layouts, mod,
                              inputs, device_mesh):
        # As torch's ColwiseParallel lays out its input.
        tensor = inputs[0]
        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, device_mesh, input_layouts,
                                        run_check=False)
        if input_layouts != desired_input_layouts:
            tensor = tensor.redistribute(placements=desired_input_layouts,
                                         async_op=True)
        return tensor

    @staticmethod
    def _prepare_packed_output(output_layouts, use_local_output, mod,
                               outputs, device_mesh):
        if output_layouts[0] is not None:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(
                'FusedColwiseParallel splits only nn.Linear')
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_packed_input, self.input_layouts,
                    self.desired_input_layouts),
            partial(self._prepare_packed_output, self.output_layouts,
                    self.use_local_output))

    def __repr__(self) -> str:
        return (f'{type(self).__name__}(fused={self.fused}, '
                f'input_layouts={self.input_layouts}, '
                f'output_layouts={self.output_layouts}, '
                f'use_local_output={self.use_local_output})')


class ReplicateShardedInput(SequenceParallel):
    """Keep a module whole and apply it to this rank's part of its input.

    For a norm between a colwise and a rowwise layer that normalises each
    head on its own (Qwen3's ``q_norm`` / ``k_norm`` over ``head_dim``): the
    input is this rank's heads, the output too, and no collective runs in
    forward; each rank's weight gradient covers only its heads, so they are
    summed over tp in backward (transformers' ``replicated_with_grad_
    allreduce``). The input is declared sharded on dim 0: any dimension but
    the normalised last one gives the same local result and makes DTensor
    sum the weight gradient.
    """

    def __init__(self, *, use_local_output: bool = True):
        super().__init__(sequence_dim=0, use_local_output=use_local_output)
