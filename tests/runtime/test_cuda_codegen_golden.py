"""The CUDA source the elementwise generator writes (runtime/kernels/cuda/codegen.py), checked without a GPU:
for a few representative fused bodies (float32 with a broadcast operand, float16 and bfloat16 vector paths, a
scalar operand, an integer power turned into products, two outputs) the generated kernel must equal its golden
file in tests/fixtures/cuda_golden/ (after the generator's shared prelude, PRELUDE.cu there). A change to the generator shows up here as a diff to review; after checking
it on the GPU (`pytest -m gpu` on the device runs the same bodies through NVRTC), rewrite the files with
``KILN_UPDATE_GOLDEN=1 pytest tests/runtime/test_cuda_codegen_golden.py``.

codegen.py imports numpy and the standard library only; it is loaded from its file, so that CuPy (which the
package ``kiln.runtime.kernels.cuda`` imports) is not needed."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from kiln.ir import Graph

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "cuda_golden"


def _codegen():
    spec = importlib.util.spec_from_file_location("_kiln_codegen_golden",
                                                  ROOT / "runtime" / "kernels" / "cuda" / "codegen.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


cg = _codegen()


def _body(dtype: str, build) -> "cg.Body":
    g = Graph("body")
    x = g.add_input("x", dtype, [4, 8])
    y = g.add_input("y", dtype, [4, 8])
    g.outputs = list(build(g, x, y))
    return cg.body_from_graph(g)


def _add_relu(g, x, y):
    return [g.op("Relu", g.op("Add", x, y))]


def _gelu_mul(g, x, y):
    return [g.op("Mul", g.op("Gelu", x), y)]


def _sigmoid_scaled(g, x, y):
    return [g.op("Mul", g.op("Sigmoid", x), y)]


def _cube_plus(g, x, y):
    three = g.add_constant(np.array(3.0, np.float32))
    return [g.op("Add", g.op("Pow", x, three), y)]


def _two_outputs(g, x, y):
    s = g.op("Sub", x, y)
    return [g.op("Abs", s), g.op("Where", g.op("Greater", x, y), x, y)]


F, S, D = cg.FLAT, cg.SCALAR, cg.STRIDED
CASES = {
    # name: (dtype, body builder, operand modes, collapsed ndim, index type, vector width)
    "add_relu_f32_flat_vec4": ("float32", _add_relu, (F, F), 1, "int", 4),
    "add_relu_f32_broadcast_strided": ("float32", _add_relu, (F, D), 2, "long long", 0),
    "gelu_mul_f16_vec8": ("float16", _gelu_mul, (F, F), 1, "int", 8),
    "sigmoid_scaled_bf16_scalar": ("bfloat16", _sigmoid_scaled, (F, S), 1, "int", 0),
    "cube_plus_f32_vec4": ("float32", _cube_plus, (F, F), 1, "int", 4),
    "two_outputs_f32_elementwise": ("float32", _two_outputs, (F, F), 1, "int", 0),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_kernel_equals_its_golden_file(name):
    dtype, build, modes, ndim, index, vec = CASES[name]
    source = cg.generate(_body(dtype, build), modes, ndim, index, vec)
    # Every kernel starts with the generator's shared prelude (helpers, conversions): kept once, in PRELUDE.
    prelude, path = GOLDEN / "PRELUDE.cu", GOLDEN / f"{name}.cu"
    if os.environ.get("KILN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        prelude.write_text(cg.PRELUDE + "\n")
        path.write_text(source[len(cg.PRELUDE) + 1:] + "\n")
    assert path.exists(), f"no golden file {path}: run with KILN_UPDATE_GOLDEN=1 once the kernel is checked on a GPU"
    assert source + "\n" == prelude.read_text() + path.read_text(), (
        f"the generated kernel for {name} changed; review the diff (and run it on the GPU), then rewrite the "
        "golden files with KILN_UPDATE_GOLDEN=1")


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_kernel_is_well_formed(name):
    """What holds for every kernel, whatever the golden text: one entry point with the operands the modes
    read and the outputs, balanced braces, every temporary defined before use, and no float32 math on 16-bit
    words (half and bfloat16 operands go through the conversions)."""
    dtype, build, modes, ndim, index, vec = CASES[name]
    body = _body(dtype, build)
    source = cg.generate(body, modes, ndim, index, vec)
    kernel = source[source.index('extern "C" __global__ void kiln_ew('):]
    assert kernel.count("{") == kernel.count("}")
    params = kernel[kernel.index("(") + 1:kernel.index(")")]
    assert [f"p{k}" in params for k in range(len(modes))] == [m != "-" for m in modes]
    assert all(f"q{j}" in params for j in range(len(body.outputs)))
    defined = set()
    for line in kernel.splitlines():
        m = re.match(r"\s*(?:const\s+)?\w+\s+(t\d+)\s*=", line)
        used = set(re.findall(r"\bt\d+\b", line))
        if m:
            used.discard(m.group(1))
        assert used <= defined, f"{name}: {sorted(used - defined)} used before definition in: {line.strip()}"
        if m:
            defined.add(m.group(1))
    to_float, from_float = {"float16": ("kiln_h2f(", "kiln_f2h("), "bfloat16": ("kiln_bf2f(", "kiln_f2bf(")}.get(
        dtype, (None, None))
    if to_float:  # 16-bit words are widened to float before any arithmetic and narrowed once when stored
        assert to_float in kernel and from_float in kernel
        for line in kernel.splitlines():
            if re.search(r"\bt\d+ = ", line):
                assert not re.search(r"\b[pvs]\d+(\[|\.v)", line.split("=", 1)[1]) or to_float in line, line
