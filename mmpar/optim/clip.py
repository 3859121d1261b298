"""The one gradient clip by the global norm, for every parallel layout.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms into one
tensor, which fails when only some gradients are DTensors (tensor-parallel
layers next to plain ones: ``got mixed torch.Tensor and DTensor``) and when
they live on different meshes (FSDP2 over a tp x dp mesh: ``All operands in
aten.stack.default must have the same mesh``; pytorch/pytorch#180346). Here
gradients are grouped by mesh (meshes compare with ``==``: FSDP2 makes many
equal mesh objects), each group's norm is made whole (a DTensor norm becomes
its full value, a collective over the group's mesh), the group norms are
combined, optionally reduced over extra process groups whose ranks hold
disjoint parameters (pipeline stages, FSDP1's flat shards), and every
gradient is scaled by the same factor.

mmpar's optim wrapper (:mod:`mmpar.optim.optim_wrapper`) clips with this
function, with the groups the model's wrapper declares, in every layout.
"""
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _in_root_order(mesh) -> bool:
    """Whether ``mesh``'s dims keep the order of the mesh they were cut
    from: its ranks, read row by row, ascend (a root mesh numbers its ranks
    row by row). Torch reduces a DTensor norm over all of its sharded dims
    at once only on such a mesh (below)."""
    ranks = mesh.mesh.flatten()
    return bool((ranks[1:] > ranks[:-1]).all())


Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def _group_by_mesh(grads: Sequence[torch.Tensor]
                   ) -> List[Tuple[object, List[torch.Tensor]]]:
    # A list, not a dict keyed by mesh: equal meshes may hash differently,
    # and the order of first appearance is the same on every rank, so the
    # groups' collectives pair up.
    groups: List[Tuple[object, List[torch.Tensor]]] = []
    in_order = {}  # id(mesh) -> _in_root_order(mesh), once per mesh object
    for grad in grads:
        mesh = grad.device_mesh if isinstance(grad, DTensor) else None
        if mesh is not None and id(mesh) not in in_order:
            in_order[id(mesh)] = _in_root_order(mesh)
        if mesh is not None and not in_order[id(mesh)]:
            # Placements too: such a group's norm is combined over its
            # sharded dims one by one (_sharded_norm).
            mesh = (mesh, tuple(grad.placements))
        for key, members in groups:
            if (key is None) == (mesh is None) and (mesh is None
                                                   or key == mesh):
                members.append(grad)
                break
        else:
            groups.append((mesh, [grad]))
    return groups


def _sharded_norm(grads: List[DTensor], norm_type: float,
                  foreach: Optional[bool]) -> torch.Tensor:
    """The norm of DTensor gradients of one mesh and placements: the local
    shards' norm, combined over each sharded mesh dim in turn.

    Not torch's DTensor norm and ``full_tensor()``: on a mesh whose dims
    are not in the root's order torch 2.13 fails to flatten them into one
    all-reduce (``Mesh dim indices should be in ascending order``). FSDP2
    makes such meshes for a parameter that is already a DTensor on an
    inner axis and is sharded over a flattened one holding an axis further
    in (the experts: ep's DTensors sharded over efsdp = dp_shard x cp).
    """
    local = torch.nn.utils.get_total_norm(
        [g.to_local() for g in grads], norm_type, False, foreach).float()
    spec = grads[0]
    for dim, placement in enumerate(spec.placements):
        if placement.is_replicate():
            continue
        group = spec.device_mesh.get_group(dim)
        if norm_type == float('inf'):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        else:
            local = local**norm_type
            dist.all_reduce(local, group=group)
            local = local**(1.0 / norm_type)
    return local


def _group_norm(key: object, grads: List[torch.Tensor], norm_type: float,
                foreach: Optional[bool]) -> torch.Tensor:
    # Only on a mesh out of the root's order (a group _group_by_mesh keys
    # with its placements), which torch cannot reduce over; every other
    # mesh keeps torch's DTensor norm, bit for bit (the per-dim sums round
    # differently: tests/optim/test_clip_meshes.py). (Any sharding, FSDP2's
    # strided one included, splits a gradient into disjoint parts; a
    # partial one would not.)
    if isinstance(key, tuple) and not any(
            p.is_partial() for p in grads[0].placements):
        return _sharded_norm(grads, norm_type, foreach)
    norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # a collective over the group's mesh
    return norm.float()


def total_grad_norm(grads: Sequence[torch.Tensor],
                    norm_type: float = 2.0,
                    foreach: Optional[bool] = None,
                    extra_groups: Iterable = ()) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` together, as a float tensor.

    Args:
        grads: gradients, plain tensors and DTensors on any meshes, in the
            same order on every rank.
        norm_type: the p of the p-norm; ``inf`` for the largest entry.
        foreach: as torch's ``get_total_norm``.
        extra_groups: process groups over which ranks hold *different*
            gradients; their norms are combined too (every rank of each
            group must call this).
    """
    norm_type = float(norm_type)
    norms = [_group_norm(key, g, norm_type, foreach)
             for key, g in _group_by_mesh(grads)
             ] or [torch.zeros((), device='cpu')]
    norms = [n.to(norms[0].device) for n in norms]
    inf = norm_type == float('inf')
    total = torch.stack(norms).max() if inf else sum(n**norm_type
                                                     for n in norms)
    for group in extra_groups:
        dist.all_reduce(total, group=group,
                        op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return total if inf else total**(1.0 / norm_type)


def clip_grad_norm_(parameters: Params,
                    max_norm: float,
                    norm_type: float = 2.0,
                    error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None,
                    extra_groups: Iterable = ()) -> torch.Tensor:
    """Clip gradients by their global norm; torch's signature plus groups.

    Args:
        parameters: a tensor or tensors whose ``.grad`` are clipped.
        max_norm: the largest allowed total norm.
        norm_type: the p of the p-norm (``inf`` allowed).
        error_if_nonfinite: raise when the total norm is nan or inf.
        foreach: as torch's ``clip_grad_norm_``.
        extra_groups: process groups over which ranks hold different
            parameters (the pipeline axis; FSDP1's shard group).

    Returns:
        The total norm before clipping (a plain tensor, equal on all ranks).

    Raises:
        RuntimeError: a non-finite norm with ``error_if_nonfinite``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = total_grad_norm(grads, norm_type, foreach, extra_groups)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f'The total norm of order {norm_type} for gradients is '
            'non-finite, so it cannot be clipped; set '
            'error_if_nonfinite=False to clip anyway')
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in grads:
            # Scale the local shard: every rank holds its part of a DTensor.
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return total
