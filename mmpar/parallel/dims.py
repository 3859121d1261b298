"""The named parallel axes of a job, validated in one place.

A job's ranks form a grid with one named axis per technique (torchtitan's
``ParallelDims`` is the model)::

    dp_replicate  data parallel, model replicated (DDP, HSDP's outer axis)
    dp_shard      data parallel, model sharded (FSDP, HSDP's inner axis)
    pp            pipeline stages
    cp            context parallel: each sequence split over the ranks
                  (docs/context_parallel.md)
    tp            tensor parallel (fastest-varying: a tp group is consecutive
                  ranks, i.e. inside one node)

``dp = dp_replicate * dp_shard`` is the data axis: samplers and the
evaluator work over it, and cp peers read the same batch, as tp and pp peers
do. Gradients are reduced over ``dp * cp`` (:attr:`ParallelDims.dp_cp`): cp
peers hold the same weights but different tokens. One axis may be ``-1``,
"the rest of the world".

:func:`resolve_dims` turns a ``parallel`` config section into a
:class:`ParallelDims`, resolving the seed names (``model_parallelism``,
``pipeline_parallelism``) and refusing layouts that cannot train correctly.
The Runner, ``check_config`` and ``tools/plan.py`` all call it.
"""
import math
import os
import warnings
from dataclasses import dataclass, fields
from typing import Optional, Tuple

from mmpar.checks import check_int
# The one table of axes (mesh order, roles): a new axis is added there and
# in ParallelDims.
from mmpar.parallel.axes import AXES, DATA_AXES, FLATTENED

# Sizes may be -1: "the rest of the world".
REST = ((-1, 'the rest of the world'), )


