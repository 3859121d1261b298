"""A function of whole matrices, applied to matrices no rank holds whole.

An optimizer like Muon transforms each weight matrix's update as a whole
(Newton–Schulz orthogonalisation); under FSDP2 or tensor parallelism a rank
holds a shard of it, and the transform of a shard is a different optimizer.
:func:`apply_to_whole` takes each matrix's local part, gives the whole
matrix to ``fn`` on one rank and returns each rank its part of the result:

* a plain tensor (one process, DDP, a pipeline stage): every rank holds the
  whole matrix, ``fn`` runs locally (data-parallel ranks repeat it, as
  torch's own optimizers repeat their elementwise work);
* a DTensor sharded on one mesh dimension (FSDP2 ``Shard(0)``, HSDP's
  ``(Replicate, Shard(0))``, TP colwise ``Shard(0)`` / rowwise ``Shard(1)``):
  each matrix gets one owner rank of that dimension's group, chosen so that
  the owners' work is balanced; one all-to-all sends every shard to its
  matrix's owner, each owner runs ``fn`` on the matrices it owns, and a
  second all-to-all sends the result's shards back. A rank holds at most
  the matrices it owns, whole, at a time;
* a DTensor sharded on both dimensions of a 2-D mesh (FSDP2 x TP: the
  outer data dimension over the inner tp split): each matrix gets an owner
  coordinate of the outer dimension; gathered over the outer dimension
  there is one sharded mesh dimension left, handled as above by the inner
  groups of that coordinate (only for the matrices it owns), and each
  result's inner shards are broadcast over the outer dimension and cut
  locally. So the work is spread over every rank of the mesh;
* any other DTensor layout (a fused projection's strided split on a 1-D
  mesh, a partial placement): gathered whole on every rank of its mesh
  (``full_tensor``), ``fn`` run there, and cut back locally. Exact, but
  the work is repeated on every rank of the mesh.

The result is the same matrix ``fn`` gives one process (the shards are
moved, never added), so the optimizer stays the one-process optimizer.
"""
import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from mmpar.parallel.dtensor import distribute_like, like_param, local_tensor

WholeFn = Callable[[int, torch.Tensor], torch.Tensor]


