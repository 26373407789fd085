"""``kiln mobile check|pack|bundle`` as real processes, and the bundle run the way a device would run it:
with the .pyz first on the path, no site-packages but numpy's directory, and nothing of kiln's but
what the bundle holds (the bench goes further: a fresh venv with numpy alone)."""
import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.ir import Graph
from kiln.mobile_stub import bundle as bundle_mod

NUMPY_DIR = str(Path(np.__file__).resolve().parent.parent)


def kiln_cli(*args):
    return subprocess.run([sys.executable, "-m", "kiln", "mobile", *args], capture_output=True, text=True,
                          timeout=300)


def run_pyz(pyz, *args, cwd=None):
    """The bundle in a bare interpreter: -S (no site: kiln's editable install is invisible), numpy's
    directory the only extra path entry."""
    env = {"PYTHONPATH": NUMPY_DIR, "PATH": os.environ.get("PATH", "")}
    return subprocess.run([sys.executable, "-S", str(pyz), *args], capture_output=True, text=True, env=env,
                          timeout=120, cwd=cwd)


# ---------------------------------------------------------------------------- models
def mlp_graph() -> Graph:
    """Gemm -> Relu -> Gemm, batch symbolic: packs to static shapes, one input and output."""
    rng = np.random.default_rng(0)
    g = Graph("mlp")
    x = g.add_input("x", "float32", ["batch", 16])
    h = g.op("Gemm", x, g.add_initializer("w1", rng.standard_normal((32, 16)).astype(np.float32)),
             g.add_initializer("b1", rng.standard_normal(32).astype(np.float32)), transB=1)
    h = g.op("Relu", h)
    y = g.op("Gemm", h, g.add_initializer("w2", rng.standard_normal((10, 32)).astype(np.float32)),
             g.add_initializer("b2", rng.standard_normal(10).astype(np.float32)), transB=1)
    g.outputs = [y]
    return g


def two_in_two_out_graph() -> Graph:
    g = Graph("pair")
    a = g.add_input("a", "float32", [2, 3])
    b = g.add_input("b", "float32", [2, 3])
    s = g.op("Add", a, b, name="sum")
    g.outputs = [g.op("Relu", s, name="relu"), g.op("Mul", a, b, name="prod")]
    return g


def unsupported_graph() -> Graph:
    """An op no stub kernel has (Sin), tagged with a module path as the tracer tags nodes."""
    g = Graph("odd")
    x = g.add_input("x", "float32", [1, 4])
    y = g.op("Sin", g.op("Relu", x), name="weird_sin")
    y.producer.meta["scope"] = "head.activation"
    g.outputs = [y]
    return g


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("mobile")
    kiln.save(mlp_graph(), d / "mlp.kiln")
    kiln.save(two_in_two_out_graph(), d / "pair.kiln")
    kiln.save(unsupported_graph(), d / "odd.kiln")
    return d


