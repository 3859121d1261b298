"""The axes are named once: ``mmpar/parallel/axes.py``'s table.

Every other module takes the axes and their roles from it; a tuple of axis
names spelled anywhere else in ``mmpar/`` is a second list that a new axis
(expert parallelism next) would have to find and extend by hand.
"""
import ast
import dataclasses
import pathlib

from mmpar.parallel import axes
from mmpar.parallel.config import ParallelConfig
from mmpar.parallel.dims import ParallelDims

PACKAGE = pathlib.Path(axes.__file__).parents[1]
NAMES = set(axes.AXES) | set(axes.FLATTENED) | {'mp'}
# Lists that are not axis lists: the seed API's group kinds (public names).
ALLOWED = {('parallel/seed.py', ('dp', 'pp', 'mp'))}


def axis_name_lists(source: str):
    """Tuples, lists and sets of two or more string constants, at least two
    of them axis names, in ``source``: ``[(line, names)]``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and \
                len(node.elts) >= 2 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str)
                    for e in node.elts):
            names = tuple(e.value for e in node.elts)
            if sum(name in NAMES for name in names) >= 2:
                found.append((node.lineno, names))
    return found


def test_no_axis_list_outside_the_table():
    found = []
    for path in sorted(PACKAGE.rglob('*.py')):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == 'parallel/axes.py':
            continue
        for line, names in axis_name_lists(path.read_text()):
            if (rel, names) not in ALLOWED:
                found.append(f'mmpar/{rel}:{line} {names}')
    assert not found, ('axis names listed outside mmpar/parallel/axes.py '
                       '(take them from its table):\n' + '\n'.join(found))


def test_the_scan_finds_a_planted_list():
    planted = "KINDS = ('tp', 'pp', 'dp')\nCP_KINDS = ['cp', 'dp_cp']\n"
    assert [names for _, names in axis_name_lists(planted)] == [
        ('tp', 'pp', 'dp'), ('cp', 'dp_cp')]
    assert axis_name_lists("x = ('tp', 'other')\n") == []


def test_every_axis_is_a_size_key_and_a_dims_field():
    dims_fields = {f.name for f in dataclasses.fields(ParallelDims)}
    config_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    for axis in axes.TABLE:
        assert axis.role in axes.ROLES, axis
        assert axis.name in dims_fields, axis.name
        assert axis.name in config_fields, axis.name


def test_flattened_axes_follow_the_roles():
    assert axes.AXES == ('dp_replicate', 'dp_shard', 'ep', 'pp', 'cp', 'tp')
    assert axes.FLATTENED == dict(
        dp=('dp_replicate', 'dp_shard', 'ep'),
        dp_cp=('dp_replicate', 'dp_shard', 'ep', 'cp'),
        dp_shard_cp=('dp_shard', 'ep', 'cp'),
        efsdp=('dp_shard', 'cp'))
    assert axes.DATA_AXES == ('dp_replicate', 'dp_shard')
    assert axes.PEER_AXES == ('pp', 'cp', 'tp')
    assert axes.REPLICATE_SHARD == ('dp_replicate', 'dp_shard_cp')


def test_coords_and_rank_at_invert_each_other():
    dims = ParallelDims(dp_replicate=2, dp_shard=1, pp=3, cp=2, tp=2,
                        world_size=24)
    for rank in range(24):
        assert dims.rank_at(**dims.coords(rank)) == rank
    # tp fastest, then cp, then pp: (dp 0, last stage, cp 0, tp 0).
    assert dims.rank_at(pp=-1) == (3 - 1) * 2 * 2
    assert dims.coords(13) == dict(dp_replicate=1, dp_shard=0, ep=0, pp=0,
                                   cp=0, tp=1)
