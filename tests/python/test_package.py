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


def test_public_functions_document_their_arguments_and_results():
    """Every public function of the package and its integration modules has an
    ``Args:`` section when it takes arguments and a ``Returns:`` section when it
    returns something (Google style, as torch's own docstrings)."""
    import inspect
    import dimattn.nn
    import dimattn.returnn
    import dimattn.transformers
    checked, missing = 0, []
    for module in (da, dimattn.nn, dimattn.returnn, dimattn.transformers):
        names = getattr(module, "__all__", None) or [n for n, o in vars(module).items()
                                                    if not n.startswith("_") and inspect.isfunction(o)
                                                    and o.__module__ == module.__name__]
        for name in names:
            fn = getattr(module, name)
            if not inspect.isfunction(fn):
                continue
            checked += 1
            sig, doc = inspect.signature(fn), inspect.getdoc(fn) or ""
            params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
            if params and "Args:" not in doc:
                missing.append(f"{module.__name__}.{name}: Args")
            if sig.return_annotation not in (None, "None", inspect.Signature.empty) and "Returns:" not in doc:
                missing.append(f"{module.__name__}.{name}: Returns")
    assert checked >= 20
    assert not missing, missing
