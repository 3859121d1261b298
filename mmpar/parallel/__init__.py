"""Parallel topology: model / pipeline / data-parallel groups and a mesh.

See ``docs/topology.md``. Importing this package is cheap (no MMEngine);
``mmpar.parallel.plan`` (the dry run) loads MMEngine and is imported on demand.
"""
from mmpar.parallel.config import (ParallelConfig, default_wrapper_cfg,
                                   setup_parallelism)
from mmpar.parallel.groups import GroupInfo, Pending
from mmpar.parallel.layout import (DIMS, ParallelismError, ParallelLayout,
                                   check_sizes, parallel_layout)
from mmpar.parallel.topology import (ParallelTopology, default_dp_group,
                                     default_group_info, init_parallelism,
                                     parallel_group_info,
                                     parallelism_is_initialized,
                                     reset_parallelism)

__all__ = [
    'DIMS', 'GroupInfo', 'Pending', 'ParallelConfig', 'ParallelismError',
    'ParallelLayout', 'ParallelTopology', 'check_sizes', 'default_dp_group',
    'default_group_info', 'default_wrapper_cfg', 'init_parallelism',
    'parallel_group_info', 'parallel_layout', 'parallelism_is_initialized',
    'reset_parallelism', 'setup_parallelism'
]
