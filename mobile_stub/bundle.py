"""``kiln mobile bundle``: one self-contained zipapp that runs one packed model with numpy alone.

What goes in, and why it is safe to leave the rest out:

- the stub runtime (mobile_stub/runtime.py) and, from mobile_stub/kernels/, only the modules whose
  KERNELS provide an ``Op:dtype`` of the model's manifest (``kiln.mobile.ops``), plus the helper modules
  those import. kernels/__init__.py loads families by name and skips absent ones, so the stub's kernel
  table is exactly the bundled families;
- the reader pieces the runtime imports (serializer/format.py, serializer/fbread.py,
  serializer/fb/layout.py, errors.py). They are found by following the runtime's imports (AST, not by a
  hard-coded list), and each package ``__init__`` on the way is replaced by an empty one, since kiln's own
  ``__init__`` imports the IR. A module importing kiln.ir/torch/onnx at top level loses that import
  and the top-level statements that use its names (building fails if a function still uses them);
  imports of those inside functions are lazy and are not followed (format.py builds its IR attribute
  tables in a module ``__getattr__`` the stub never triggers);
- ``__main__.py`` (mobile_stub/_bundle_main.py) and the model file, stored uncompressed and aligned.

The layout inside the zip keeps the ``kiln/...`` package paths, so the copied modules run unchanged
(``from kiln.errors import FormatError`` resolves to the bundled copy: the .pyz is first on sys.path).

The bundle never holds a model it cannot run: the manifest is checked against the kernels before
building, and the finished .pyz is then loaded once in a child process (``--check``), which makes the
stub runtime's own load-time op check run against exactly the kernels that were bundled.
"""
from __future__ import annotations

import ast
import importlib
import io
import struct
import subprocess
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

ROOT = Path(__file__).resolve().parent.parent  # the kiln package directory
FORBIDDEN = ("kiln.ir", "torch", "onnx", "onnxruntime", "scipy", "flatbuffers")
MODEL_NAME = "model.mobile.kiln"
# Top-level directories of the repository that are not part of the installed kiln package.
_NOT_PACKAGE = {"tests", "bench", "docs", "examples", "build", ".venv", "kiln.egg-info", "__pycache__", ".git"}


@dataclass
class BundleReport:
    path: str
    size: int  # the .pyz, bytes
    model_size: int  # the packed model inside it
    code_size: int  # everything else, compressed as stored
    modules: list  # module names bundled, in zip order
    kernels: list  # kernel modules chosen from the manifest
    package_size: int  # every .py of the full kiln package, uncompressed
    package_zip_size: int  # the same files deflated like the bundle's code

    def __str__(self) -> str:
        kb = lambda n: f"{n / 1024:.1f} KiB"
        return (f"wrote {self.path}: {kb(self.size)} (model {kb(self.model_size)}, code {kb(self.code_size)} in "
                f"{len(self.modules)} modules; kernels: {', '.join(self.kernels) or 'none'})\n"
                f"full kiln package: {kb(self.package_size)} of .py source, {kb(self.package_zip_size)} zipped; "
                f"bundle code is {self.code_size / self.package_zip_size:.1%} of it zipped")


# ---------------------------------------------------------------------------- the model's manifest
def read_manifest(packed_path: str) -> list[str]:
    """The ``Op:dtype`` list a packed file stores, read with the checked reader (no IR needed)."""
    from kiln.mobile_stub import packed

    return _checked(packed_path, lambda props: packed.parse_manifest(props[packed.PROP_OPS]))


def check_arena(packed_path: str) -> tuple:
    """The packed file's arena plan, checked on its own (mobile_stub/packed.py); the stub checks it again
    against the graph (slot sizes, liveness) when the bundle loads the model."""
    from kiln.mobile_stub import packed

    return _checked(packed_path, lambda props: packed.parse_arena(props.get(packed.PROP_ARENA), max_bytes=None))


def _checked(packed_path: str, read):
    """``read(props)`` of the file's metadata, every failure a one-line KilnError naming the file."""
    from kiln.errors import FormatError
    from kiln.mobile_stub import packed
    from kiln.serializer.fbread import read_flatbuffer
    from kiln.serializer.format import parse_header

    try:
        data = Path(packed_path).read_bytes()
    except OSError as e:
        raise KilnError(f"cannot read {packed_path}: {e.strerror or e}") from None
    try:
        header = parse_header(data, len(data))
        fb = data[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size]
        if zlib.crc32(fb) != header.flatbuffer_crc32:
            raise FormatError("graph section is corrupt: checksum mismatch")
        model = read_flatbuffer(fb, base=header.flatbuffer_offset)
        props = {kv["key"]: kv["value"] for kv in model.get("metadata") or ()}
        if props.get(packed.PROP_VERSION) is None or packed.PROP_OPS not in props:
            raise KilnError(f"{packed_path} is not a packed mobile model (no kiln.mobile.* metadata): "
                            "run `kiln mobile pack` on it first")
        if props[packed.PROP_VERSION] != packed.MOBILE_VERSION:
            raise FormatError(f"packed format version {props[packed.PROP_VERSION]!r:.40}; this kiln writes and runs "
                              f"version {packed.MOBILE_VERSION}")
        return read(props)
    except FormatError as e:
        raise FormatError(f"{packed_path}: {e}") from None


