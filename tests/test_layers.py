"""The import layering of docs/ARCHITECTURE.md, enforced: every ``import kiln...`` of every module of the
package (function-level ones too) must go to a layer the importer's layer may import, and module-level
imports must not form a cycle. Also: what ``import kiln`` and ``import kiln.ir`` load."""
from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("ir", "frontend", "serializer", "runtime", "server", "mobile_stub", "tools")


def layer_table() -> tuple[dict, dict]:
    """({top-level module or package: layer}, {layer: set of layers it may import}) from ARCHITECTURE.md."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Layers: what may import what", 1)[1].split("\n## ", 1)[0]
    layer_of, allowed = {}, {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("layer", "---") or not cells[1].startswith("`"):
            continue
        layer = cells[0]
        for m in cells[1].split(","):
            layer_of[m.strip().strip("`")] = layer
        may = {x.strip() for x in cells[2].split(",")} if not cells[2].startswith("(") else set()
        allowed[layer] = may | {layer}
    return layer_of, allowed


@functools.lru_cache(maxsize=1)
def modules() -> dict:
    """{dotted module name: path} of every module of the package (tests and bench are not the package)."""
    out = {}
    for path in sorted(ROOT.glob("*.py")):
        out["kiln" if path.stem == "__init__" else f"kiln.{path.stem}"] = path
    for top in PACKAGE_DIRS:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["kiln." + ".".join(parts)] = path
    return out


def imports(path: Path, known: dict) -> list:
    return _imports(path, tuple(known))


@functools.lru_cache(maxsize=None)
def _imports(path: Path, known: tuple) -> list:
    """[(imported kiln module, line, module-level?)] of ``path``: a ``from kiln.x import y`` names
    ``kiln.x.y`` where that is a module, else ``kiln.x``."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = set()
    for stmt in tree.body:  # module level: also inside top-level if/try blocks, not TYPE_CHECKING ones
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            continue
        top_level.update(id(n) for n in ast.walk(stmt) if not isinstance(n, (ast.FunctionDef,
                                                                              ast.AsyncFunctionDef)))
        for n in ast.walk(stmt):  # drop what is inside functions/classes' methods
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                top_level.difference_update(id(m) for m in ast.walk(n))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name == "kiln" or a.name.startswith("kiln.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "kiln" or node.module.startswith("kiln.")):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.append(sub if sub in known else node.module)
        for name in names:
            found.append((name, node.lineno, id(node) in top_level))
    return found


def layer_of_module(name: str, layer_of: dict) -> str:
    parts = name.split(".")
    key = "__init__" if len(parts) == 1 else parts[1]
    if key not in layer_of:
        raise AssertionError(f"{name}: its top-level module '{key}' is in no layer of docs/ARCHITECTURE.md")
    return layer_of[key]


def test_no_import_crosses_a_layer_upwards():
    layer_of, allowed = layer_table()
    known = modules()
    bad = []
    for name, path in known.items():
        mine = layer_of_module(name, layer_of)
        for target, line, _ in imports(path, known):
            theirs = layer_of_module(target, layer_of)
            if theirs not in allowed[mine]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name} ({mine}) imports {target} ({theirs})")
    assert not bad, "imports against docs/ARCHITECTURE.md's layers:\n" + "\n".join(bad)


def test_no_import_cycle_among_module_level_imports():
    known = modules()
    graph = {name: sorted({t for t, _, top in imports(path, known) if top and t != name and t in known})
             for name, path in known.items()}
    # A package's __init__ is imported before its submodules: an edge from a submodule to its own
    # package (or an ancestor) is what Python resolves first, not a cycle of definitions.
    for name in graph:
        graph[name] = [t for t in graph[name] if not name.startswith(t + ".")]
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def strong(v):  # Tarjan's strongly connected components, iteratively deep enough for this package
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, f"module-level import cycles: {cycles}"


def test_the_table_covers_every_top_level_module():
    layer_of, allowed = layer_table()
    for name in modules():
        layer_of_module(name, layer_of)  # raises for a module in no layer
    for layer, may in allowed.items():
        assert may <= set(allowed), f"layer {layer} may import an unknown layer: {may - set(allowed)}"


def _loaded_after(statement: str) -> list:
    code = f"import sys; {statement}; print(sorted(m for m in sys.modules if m == 'kiln' or m.startswith('kiln.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_import_kiln_is_light_and_the_api_loads_on_first_use():
    assert _loaded_after("import kiln") == ["kiln", "kiln.blas_env", "kiln.errors", "kiln.version"]
    loaded = _loaded_after("import kiln.ir")
    outside = [m for m in loaded if not m.startswith("kiln.ir")]
    assert outside == ["kiln", "kiln.blas_env", "kiln.checks", "kiln.errors", "kiln.version"], outside
    import kiln
    assert kiln.Graph.__module__ == "kiln.ir.graph" and callable(kiln.load) and kiln.runtime.Program is kiln.Program
    assert {"Graph", "load", "save", "trace"} <= set(dir(kiln))
    try:
        kiln.no_such_name
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("kiln.no_such_name did not raise AttributeError")
