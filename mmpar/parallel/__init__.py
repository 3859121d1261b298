"""Parallel layout: named axes, their groups and one mesh.

See ``docs/topology.md``. Importing this package is cheap (no MMEngine).

The dry run (``tools/plan.py``) lives in ``mmpar.analysis.plan``.
"""
from mmpar.parallel.config import (ParallelConfig, default_wrapper_cfg,
                                   setup_parallelism)
from mmpar.parallel.dims import (AXES, ParallelDims, ParallelismError,
                                 resolve_dims)
from mmpar.parallel.groups import GroupInfo, Pending
from mmpar.parallel.layout import (DIMS, ParallelLayout, check_sizes,
                                   layout_of, parallel_layout)
from mmpar.parallel.mesh import ParallelMesh
from mmpar.parallel.topology import (ParallelTopology, data_mesh,
                                     default_dp_group, default_group_info,
                                     init_parallelism, parallel_group_info,
                                     parallelism_is_initialized,
                                     reset_parallelism)

__all__ = [
    'AXES', 'DIMS', 'GroupInfo', 'Pending', 'ParallelConfig', 'ParallelDims',
    'ParallelMesh', 'ParallelismError', 'ParallelLayout', 'ParallelTopology',
    'check_sizes', 'data_mesh', 'default_dp_group', 'default_group_info',
    'default_wrapper_cfg', 'init_parallelism', 'layout_of',
    'parallel_group_info', 'parallel_layout', 'parallelism_is_initialized',
    'reset_parallelism', 'resolve_dims', 'setup_parallelism'
]