def select_kernel_modules(manifest: list[str]) -> list[str]:
    """The kernel families (``conv``, ``pool``, ...) that together provide every manifest entry
    (opset.families_for); raises naming the entries no family provides."""
    from kiln.mobile_stub import opset

    missing = opset.unsupported(manifest)
    if missing:
        raise KilnError(f"the mobile runtime has no kernel for {', '.join(missing)} (from the model's manifest): "
                        "the model cannot be bundled; `kiln mobile check` names the nodes")
    return opset.families_for(manifest)


# ---------------------------------------------------------------------------- collecting sources
def _module_file(module: str) -> Path:
    rel = Path(*module.split(".")[1:])
    pkg = ROOT / rel / "__init__.py"
    return pkg if pkg.exists() else ROOT / rel.with_suffix(".py")


def _is_forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> list[tuple[ast.stmt, str, list[str]]]:
    """(statement, imported module, names bound) for every import anywhere in ``tree``; relative
    imports resolved against ``module``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node, a.name, [a.asname or a.name.split(".")[0]]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = sub if base.startswith("kiln") and _module_file(sub).exists() else base
                out.append((node, target, [a.asname or a.name]))
    return out


def _prune_forbidden(source: str, tree: ast.Module, module: str, is_pkg: bool) -> str:
    """Drop top-level imports of forbidden modules and every top-level statement using the names they
    bind; fail if a name is still used (inside a function, say). Imports inside functions are lazy (a
    module ``__getattr__``, a code path the stub never takes) and stay: they are not followed, and the
    bundle's self-check and the fresh-venv run are what show the stub never reaches them."""
    banned_stmts, names = set(), set()
    for stmt, target, bound in _imports(tree, module, is_pkg):
        if _is_forbidden(target) and any(stmt is top for top in tree.body):
            banned_stmts.add(id(stmt))
            names.update(bound)
    if not names:
        return source
    changed = True
    while changed:  # a statement using a dropped name drops the names it defines, too
        changed = False
        for stmt in tree.body:
            if id(stmt) in banned_stmts or isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # code is never dropped silently: a def still using a name fails below
            used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            if used & names:
                banned_stmts.add(id(stmt))
                for t in ast.walk(stmt):
                    if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                        names.add(t.id)
                changed = True
    lines = source.splitlines(keepends=True)
    drop = set()
    for stmt in tree.body:
        if id(stmt) in banned_stmts:
            drop.update(range(stmt.lineno - 1, stmt.end_lineno))
    kept = "".join(line for i, line in enumerate(lines) if i not in drop)
    still = {n.id for n in ast.walk(ast.parse(kept)) if isinstance(n, ast.Name)} & names
    if still:
        raise KilnError(f"{module} still uses {', '.join(sorted(still))} (from kiln.ir/torch/onnx) after "
                        "dropping those imports: it cannot go in a numpy-only bundle")
    return kept


_EMPTY_INIT = '"""Package marker of a kiln mobile bundle (the full package\'s __init__ imports the IR)."""\n'
_KERNELS_PKG = "kiln.mobile_stub.kernels"
_REAL_INITS = {_KERNELS_PKG}  # packages whose __init__ the bundle needs (kernels: load(), QWeight)


def collect_sources(roots: list[str], kernel_modules: list[str]) -> dict[str, str]:
    """Zip path -> source for ``roots`` and every kiln module they import (transitively): package
    __init__s emptied (but the kernels package's, which the runtime uses), forbidden imports pruned,
    and kernel families other than ``kernel_modules`` left out."""
    sources: dict[str, str] = {}
    todo = list(roots) + list(_REAL_INITS)
    done = set()
    while todo:
        module = todo.pop()
        if module in done:
            continue
        done.add(module)
        path = _module_file(module)
        if not path.exists():
            raise KilnError(f"cannot bundle {module}: {path} does not exist")
        is_pkg = path.name == "__init__.py"
        parts = module.split(".")
        for i in range(1, len(parts) + is_pkg):  # every package on the way: an empty __init__
            sources.setdefault("/".join(parts[:i] + ["__init__.py"]), _EMPTY_INIT)
        if is_pkg and module not in _REAL_INITS:
            continue
        source = path.read_text()
        source = _prune_forbidden(source, ast.parse(source), module, is_pkg)
        sources["kiln/" + path.relative_to(ROOT).as_posix()] = source
        for _, target, _ in _imports(ast.parse(source), module, is_pkg):
            if _is_forbidden(target) or not target.startswith("kiln."):
                continue
            if (target.startswith(_KERNELS_PKG + ".") and target.split(".")[3] not in kernel_modules
                    and hasattr(importlib.import_module(target), "KERNELS")):
                continue  # another kernel family: only the manifest's are bundled
            todo.append(target)
    return sources


