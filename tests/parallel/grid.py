"""Expected process groups by definition, written without mmpar's code.

The ranks of a job are numbered along the mesh order
``(dp_replicate, dp_shard, ep, pp, cp, tp)``, tp varying fastest
(docs/topology.md). Two ranks share a group of one kind when they agree on
every coordinate the kind does not vary; ``dp`` varies the two data
coordinates and ep together, ``dp_cp`` (the gradient axis) those and cp,
``dp_shard_cp`` (FSDP's shard axis) dp_shard, ep and cp, ``efsdp`` (what
experts are sharded over) dp_shard and cp.
Plain nested loops and comparisons: no reshape, no ``layout_of``, so a
wrong axis order or a wrong flattening in mmpar cannot hide in the oracle.
"""
from typing import Dict, Iterator, List, Tuple

MESH_ORDER = ('dp_replicate', 'dp_shard', 'ep', 'pp', 'cp', 'tp')
# Each group kind and the coordinates that vary inside one of its groups.
VARYING = {
    'dp_replicate': ('dp_replicate', ),
    'dp_shard': ('dp_shard', ),
    'ep': ('ep', ),
    'pp': ('pp', ),
    'cp': ('cp', ),
    'tp': ('tp', ),
    'dp': ('dp_replicate', 'dp_shard', 'ep'),
    'dp_cp': ('dp_replicate', 'dp_shard', 'ep', 'cp'),
}
# Mesh views with no group of their own in the topology.
VIEWS = {'dp_shard_cp': ('dp_shard', 'ep', 'cp'), 'efsdp': ('dp_shard', 'cp')}


def rank_coordinates(dp_replicate: int, dp_shard: int, ep: int, pp: int,
                     cp: int, tp: int) -> List[Dict[str, int]]:
    """Every rank's coordinates, indexed by rank."""
    coords = []
    for r in range(dp_replicate):
        for s in range(dp_shard):
            for e in range(ep):
                for p in range(pp):
                    for c in range(cp):
                        for t in range(tp):
                            coords.append(dict(dp_replicate=r, dp_shard=s,
                                               ep=e, pp=p, cp=c, tp=t))
    return coords


def brute_force_groups(dp_replicate: int, dp_shard: int, ep: int, pp: int,
                       cp: int, tp: int) -> Dict[str, Dict[int, List[int]]]:
    """``{kind: {rank: its group's ranks, sorted}}`` for every kind and
    view."""
    coords = rank_coordinates(dp_replicate, dp_shard, ep, pp, cp, tp)
    groups = {}
    for kind, varying in {**VARYING, **VIEWS}.items():
        fixed = [axis for axis in MESH_ORDER if axis not in varying]
        groups[kind] = {
            rank: [other for other, theirs in enumerate(coords)
                   if all(theirs[a] == mine[a] for a in fixed)]
            for rank, mine in enumerate(coords)
        }
    return groups


def layouts(world_size: int
            ) -> Iterator[Tuple[int, int, int, int, int, int]]:
    """Every ``(dp_replicate, dp_shard, ep, pp, cp, tp)`` whose product is
    ``world_size``, in increasing order.

    Each size divides what the sizes before it leave (a product of
    integers equal to ``world_size`` has no other factors), and tp is what
    is left: the same tuples as trying every size from 1 to
    ``world_size`` on each axis, without the 16**6 products at 16 ranks.
    """
    def divisors(n: int) -> List[int]:
        return [d for d in range(1, n + 1) if n % d == 0]

    for r in divisors(world_size):
        for s in divisors(world_size // r):
            for e in divisors(world_size // (r * s)):
                for p in divisors(world_size // (r * s * e)):
                    for c in divisors(world_size // (r * s * e * p)):
                        yield r, s, e, p, c, world_size // (r * s * e * p * c)