def chunk_sizes(length: int, parts: int) -> List[int]:
    """The sizes DTensor's ``Shard`` gives ``parts`` ranks of a dimension of
    ``length`` (``torch.chunk``'s: ceil-sized chunks, empty ones last)."""
    chunk = -(-length // parts)
    return [max(0, min(chunk, length - k * chunk)) for k in range(parts)]


def _one_shard_dim(param: DTensor):
    """``(mesh_dim, tensor_dim)`` when exactly one mesh dimension shards
    ``param`` (plainly) and the others replicate it, else None."""
    sharded = [(i, p.dim) for i, p in enumerate(param.placements)
               if type(p) is Shard]
    others_replicate = all(
        type(p) is Shard or isinstance(p, Replicate)
        for p in param.placements)
    return sharded[0] if len(sharded) == 1 and others_replicate else None


def _both_dims_sharded(param: DTensor) -> bool:
    """Whether ``param`` is sharded on each dimension of its 2-D mesh, the
    inner one plainly (FSDP2 x TP's layouts)."""
    if param.device_mesh.ndim != 2:
        return False
    outer, inner = param.placements
    return outer.is_shard() and type(inner) is Shard


def assign_owners(numels: Sequence[int], num_ranks: int) -> List[int]:
    """Each matrix's owner rank: the largest first, each to the rank with
    the least work so far (the same answer on every rank)."""
    load = [0] * num_ranks
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        rank = min(range(num_ranks), key=lambda r: load[r])
        owners[index] = rank
        load[rank] += numels[index]
    return owners


def _split(flat: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
    return list(flat.split(sizes)) if sizes else []


class _Bucket:
    """The matrices one mesh dimension shards along one tensor dimension:
    who owns each and how big each rank's shard of each is."""

    def __init__(self, params: List[DTensor], mesh_dim: int, dim: int):
        mesh = params[0].device_mesh
        self.group = mesh.get_group(mesh_dim)
        self.num_ranks = mesh.size(mesh_dim)
        self.rank = mesh.get_local_rank(mesh_dim)
        self.dim = dim
        self.shapes = [tuple(p.shape) for p in params]
        self.owners = assign_owners([p.numel() for p in params],
                                    self.num_ranks)

    def shard_shape(self, index: int, rank: int) -> Tuple[int, int]:
        shape = list(self.shapes[index])
        shape[self.dim] = chunk_sizes(shape[self.dim], self.num_ranks)[rank]
        return tuple(shape)

    def numel(self, index: int, rank: int) -> int:
        return math.prod(self.shard_shape(index, rank))

    def owned(self, rank: int) -> List[int]:
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def exchange(self, send: List[List[torch.Tensor]],
                 send_numels: List[List[int]], recv_numels: List[List[int]],
                 like: torch.Tensor) -> List[List[torch.Tensor]]:
        """One all-to-all: ``send[k]`` (flattened, in order) to rank k;
        returns what each rank k sent here, cut into ``recv_numels[k]``."""
        flat = [t.reshape(-1) for pieces in send for t in pieces]
        inp = torch.cat(flat) if flat else like.new_empty(0)
        recv_sizes = [sum(numels) for numels in recv_numels]
        out = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, inp.to(like.dtype), recv_sizes,
                               [sum(numels) for numels in send_numels],
                               group=self.group)
        return [_split(part, numels) for part, numels in zip(
            _split(out, recv_sizes), recv_numels)]

    def run(self, locals_: List[torch.Tensor], fn: WholeFn,
            indices: List[int]) -> List[torch.Tensor]:
        ranks = range(self.num_ranks)
        mine = self.owned(self.rank)
        # This rank's shards of rank k's matrices; rank k's of this rank's.
        theirs = [[self.numel(i, self.rank) for i in self.owned(k)]
                  for k in ranks]
        ours = [[self.numel(i, k) for i in mine] for k in ranks]
        # Shards to their owners.
        pieces = self.exchange(
            [[locals_[i] for i in self.owned(k)] for k in ranks], theirs,
            ours, locals_[0])
        results = []
        for j, index in enumerate(mine):
            whole = torch.cat([
                pieces[k][j].view(self.shard_shape(index, k)) for k in ranks
            ], dim=self.dim)
            out = fn(indices[index], whole)
            results.append(out.split(
                chunk_sizes(self.shapes[index][self.dim], self.num_ranks),
                dim=self.dim))
        # The result's shards back to their ranks.
        back = self.exchange(
            [[results[j][k] for j in range(len(mine))] for k in ranks], ours,
            theirs, locals_[0])
        local = [None] * len(locals_)
        for k in ranks:
            for piece, index in zip(back[k], self.owned(k)):
                local[index] = piece.view(self.shard_shape(index, self.rank))
        return local


def _on_2d_mesh(params: List[DTensor], locals_: List[torch.Tensor],
                fn: WholeFn, indices: List[int]) -> List[torch.Tensor]:
    """``fn`` on whole matrices sharded on both dimensions of one 2-D mesh
    (the same placements), each computed once (module docstring)."""
    mesh, placements = params[0].device_mesh, tuple(params[0].placements)
    inner = (Replicate(), placements[1])
    outer_group = mesh.get_group(0)
    outer_rank = mesh.get_local_rank(0)
    # Gathered over the outer dimension: sharded over the inner one only.
    gathered = [like_param(p, local).redistribute(mesh, inner)
                for p, local in zip(params, locals_)]
    owners = assign_owners([p.numel() for p in params], mesh.size(0))
    inner_parts: List[torch.Tensor] = [g.to_local() for g in gathered]
    for coordinate in range(mesh.size(0)):
        owned = [j for j, owner in enumerate(owners) if owner == coordinate]
        if not owned:
            continue
        if coordinate == outer_rank:
            bucket = _Bucket([gathered[j] for j in owned], 1,
                             placements[1].dim)
            for j, out in zip(owned, bucket.run(
                    [inner_parts[j] for j in owned], fn,
                    [indices[j] for j in owned])):
                inner_parts[j] = out
        # The owners' results, inner shards, to the whole outer group.
        flat = torch.cat([inner_parts[j].reshape(-1) for j in owned])
        dist.broadcast(flat, dist.get_global_rank(outer_group, coordinate),
                       group=outer_group)
        for j, piece in zip(owned, _split(
                flat, [inner_parts[j].numel() for j in owned])):
            inner_parts[j] = piece.view(inner_parts[j].shape)
    return [
        DTensor.from_local(part, mesh, inner, run_check=False, shape=p.shape,
                           stride=p.stride()).redistribute(
                               mesh, placements).to_local()
        for p, part in zip(params, inner_parts)
    ]


def apply_to_whole(params: Sequence[torch.Tensor],
                   locals_: Sequence[torch.Tensor],
                   fn: WholeFn) -> List[torch.Tensor]:
    """``fn(i, whole_i)`` for every matrix, each rank given its part back.

    Args:
        params: the 2-D parameters (plain tensors or DTensors); their
            layout says how ``locals_`` are laid out.
        locals_: this rank's part of each matrix (e.g. its momentum-updated
            gradient shard), the shape of the parameter's local shard.
        fn: the whole-matrix function, called with the matrix's index in
            ``params`` and the whole matrix; returns a matrix of that shape.
            Every rank must pass the same parameters in the same order.

    Returns:
        This rank's part of each result, laid out as ``locals_``.
    """
    results: List[torch.Tensor] = [None] * len(params)
    buckets: Dict[tuple, List[int]] = {}
    for index, (param, local) in enumerate(zip(params, locals_)):
        if not isinstance(param, DTensor):
            results[index] = fn(index, local)
            continue
        where = _one_shard_dim(param)
        if where is None and _both_dims_sharded(param):
            where = '2d'
        key = (id(param.device_mesh), tuple(param.placements), where)
        buckets.setdefault(key, []).append(index)
    for (_, _, where), indices in buckets.items():
        if where is None:
            for i in indices:
                whole = like_param(params[i], locals_[i]).full_tensor()
                results[i] = local_tensor(
                    distribute_like(fn(i, whole), params[i]))
            continue
        members = [params[i] for i in indices]
        parts = [locals_[i] for i in indices]
        outs = _on_2d_mesh(members, parts, fn, indices) if where == '2d' \
            else _Bucket(members, *where).run(parts, fn, indices)
        for i, out in zip(indices, outs):
            results[i] = out
    return results