# ---------------------------------------------------------------------------- sizes
def package_size() -> tuple[int, int]:
    """(bytes of every .py file of the full kiln package, bytes of those files deflated into a zip):
    what ``pip install kiln-compiler`` would ship as Python source, against which the bundle is measured."""
    files = [p for p in ROOT.rglob("*.py")
             if not (set(p.relative_to(ROOT).parts[:-1]) & _NOT_PACKAGE) and p.relative_to(ROOT).parts[0]
             not in _NOT_PACKAGE and not p.relative_to(ROOT).parts[0].startswith(".")]  # .venv*, .git
    raw = sum(p.stat().st_size for p in files)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for p in sorted(files):
            z.write(p, "kiln/" + str(p.relative_to(ROOT)))
    return raw, len(buf.getvalue())


# ---------------------------------------------------------------------------- building
def bundle(packed_path: str, out_pyz: str, *, verify: bool = True) -> BundleReport:
    """Write ``out_pyz``: a zipapp running the packed model ``packed_path`` with numpy alone."""
    if not Path(packed_path).is_file():
        raise KilnError(f"no such file: {packed_path}")
    manifest = read_manifest(packed_path)
    kernels = select_kernel_modules(manifest)
    check_arena(packed_path)
    roots = ["kiln.errors", "kiln.mobile_stub.runtime"] + [f"kiln.mobile_stub.kernels.{m}" for m in kernels]
    sources = collect_sources(roots, kernels)
    main = (Path(__file__).parent / "_bundle_main.py").read_text()
    out = Path(out_pyz)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")  # as zipapp does; zip offsets stay absolute
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr("__main__.py", main)
            for arc in sorted(sources):
                z.writestr(arc, sources[arc])
            _write_aligned(z, f.tell(), MODEL_NAME, Path(packed_path).read_bytes())
    if verify:
        _self_check(tmp)
    tmp.replace(out)
    with zipfile.ZipFile(out) as z:
        model_size = z.getinfo(MODEL_NAME).compress_size
    size = out.stat().st_size
    raw, zipped = package_size()
    modules = sorted(arc[:-3].replace("/", ".") for arc in sources)
    return BundleReport(str(out), size, model_size, size - model_size, modules, kernels, raw, zipped)


def _write_aligned(z: zipfile.ZipFile, pos: int, name: str, data: bytes, align: int = 4096) -> None:
    """Store ``data`` uncompressed so that it starts at a multiple of ``align`` in the file, so the model
    can be memory-mapped in place with its data segment (4096-aligned within the .kiln file) still
    aligned for numpy views of the weights. The padding is a local-header extra
    field (id 0xD935, as Android's zipalign uses)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    head = pos + 30 + len(name.encode()) + 4
    pad = -head % align
    info.extra = struct.pack("<HH", 0xD935, pad) + bytes(pad)
    z.writestr(info, data)


def _self_check(pyz: Path) -> None:
    """Load the model once from the finished bundle, in a child process with the bundle first on
    sys.path, so the stub runtime's load-time op check runs against exactly the bundled kernels."""
    proc = subprocess.run([sys.executable, "-I", str(pyz), "--check"], capture_output=True, text=True)
    if proc.returncode != 0:
        pyz.unlink(missing_ok=True)
        raise KilnError(f"the bundle cannot run its model, not written: {(proc.stderr or proc.stdout).strip()}")


def top_level_imports(pyz: str) -> list[str]:
    """Every module the bundle's files import at module level, i.e. what loading them imports (for
    tests and reports; lazy imports inside functions are left out, see _prune_forbidden)."""
    found = set()
    with zipfile.ZipFile(pyz) as z:
        for name in z.namelist():
            if name.endswith(".py"):
                for node in ast.parse(z.read(name)).body:
                    if isinstance(node, ast.Import):
                        found.update(a.name for a in node.names)
                    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                        found.add(node.module)
    return sorted(found)
