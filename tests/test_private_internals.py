"""Private torch / MMEngine names used in ``mmpar/`` are the listed ones.

A plain scan of the source (no import): ``from torch... import _name``,
imports of a private module, and ``obj._name`` attribute uses where
``_name`` is not one mmpar defines itself. Every one found must be in
:data:`ALLOWED`, which is the table in docs/architecture.md ("Private torch /
MMEngine internals still used"), and each use carries a comment (on its line
or the two above) saying why no public API serves. A new private name fails
here until it is listed in both places, or replaced by a public API.
"""
import ast
import collections
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / 'mmpar'
DOC = ROOT / 'docs' / 'architecture.md'
LIBRARIES = ('torch', 'mmengine')

# Each internal (as the scan names it) -> the files that use it.
ALLOWED = {
    'attr ._attn_implementation': {'models/hf.py'},
    'attr ._concatenate': {'parallel/mesh.py'},
    'attr ._exit': {'failures.py'},
    'attr ._gen_transform_infos': {'parallel/topology.py'},
    'attr ._get_backend': {'dist.py'},
    'attr ._grouped_mm': {'models/moe.py'},
    'attr ._handle': {'wrappers/fsdp.py'},
    'attr ._instance_dict': {'failures.py', 'runner/instances.py'},
    'attr ._is_root': {'wrappers/fsdp.py'},
    'attr ._non_persistent_buffers_set': {'wrappers/local_state.py'},
    'attr ._run_exitfuncs': {'failures.py'},
    'attr ._to_copy': {'parallelize/meta.py'},
    'module torch.distributed.fsdp._runtime_utils': {'wrappers/fsdp.py'},
    'module torch.utils._python_dispatch': {
        'analysis/activations.py', 'parallelize/meta.py'},
    'name torch.distributed.fsdp._runtime_utils._reshard': {
        'wrappers/fsdp.py'},
    'name torch.distributed.tensor._redistribute': {'parallel/topology.py'},
    'name torch.distributed.tensor.debug._clear_sharding_prop_cache': {
        'parallel/topology.py'},
    'name torch.distributed.tensor.placement_types._StridedShard': {
        'parallel/dtensor.py', 'parallelize/tp_styles.py'},
}


def _private(name: str) -> bool:
    return name.startswith('_') and not (name.startswith('__') and
                                         name.endswith('__'))


def own_private_names(trees) -> set:
    """Private names mmpar defines: functions, classes, arguments and
    names or attributes it assigns."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and \
                    isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx,
                                                           ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {name for name in names if name.startswith('_')}


def internals_in(tree, own: set):
    """``[(key, line)]``: the private library names ``tree`` uses."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and \
                not node.level and node.module.split('.')[0] in LIBRARIES:
            if any(_private(part) for part in node.module.split('.')):
                found.append((f'module {node.module}', node.lineno))
            found += [(f'name {node.module}.{alias.name}', node.lineno)
                      for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.Import):
            found += [(f'module {alias.name}', node.lineno)
                      for alias in node.names
                      if alias.name.split('.')[0] in LIBRARIES and any(
                          _private(p) for p in alias.name.split('.'))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            named = isinstance(base, ast.Name) and base.id in (
                'torch', 'dist', 'nn')
            if node.attr in own and not named:
                continue  # mmpar's own attribute (or an override of one)
            found.append((f'attr .{node.attr}', node.lineno))
    return found


@functools.lru_cache(maxsize=None)
def scan(package: pathlib.Path = PACKAGE):
    """``{key: {file: [lines]}}`` over every module of ``package``."""
    sources = {path: path.read_text() for path in package.rglob('*.py')}
    trees = {path: ast.parse(text) for path, text in sources.items()}
    own = own_private_names(trees.values())
    uses = collections.defaultdict(lambda: collections.defaultdict(list))
    for path, tree in sorted(trees.items()):
        rel = path.relative_to(package).as_posix()
        for key, line in internals_in(tree, own):
            uses[key][rel].append(line)
    return uses, sources


def test_every_private_internal_is_listed():
    uses, _ = scan()
    unlisted = {key: sorted(files) for key, files in uses.items()
                if key not in ALLOWED}
    assert not unlisted, (
        'private torch/MMEngine names not in tests/test_private_internals.'
        'py ALLOWED and the docs/architecture.md table (use a public API, '
        f'or list it with why): {unlisted}')
    moved = {key: sorted(set(files) - ALLOWED[key])
             for key, files in uses.items() if set(files) - ALLOWED[key]}
    assert not moved, f'listed internals used in new files: {moved}'
    left = {key: sorted(ALLOWED[key] - set(files))
            for key, files in uses.items()
            if key in ALLOWED and ALLOWED[key] - set(files)}
    assert not left, f'listed for files that no longer use them: {left}'
    gone = sorted(set(ALLOWED) - set(uses))
    assert not gone, f'listed but no longer used (unlist them): {gone}'


def test_the_list_is_short():
    # A ratchet: lower it as internals are replaced (18 after issue 33's
    # lean round; torch._grouped_mm, the experts' grouped GEMM, issue 36, is
    # one).
    assert len(ALLOWED) <= 18


def test_each_use_says_why():
    uses, sources = scan()
    bare = []
    for key, files in uses.items():
        for rel, lines in files.items():
            text = sources[PACKAGE / rel].splitlines()
            for line in lines:
                window = text[max(0, line - 3):line]
                if not any('#' in row for row in window):
                    bare.append(f'mmpar/{rel}:{line} {key}')
    assert not bare, 'uses without a comment saying why:\n' + '\n'.join(bare)


def test_the_doc_table_lists_each_one():
    table = DOC.read_text().split('## Private torch / MMEngine internals')[1]
    missing = []
    for key in ALLOWED:
        short = re.split(r'[ .]', key)[-1]
        if short not in table:
            missing.append(key)
    assert not missing, f'not in docs/architecture.md: {missing}'


def test_a_planted_use_is_found(tmp_path):
    package = tmp_path / 'mmpar'
    package.mkdir()
    (package / 'planted.py').write_text(
        'from torch.distributed._tools import mod_tracker\n'
        'from torch.nn.modules.module import _global_forward_hooks\n'
        'def f(module):\n'
        '    return module._forward_hooks\n')
    uses, _ = scan(package)
    assert set(uses) == {
        'module torch.distributed._tools',
        'name torch.nn.modules.module._global_forward_hooks',
        'attr ._forward_hooks'}
    assert not set(uses) & set(ALLOWED)
