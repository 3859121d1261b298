"""The package's shape: imports go one way, down the layers.

The import graph is built from the source of ``mmpar/`` and ``benchmarks/``
(every ``import``, also inside functions and relative ones). A test fails on
any cycle between modules, any cycle between packages, and any import that
goes up the declared layer order (docs/architecture.md lists the same).
"""
import ast
from pathlib import Path
from typing import Dict, List, Optional, Set

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module may import only from its own layer's packages and
# from layers below. (Packages in one layer must not import each other in a
# circle: the package-cycle test checks that.)
LAYERS = [
    ['mmpar.version', 'mmpar.checks', 'mmpar.failures', 'mmpar.registry',
     'mmpar.cfg_options'],
    ['mmpar.device'],
    ['mmpar.dist'],
    ['mmpar.parallel'],
    ['mmpar.optim'],
    ['mmpar.wrappers'],
    ['mmpar.parallelize'],
    ['mmpar.models', 'mmpar.evaluation'],
    ['mmpar.datasets'],
    ['mmpar.checkpoint'],
    ['mmpar.config_check'],
    ['mmpar.runner'],
    ['mmpar.cli', 'mmpar.analysis'],
    ['mmpar.verify'],
    ['mmpar.generation'],
    ['mmpar.convert'],
    ['mmpar'],
    ['benchmarks._common', 'benchmarks._stage_clock', 'benchmarks.baselines'],
    ['benchmarks._steps'],
    ['benchmarks'],
]


def _modules(root: Path) -> Dict[str, Path]:
    modules = {}
    for top in ('mmpar', 'benchmarks'):
        for path in (root / top).rglob('*.py'):
            name = '.'.join(path.relative_to(root).with_suffix('').parts)
            modules[name.removesuffix('.__init__')] = path
    return modules


def _resolve(target: str, modules) -> Optional[str]:
    # 'mmpar.parallel.dims.AXES' -> 'mmpar.parallel.dims'
    while target and target not in modules:
        target = target.rpartition('.')[0]
    return target or None


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    """Module -> the modules it imports (of ``mmpar`` and ``benchmarks``).

    ``from a.b import c`` is an edge to ``a.b.c`` when that is a module,
    else to ``a.b``; importing a submodule also runs its parent packages'
    ``__init__``, which is not counted (every package would import itself).
    """
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == '__init__.py' else \
            name.rpartition('.')[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ''
                if node.level:
                    parts = package.split('.')
                    parts = parts[:len(parts) - node.level + 1]
                    base = '.'.join(parts + ([base] if base else []))
                targets = []
                for alias in node.names:
                    full = f'{base}.{alias.name}'
                    targets.append(full if full in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                target = _resolve(target, modules)
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def package_of(module: str) -> str:
    """The layer entry a module belongs to (the longest listed prefix)."""
    names = [n for layer in LAYERS for n in layer]
    found = [n for n in names if module == n or module.startswith(n + '.')]
    if not found:
        raise AssertionError(f'{module} is in no layer of LAYERS: add it')
    return max(found, key=len)


def find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A cycle of ``graph`` as a list of nodes, or None."""
    state: Dict[str, int] = {}  # 1: on the stack, 2: done
    stack: List[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def package_graph(graph: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    packages: Dict[str, Set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(package_of(module), set())
        edges.update(package_of(t) for t in targets
                     if package_of(t) != package_of(module))
    return packages


def upward_imports(graph: Dict[str, Set[str]]) -> List[str]:
    """``'a -> b'`` for every import of a module from a higher layer."""
    level = {n: i for i, layer in enumerate(LAYERS) for n in layer}
    return sorted(f'{m} -> {t}' for m, targets in graph.items()
                  for t in targets
                  if level[package_of(t)] > level[package_of(m)])


@pytest.fixture(scope='module')
def repo_graph() -> Dict[str, Set[str]]:
    """The repository's import graph, parsed once for the tests that read
    it (none changes it)."""
    return import_graph()


def test_the_graph_sees_every_kind_of_import(repo_graph):
    graph = repo_graph
    assert 'mmpar.checkpoint.sharded' in graph  # the walk found the package
    # A module-level import, a function-level one and a relative one.
    assert 'mmpar.parallel.dims' in graph['mmpar.parallel.config']
    assert 'mmpar.parallelize.pipeline' in graph['mmpar.parallelize.compose']
    assert 'benchmarks._common' in graph['benchmarks.run']


def test_no_import_cycle_between_modules(repo_graph):
    cycle = find_cycle(repo_graph)
    assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_no_import_cycle_between_packages(repo_graph):
    cycle = find_cycle(package_graph(repo_graph))
    assert cycle is None, 'package cycle: ' + ' -> '.join(cycle)


def test_imports_only_go_down_the_layers(repo_graph):
    assert upward_imports(repo_graph) == []


@pytest.mark.parametrize('edges,kind', [
    ({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}, 'cycle'),
    ({'a': {'b'}, 'b': set(), 'c': {'a', 'b'}}, None),
])
def test_find_cycle_on_small_graphs(edges, kind):
    found = find_cycle(edges)
    assert (found is not None) == (kind == 'cycle')
    if found:
        assert found[0] == found[-1]


def test_a_reintroduced_cycle_is_caught(tmp_path):
    """The tests above fail on a tree with a circle: copy the package, add
    one function-level import back up (the knot issue 20 removed:
    parallel.config importing a wrapper helper), and look."""
    import shutil
    for top in ('mmpar', 'benchmarks'):
        shutil.copytree(ROOT / top, tmp_path / top)
    config = tmp_path / 'mmpar' / 'parallel' / 'config.py'
    config.write_text(config.read_text() + (
        '\n\ndef _wrapper_check():\n'
        '    from mmpar.wrappers.builder import check_use_fsdp\n'
        '    return check_use_fsdp\n'))
    graph = import_graph(tmp_path)
    assert 'mmpar.parallel.config -> mmpar.wrappers.builder' in \
        upward_imports(graph)
    assert find_cycle(package_graph(graph)) is not None