# ---------------------------------------------------------------------------- check
def test_check_passes_a_supported_model(work):
    r = kiln_cli("check", str(work / "mlp.kiln"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok")


def test_check_names_op_dtype_node_and_module_path_and_fails(work):
    r = kiln_cli("check", str(work / "odd.kiln"))
    assert r.returncode == 1
    assert "node 'weird_sin' (Sin:float32) at head.activation" in r.stdout
    assert "Relu" not in r.stdout  # only what is missing is listed


def test_check_function_returns_the_problems(work):
    from kiln.mobile_stub.check import check

    assert check(str(work / "mlp.kiln")) == []
    [p] = check(str(work / "odd.kiln"))
    assert (p.node, p.op, p.dtype, p.scope) == ("weird_sin", "Sin", "float32", "head.activation")


def test_pack_refuses_a_model_outside_the_op_set_and_writes_nothing(work):
    out = work / "odd.mobile.kiln"
    r = kiln_cli("pack", str(work / "odd.kiln"), "-o", str(out))
    assert r.returncode == 1
    assert "Sin" in r.stderr and "weird_sin" in r.stderr
    assert not out.exists()


def test_bad_dim_is_one_line_error(work):
    r = kiln_cli("check", str(work / "mlp.kiln"), "--dim", "batch=zero")
    assert r.returncode == 1 and "bad --dim 'batch=zero'" in r.stderr and "Traceback" not in r.stderr


# ---------------------------------------------------------------------------- pack + bundle, end to end
@pytest.fixture(scope="module")
def mlp_bundle(work):
    packed, pyz = work / "mlp.mobile.kiln", work / "mlp.pyz"
    r = kiln_cli("pack", str(work / "mlp.kiln"), "-o", str(packed), "--quantize", "int8")
    assert r.returncode == 0, r.stderr
    r = kiln_cli("bundle", str(packed), "-o", str(pyz))
    assert r.returncode == 0, r.stderr
    assert "full kiln package" in r.stdout
    return packed, pyz


def test_bundle_runs_without_kiln_and_matches_kiln_run(work, mlp_bundle):
    packed, pyz = mlp_bundle
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    np.save(work / "x.npy", x)
    r = run_pyz(pyz, "--input", str(work / "x.npy"), "-o", str(work / "y.npy"))
    assert r.returncode == 0, r.stderr
    expected = kiln.load(str(packed)).run({"x": x})
    np.testing.assert_allclose(np.load(work / "y.npy"), next(iter(expected.values())), rtol=1e-5, atol=1e-5)


def test_bundle_check_loads_only_bundled_modules(mlp_bundle):
    r = run_pyz(mlp_bundle[1], "--check")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok")


def test_bundle_holds_only_the_needed_kernels_and_no_ir(mlp_bundle):
    names = zipfile.ZipFile(mlp_bundle[1]).namelist()
    kernels = {n.rsplit("/", 1)[1][:-3] for n in names if n.startswith("kiln/mobile_stub/kernels/")}
    assert "conv" not in kernels and "pool" not in kernels  # an MLP needs neither
    assert not any(n.startswith(("kiln/ir/", "kiln/runtime/", "kiln/frontend/")) for n in names)
    imported = bundle_mod.top_level_imports(str(mlp_bundle[1]))
    assert not [m for m in imported if bundle_mod._is_forbidden(m)], imported


def test_model_is_stored_aligned_for_mapping(mlp_bundle):
    with zipfile.ZipFile(mlp_bundle[1]) as z:
        info = z.getinfo(bundle_mod.MODEL_NAME)
    raw = Path(mlp_bundle[1]).read_bytes()
    name_len, extra_len = np.frombuffer(raw, "<u2", 2, info.header_offset + 26)
    start = info.header_offset + 30 + int(name_len) + int(extra_len)
    assert info.compress_type == zipfile.ZIP_STORED and start % 4096 == 0
    assert raw[start:start + info.file_size] == Path(mlp_bundle[0]).read_bytes()


def test_bundle_with_several_inputs_and_outputs(work):
    packed, pyz = work / "pair.mobile.kiln", work / "pair.pyz"
    assert kiln_cli("pack", str(work / "pair.kiln"), "-o", str(packed)).returncode == 0
    assert kiln_cli("bundle", str(packed), "-o", str(pyz)).returncode == 0
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(2))
    np.save(work / "a.npy", a)
    np.save(work / "b.npy", b)
    r = run_pyz(pyz, "--input", f"a={work / 'a.npy'}", "--input", f"b={work / 'b.npy'}", "-o", str(work / "o.npz"))
    assert r.returncode == 0, r.stderr
    got = np.load(work / "o.npz")
    expected = kiln.load(str(packed)).run({"a": a, "b": b})
    assert sorted(got.files) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6)
    r = run_pyz(pyz, "--input", str(work / "a.npy"), "-o", str(work / "o.npz"))  # which input is it?
    assert r.returncode == 1 and "2 inputs" in r.stderr


def test_bundle_refuses_an_unpacked_file(work):
    r = kiln_cli("bundle", str(work / "mlp.kiln"), "-o", str(work / "nope.pyz"))
    assert r.returncode == 1 and "kiln mobile pack" in r.stderr
    assert not (work / "nope.pyz").exists()


def test_bundle_refuses_a_manifest_it_has_no_kernels_for(work):
    g = unsupported_graph()
    g.metadata.props.update({"kiln.mobile.version": "1", "kiln.mobile.ops": '["Relu:float32", "Sin:float32"]'})
    kiln.save(g, work / "forged.kiln")
    r = kiln_cli("bundle", str(work / "forged.kiln"), "-o", str(work / "forged.pyz"))
    assert r.returncode == 1 and "Sin:float32" in r.stderr
    assert not (work / "forged.pyz").exists()


# ---------------------------------------------------------------------------- pruning reader imports
def test_prune_drops_ir_imports_and_what_uses_them():
    src = ("import struct\nfrom kiln.ir.registry import AttrKind\nCODES = {k: 1 for k in AttrKind}\n"
           "BY = {v: k for k, v in CODES.items()}\n\ndef f():\n    return struct.calcsize('<I')\n")
    out = bundle_mod._prune_forbidden(src, ast.parse(src), "kiln.x", False)
    assert "AttrKind" not in out and "CODES" not in out and "BY" not in out and "def f" in out


def test_prune_refuses_when_a_function_still_needs_the_ir():
    src = "from kiln.ir import Graph\n\ndef f():\n    return Graph()\n"
    with pytest.raises(kiln.KilnError, match="still uses Graph"):
        bundle_mod._prune_forbidden(src, ast.parse(src), "kiln.x", False)
