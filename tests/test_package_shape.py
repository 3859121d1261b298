"""The package's shape: no import circle between mmpar's modules."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports() -> dict:
    modules = {}
    for path in (ROOT / 'mmpar').rglob('*.py'):
        name = '.'.join(path.relative_to(ROOT).with_suffix('').parts)
        modules[name.removesuffix('.__init__')] = path
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [
                    f'{node.module}.{alias.name}' for alias in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _is_package_edge(a: str, b: str) -> bool:
    # A package's __init__ re-exporting its own submodules is not a circle.
    return a.startswith(b + '.') or b.startswith(a + '.')


def test_no_import_circle_in_mmpar():
    graph = _imports()
    assert 'mmpar.checkpoint.sharded' in graph  # the walk found the package
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if _is_package_edge(node, nxt):
                    continue
                if nxt == start:
                    raise AssertionError('import circle: ' +
                                         ' -> '.join(path + [start]))
                if nxt not in path:
                    stack.append((nxt, path + [nxt]))
