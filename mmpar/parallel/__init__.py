"""Parallel layout: named axes, their groups and one mesh.

See ``docs/topology.md``. Importing this package is cheap (no MMEngine).
The seed API (``init_parallelism``, ``parallel_group_info``, ...) lives in
:mod:`mmpar.parallel.seed`; the dry run (``tools/plan.py``) in
``mmpar.analysis.plan``.
"""
from mmpar.parallel.axes import AXES
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims, ParallelismError, resolve_dims
from mmpar.parallel.groups import GroupInfo, Pending
from mmpar.parallel.layout import ParallelLayout, layout_of
from mmpar.parallel.mesh import ParallelMesh
from mmpar.parallel.seed import (DIMS, check_sizes, data_mesh,
                                 default_dp_group, default_group_info,
                                 init_parallelism, parallel_group_info,
                                 parallel_layout, parallelism_is_initialized,
                                 reset_parallelism, setup_parallelism)
from mmpar.parallel.topology import ParallelTopology, build_topology

__all__ = [
    'AXES', 'DIMS', 'GroupInfo', 'Pending', 'ParallelConfig', 'ParallelDims',
    'ParallelMesh', 'ParallelismError', 'ParallelLayout', 'ParallelTopology',
    'build_topology', 'check_sizes', 'data_mesh', 'default_dp_group',
    'default_group_info', 'init_parallelism', 'layout_of',
    'parallel_group_info', 'parallel_layout', 'parallelism_is_initialized',
    'reset_parallelism', 'resolve_dims', 'setup_parallelism'
]
