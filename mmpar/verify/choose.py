"""The default reference: one process when it fits ``--memory-budget``,
otherwise the smallest data-parallel layout that shards the model and fits
(mmpar's memory plan, :func:`mmpar.analysis.plan.make_plan`, predicts each
candidate's peak per rank)."""
from typing import List, Optional

from mmengine.config import Config

from mmpar.failures import ConfigError
from mmpar.verify.against import ONE_PROCESS, parse_against
from mmpar.verify.run import reference_config

# The sharding wrapper a fallback reference uses when the config's own
# replicates the model (a replica per rank would not need less memory).
SHARDING_WRAPPER = 'MMFullyShard'


def fallback_references(cfg: Config, world_size: int) -> List[str]:
    """``--against`` values to try after one process, smallest first:
    ``dp_shard=K`` for each K >= 2 dividing ``world_size``, with the
    config's wrapper when it shards parameters, else
    :data:`SHARDING_WRAPPER`."""
    from mmpar.analysis.layouts import wrapper_replicates
    wrapper = f',wrapper={SHARDING_WRAPPER}' if wrapper_replicates(cfg) \
        else ''
    return [f'dp_shard={size}{wrapper}' for size in range(2, world_size + 1)
            if world_size % size == 0]


def choose_reference(cfg: Config, world_size: int, against: str,
                     memory_budget: Optional[float]) -> str:
    """The ``--against`` to run: ``against`` itself unless it is the
    default (one process) and a ``memory_budget`` (GiB per rank) is given;
    then one process if its predicted peak fits, else the first of
    :func:`fallback_references` that fits.

    Raises:
        ConfigError: nothing fits (naming ``--memory-budget``, each
            candidate's predicted peak, and what is allowed).
    """
    if against != ONE_PROCESS or memory_budget is None:
        return parse_against(against).label
    if not memory_budget > 0:
        raise ConfigError(f'--memory-budget={memory_budget!r}; allowed: a '
                          'number of GiB > 0')
    from mmpar.analysis.memory import GiB, within_budget
    from mmpar.analysis.plan import make_plan
    tried = []
    for text in [ONE_PROCESS] + fallback_references(cfg, world_size):
        try:
            ref = reference_config(cfg, world_size, text)
        except ConfigError as err:
            tried.append(f'{text}: refused ({err})')
            continue
        peak = make_plan(ref, parse_against(text).world_size).estimate.peak
        if within_budget(peak, memory_budget):
            return text
        tried.append(f'{text}: {peak / GiB:.3g} GiB')
    raise ConfigError(
        f'--memory-budget={memory_budget:g}: no reference layout of at most '
        f'{world_size} ranks fits (predicted peak per rank: '
        f'{"; ".join(tried)}); allowed: a larger budget, or --against LAYOUT')
