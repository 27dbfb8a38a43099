"""The package's structure: its modules import one another without a cycle."""
import ast
from pathlib import Path

import dimattn as da

PACKAGE = Path(da.__file__).parent


def relative_imports(path: Path):
    """The package modules a module imports (``from . import x``, ``from .x import y``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.update([node.module] if node.module else [a.name for a in node.names])
    return out


def test_module_imports_have_no_cycle():
    graph = {p.stem: relative_imports(p) - {"__init__"} for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert {"_attention", "_call", "_context_parallel", "_variants", "nn"} <= set(graph)
    done, path = set(), []

    def visit(m):
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        if m in done or m not in graph:
            return
        path.append(m)
        for n in graph[m]:
            visit(n)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)
    assert done == set(graph)
