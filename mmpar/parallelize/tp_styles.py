"""mmpar's own tensor-parallel styles, next to torch's Colwise/Rowwise/
SequenceParallel: ``replicate`` (a module kept whole as Replicate DTensors)
and ``prepare_input`` (a module's inputs laid out once for every split layer
inside it). ``module_plan`` (:mod:`mmpar.parallelize.module_plan`) builds
them from plain data; see docs/tensor_parallel.md.
"""
import inspect
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Placement, Replicate,
                                      distribute_module)
from torch.distributed.tensor.parallel import ParallelStyle


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