class ParallelismError(ValueError, RuntimeError):
    """The parallel layout cannot be built or used as asked.

    A ``ValueError`` (a user's sizes are wrong) and, for code written against
    the seed API, a ``RuntimeError``.
    """


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks each named axis has; their product is the world.

    Attributes:
        dp_replicate: data-parallel replicas (gradients all-reduced).
        dp_shard: data-parallel shards (FSDP shards parameters over it).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size (ranks one sequence is split over).
        ep: expert-parallel size (ranks the experts of each MoE layer are
            split over; data ranks that read different samples, see
            docs/expert_parallel.md).
        world_size: the number of ranks.

    Each flattened axis of :data:`~mmpar.parallel.axes.FLATTENED` is a size
    too: ``dp`` (``dp_replicate * dp_shard``, the data axis), ``dp_cp``
    (``dp * cp``: the gradient axis, ranks that read different tokens and
    hold the same weights or the same parts of them), ``dp_shard_cp`` and
    ``efsdp`` (what experts are sharded over: the shard axes but ``ep``);
    ``tp_enabled``, ``dp_enabled``, ... say whether an axis is larger
    than 1.

    One of the six sizes may be ``-1``: it becomes whatever makes the
    product equal the world size.

    Raises:
        ParallelismError: a size that is not an int >= 1 (or -1), more than
            one -1, or sizes whose product is not the world size; the message
            names the keys and numbers.
    """
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        check_int('world_size', self.world_size, error=ParallelismError)
        sizes = {name: getattr(self, name) for name in AXES}
        for name, value in sizes.items():
            check_int(f'parallel.{name}', value, also=REST,
                      error=ParallelismError)
        rest = [name for name, value in sizes.items() if value == -1]
        if len(rest) > 1:
            raise ParallelismError(
                f'parallel: {" and ".join(rest)} are both -1; allowed: at '
                f'most one axis of {", ".join(AXES)} set to -1')
        known = math.prod(max(value, 1) for value in sizes.values())
        # cp=1 and ep=1 (off, as in most configs) are left out.
        product = ' * '.join(f'{n}={v}' for n, v in sizes.items()
                             if v != -1 and (n, v) not in (('cp', 1),
                                                           ('ep', 1)))
        if rest:
            if self.world_size % known:
                raise ParallelismError(
                    f'world size {self.world_size} is not divisible by '
                    f'{product} = {known}; allowed: sizes whose product '
                    f'divides the world size ({rest[0]}=-1 takes the rest)')
            # Frozen: resolve -1 once, here, so every reader sees sizes.
            object.__setattr__(self, rest[0], self.world_size // known)
        elif known != self.world_size:
            raise ParallelismError(
                f'world size {self.world_size} is not {product} = {known}; '
                'allowed: sizes whose product is the world size (set one of '
                'them to -1 to take the rest)')

    def size_of(self, axes) -> int:
        """The product of the sizes of ``axes`` (names of :data:`AXES`)."""
        return math.prod(getattr(self, axis) for axis in axes)

    @property
    def shape(self) -> Tuple[int, ...]:
        """Sizes in mesh order, :data:`AXES`."""
        return tuple(getattr(self, name) for name in AXES)

    def coords(self, rank: int) -> dict:
        """``{axis: index}`` of ``rank`` in the grid (row-major over
        :data:`AXES`, the last varying fastest)."""
        coords = {}
        for axis in reversed(AXES):
            rank, coords[axis] = divmod(rank, getattr(self, axis))
        return {axis: coords[axis] for axis in AXES}

    def rank_at(self, **coords: int) -> int:
        """The global rank at ``coords`` (axes left out: index 0; a
        negative index counts from the end, as in a list)."""
        rank = 0
        for axis in AXES:
            size = getattr(self, axis)
            rank = rank * size + coords.get(axis, 0) % size
        return rank

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# From the axes table, as properties (so dir(), help() and class access see
# them): each flattened axis's size (``dp``, ``dp_cp``, ``efsdp``, ...) and
# ``<axis>_enabled`` (its size > 1) for every axis, flattened or not.
for _name, _axes in FLATTENED.items():
    setattr(ParallelDims, _name,
            property(lambda self, axes=_axes: self.size_of(axes)))
for _name in (*AXES, *FLATTENED):
    setattr(ParallelDims, f'{_name}_enabled',
            property(lambda self, name=_name: getattr(self, name) > 1))
del _name, _axes


def _pick(parallel, new: str, old: str) -> Optional[int]:
    """The value of ``new`` or its seed alias ``old`` (None if neither).

    Raises:
        ParallelismError: both given with different values, naming both.
    """
    new_value, old_value = getattr(parallel, new), getattr(parallel, old)
    if new_value is not None and old_value is not None \
            and new_value != old_value:
        raise ParallelismError(
            f'parallel.{new}={new_value!r} and parallel.{old}={old_value!r} '
            f'disagree; {old} is the seed name of {new}: give one of them')
    return new_value if new_value is not None else old_value


def node_local_shard(dp: int, explicit: Optional[int] = None) -> int:
    """HSDP shard size when the config gives no data axes.

    ``explicit`` (``hybrid_shard_size``), else the ranks on one node
    (``LOCAL_WORLD_SIZE``, torch's default split), at most ``dp``.

    Raises:
        ParallelismError: a size that does not divide ``dp``.
    """
    size = explicit or min(int(os.environ.get('LOCAL_WORLD_SIZE', dp)), dp)
    key = 'model_wrapper_cfg.hybrid_shard_size' if explicit else \
        'the HYBRID shard size (LOCAL_WORLD_SIZE, ranks per node)'
    check_int(key, size, error=ParallelismError)
    if dp % size:
        raise ParallelismError(
            f'{key}={size!r} is not allowed; allowed: an int >= 1 that '
            f'divides the data-parallel size {dp} (or set parallel.dp_shard)')
    return size


def check_shard_size(shard_size: Optional[int], dims: ParallelDims) -> None:
    """A wrapper's ``hybrid_shard_size`` agrees with the layout's dp_shard.

    Raises:
        ValueError: it does not, naming both.
    """
    if shard_size is not None and shard_size != dims.dp_shard:
        raise ValueError(
            f'model_wrapper_cfg.hybrid_shard_size={shard_size!r} '
            f'disagrees with the layout (dp_shard={dims.dp_shard}); '
            'allowed: leave it unset and give parallel.dp_shard instead')


def _mp_means_dp_shard(parallel, hybrid: bool) -> bool:
    # The seed's HYBRID_SHARD sharded inside the mp group and replicated
    # across dp: that is HSDP, model_parallelism=k meaning dp_shard=k.
    return hybrid and parallel.tp is None and parallel.tp_plan is None


def _requested(parallel, world_size: int, hybrid: bool,
               hybrid_shard_size: Optional[int]) -> dict:
    """Sizes as asked, seed aliases resolved (``-1`` where unset)."""
    mp = parallel.model_parallelism
    sizes = {axis: getattr(parallel, axis) for axis in AXES}
    sizes.update(pp=_pick(parallel, 'pp', 'pipeline_parallelism') or 1,
                 cp=parallel.cp or 1, ep=parallel.ep or 1)
    if mp is not None and _mp_means_dp_shard(parallel, hybrid):
        sizes['tp'] = 1
        # The wrapper's explicit hybrid_shard_size wins over the alias, as
        # it did in the seed.
        if hybrid_shard_size is None or parallel.dp_shard is not None:
            sizes['dp_shard'] = _pick(parallel, 'dp_shard',
                                      'model_parallelism')
    else:
        sizes['tp'] = _pick(parallel, 'tp', 'model_parallelism') or 1
    if sizes['tp'] > world_size:
        key = 'tp' if parallel.tp is not None else 'model_parallelism'
        warnings.warn(f'{key}={sizes["tp"]} is larger than the world size '
                      f'{world_size}; using {key}={world_size}')
        sizes['tp'] = world_size
    if sizes['dp_replicate'] is None and sizes['dp_shard'] is None:
        if hybrid:
            # -1 ("the rest") on tp, pp or cp leaves no room for data
            # shards.
            dp = world_size // math.prod(
                max(sizes[axis], 1) for axis in AXES
                if axis not in DATA_AXES) or 1
            sizes['dp_shard'] = node_local_shard(dp, hybrid_shard_size)
        else:
            sizes['dp_replicate'] = 1
    for name in DATA_AXES:
        if sizes[name] is None:
            taken = any(v == -1 for v in sizes.values())
            sizes[name] = 1 if taken else -1
    return sizes


def _check_cp_divides(parallel, world_size: int) -> None:
    """cp splits each sequence over its ranks: it must divide the world."""
    cp = parallel.cp
    if cp is not None and cp != -1 and world_size % cp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ParallelismError(
            f'parallel.cp={cp} does not divide the world size {world_size}; '
            f'allowed: one of {", ".join(map(str, divisors))} (or -1, the '
            'rest of the world): cp ranks split each sequence, and the '
            'other axes must fill the rest of the world')


def _refuse_unsupported(parallel, dims: ParallelDims) -> None:
    """Layouts no code can train correctly yet fail here, naming the key."""
    if dims.tp_enabled and parallel.tp_plan is None:
        key = 'tp' if parallel.tp is not None else 'model_parallelism'
        raise ParallelismError(
            f'parallel.{key}={dims.tp} asks for tensor parallelism but '
            'parallel.tp_plan is not set, so tensor-parallel peers would '
            'train diverging copies of the model; allowed: set '
            f'parallel.tp_plan, or {key}=1 (with FSDP '
            "sharding_strategy='HYBRID_SHARD', model_parallelism=k means "
            'dp_shard=k; or set parallel.dp_shard=k for sharded data '
            'parallelism)')
    if dims.pp_enabled and parallel.pipeline is None:
        key = 'pp' if parallel.pp is not None else 'pipeline_parallelism'
        raise ParallelismError(
            f'parallel.{key}={dims.pp} asks for pipeline parallelism but '
            'parallel.pipeline (how to split the model into stages) is not '
            f'set; allowed: set parallel.pipeline=dict(...), or {key}=1')


def resolve_dims(parallel,
                 world_size: int,
                 *,
                 hybrid: bool = False,
                 hybrid_shard_size: Optional[int] = None) -> ParallelDims:
    """The layout a ``parallel`` section asks for at ``world_size`` ranks.

    Args:
        parallel: a :class:`mmpar.parallel.config.ParallelConfig`.
        world_size: the number of ranks.
        hybrid: the FSDP wrapper uses a HYBRID sharding strategy; then
            ``model_parallelism=k`` (with no ``tp``/``tp_plan``) means
            ``dp_shard=k`` (HSDP), and with no data axes given the shard
            axis is ``hybrid_shard_size`` or the ranks of one node.
        hybrid_shard_size: the wrapper's ``hybrid_shard_size``, if any.

    Returns:
        The validated layout.

    Raises:
        ParallelismError: conflicting aliases, sizes that do not fit the
            world (``cp`` not dividing it), ``tp > 1`` without ``tp_plan``
            or ``pp > 1`` without ``pipeline``; the message names the key
            the user wrote.
    """
    _check_cp_divides(parallel, world_size)
    sizes = _requested(parallel, world_size, hybrid, hybrid_shard_size)
    try:
        dims = ParallelDims(world_size=world_size, **sizes)
    except ParallelismError as err:
        # Name the keys the user wrote, not only the axes they became.
        mp_axis = 'dp_shard' if _mp_means_dp_shard(parallel, hybrid) \
            else 'tp'
        seeds = [f'parallel.{old}={getattr(parallel, old)} is {new}'
                 for old, new in (('model_parallelism', mp_axis),
                                  ('pipeline_parallelism', 'pp'))
                 if getattr(parallel, old) is not None]
        if not seeds:
            raise
        raise ParallelismError(f'{err} ({"; ".join(seeds)})') from None
    _refuse_unsupported(parallel, dims)
    return dims
