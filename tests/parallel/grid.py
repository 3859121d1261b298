"""Expected process groups by definition, written without mmpar's code.

The ranks of a job are numbered along the mesh order
``(dp_replicate, dp_shard, pp, tp)``, tp varying fastest (docs/topology.md).
Two ranks share a group of one kind when they agree on every coordinate
the kind does not vary; ``dp`` varies the two data coordinates together.
Plain nested loops and comparisons: no reshape, no ``layout_of``, so a
wrong axis order or a wrong flattening in mmpar cannot hide in the oracle.
"""
from typing import Dict, Iterator, List, Tuple

MESH_ORDER = ('dp_replicate', 'dp_shard', 'pp', 'tp')
# Each group kind and the coordinates that vary inside one of its groups.
VARYING = {
    'dp_replicate': ('dp_replicate', ),
    'dp_shard': ('dp_shard', ),
    'pp': ('pp', ),
    'tp': ('tp', ),
    'dp': ('dp_replicate', 'dp_shard'),
}


def rank_coordinates(dp_replicate: int, dp_shard: int, pp: int,
                     tp: int) -> List[Dict[str, int]]:
    """Every rank's coordinates, indexed by rank."""
    coords = []
    for r in range(dp_replicate):
        for s in range(dp_shard):
            for p in range(pp):
                for t in range(tp):
                    coords.append(dict(dp_replicate=r, dp_shard=s, pp=p, tp=t))
    return coords


def brute_force_groups(dp_replicate: int, dp_shard: int, pp: int,
                       tp: int) -> Dict[str, Dict[int, List[int]]]:
    """``{kind: {rank: its group's ranks, sorted}}`` for every kind."""
    coords = rank_coordinates(dp_replicate, dp_shard, pp, tp)
    groups = {}
    for kind, varying in VARYING.items():
        fixed = [axis for axis in MESH_ORDER if axis not in varying]
        groups[kind] = {
            rank: [other for other, theirs in enumerate(coords)
                   if all(theirs[a] == mine[a] for a in fixed)]
            for rank, mine in enumerate(coords)
        }
    return groups


def layouts(world_size: int) -> Iterator[Tuple[int, int, int, int]]:
    """Every ``(dp_replicate, dp_shard, pp, tp)`` whose product is
    ``world_size``."""
    for r in range(1, world_size + 1):
        for s in range(1, world_size + 1):
            for p in range(1, world_size + 1):
                for t in range(1, world_size + 1):
                    if r * s * p * t == world_size:
                        yield r, s, p, t
