"""Parallel topology: model / pipeline / data-parallel groups and a mesh.

See ``docs/topology.md``. Importing this package is cheap (no MMEngine
runner); the config and plan modules load on demand.
"""
from mmpar.parallel.groups import GroupInfo, Pending
from mmpar.parallel.layout import (DIMS, ParallelismError, ParallelLayout,
                                   check_sizes, parallel_layout)
from mmpar.parallel.topology import (ParallelTopology, default_dp_group,
                                     default_group_info, init_parallelism,
                                     parallel_group_info,
                                     parallelism_is_initialized,
                                     reset_parallelism)

__all__ = [
    'DIMS', 'GroupInfo', 'Pending', 'ParallelismError', 'ParallelLayout',
    'ParallelTopology', 'check_sizes', 'default_dp_group',
    'default_group_info', 'init_parallelism', 'parallel_group_info',
    'parallel_layout', 'parallelism_is_initialized', 'reset_parallelism'
]
