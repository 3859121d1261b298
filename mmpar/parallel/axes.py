"""The one table of parallel axes and what each is for.

Every module that iterates axes reads this table: the config keys and
sizes (:mod:`.dims`, :mod:`.config`), the groups (:mod:`.layout`), the mesh
(:mod:`.mesh`), the topology, the samplers and metrics
(:mod:`mmpar.runner.data_axis`) and the plan report. What an axis means to
them is its *role*:

``data``      ranks read different samples and hold the same weights (or
              shards of them): samplers and metrics work over these axes,
              gradients are reduced over them.
``sequence``  ranks read the same samples but different tokens of each
              (context parallelism): gradients are reduced over them and
              FSDP shards parameters over them too; the step body cuts the
              batch (:func:`mmpar.parallel.sequence.shard_batch`).
``model``     ranks read the same samples and hold different parts of the
              model (tensor and pipeline parallelism): nothing data-parallel
              runs over them; one rank of each group reports the outputs.
``expert``    ranks read different samples and hold different experts
              (expert parallelism): samplers and metrics work over them as
              over a data axis, and gradients of the parameters every expert
              rank holds are reduced over them.

The flattened axes are sets of roles, so a new axis joins them by its
role: ``dp`` (what samplers and metrics work over), ``dp_cp`` (the gradient
axis: every rank that reads different tokens), ``dp_shard_cp`` (what
FSDP shards over) and ``efsdp`` (what FSDP shards experts over: the shard
axes but ``ep``). Their names are the axes they flatten today.
"""
from dataclasses import dataclass
from typing import Dict, Tuple

DATA, SEQUENCE, MODEL, EXPERT = 'data', 'sequence', 'model', 'expert'
ROLES = (DATA, SEQUENCE, MODEL, EXPERT)


@dataclass(frozen=True)
class Axis:
    """One named axis of the rank grid.

    Attributes:
        name: the config key and mesh dim name.
        role: one of :data:`ROLES`.
        shards: FSDP shards parameters over it (``dp_shard_cp``).
        reporter: the coordinate on this axis of the rank that reports a
            model's outputs (``model``/``sequence`` axes; -1: the last).
    """
    name: str
    role: str
    shards: bool = False
    reporter: int = 0


# In mesh order: slowest-varying first. dp outermost keeps the seed's groups
# for init_parallelism(mp, pp); then the more an axis talks, the closer its
# ranks: tp innermost (collectives in every layer, forward and backward)
# keeps a tp group on one node, cp next (an all-gather of keys/values per
# layer, a reduce-scatter back), pp outside it (one activation per
# micro-batch and stage boundary). torchtitan orders cp and pp the same way
# (pp, dp_replicate, dp_shard, cp, tp).
TABLE: Tuple[Axis, ...] = (
    Axis('dp_replicate', DATA),
    Axis('dp_shard', DATA, shards=True),
    # Expert parallelism sits inside the data ranks (ep divides what would
    # be dp_shard): the non-expert weights are sharded over it as over
    # dp_shard, the experts split over it and sharded over the rest of the
    # shard axes (FLATTENED['efsdp']). Next to dp_shard so the data axis
    # stays one block and an ep group is consecutive ranks (its
    # all-to-alls run twice per MoE layer and pass).
    Axis('ep', EXPERT, shards=True),
    Axis('pp', MODEL, reporter=-1),  # the last stage holds the outputs
    Axis('cp', SEQUENCE, shards=True),
    Axis('tp', MODEL),
)
AXES: Tuple[str, ...] = tuple(axis.name for axis in TABLE)
BY_NAME: Dict[str, Axis] = {axis.name: axis for axis in TABLE}


def axes_of(*roles: str) -> Tuple[str, ...]:
    """The axes with one of ``roles``, in mesh order."""
    return tuple(axis.name for axis in TABLE if axis.role in roles)


# Ranks on these read different samples (samplers, metrics, the batch).
SAMPLE_AXES = axes_of(DATA, EXPERT)
# Ranks on these read the same samples (one of them reports outputs).
PEER_AXES = axes_of(SEQUENCE, MODEL)
# HSDP's replicate x shard pair, the data axes as a 2-D mesh.
DATA_AXES = axes_of(DATA)
# Axes flattened into one, by role: the data axis (samplers, metrics), the
# gradient axis (every rank that reads different tokens) and FSDP's shard
# axis.
FLATTENED: Dict[str, Tuple[str, ...]] = dict(
    dp=SAMPLE_AXES,
    dp_cp=axes_of(DATA, SEQUENCE, EXPERT),
    dp_shard_cp=tuple(axis.name for axis in TABLE if axis.shards),
    # What experts are sharded over: the shard axes but the expert ones
    # (torchtitan's dp_shard x cp = efsdp x ep).
    efsdp=tuple(axis.name for axis in TABLE
                if axis.shards and axis.role != EXPERT))
# HSDP's 2-D data mesh: replicate over the data axes that do not shard,
# shard over the flattened shard axis.
REPLICATE_SHARD = tuple(a for a in DATA_AXES if not BY_NAME[a].shards) + (
    'dp_shard_cp', )
# HSDP around the experts: replicated over the same data axes, sharded over
# efsdp (torchtitan's dp_replicate x efsdp mesh for the experts).
REPLICATE_EXPERT_SHARD = REPLICATE_SHARD[:-1] + ('efsdp', )
