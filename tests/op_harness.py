"""Test helper for ops: build a one-node graph, infer its types, evaluate its reference
implementation, and compare with an independent oracle.

``check_op`` also checks that inference and reference agree (dtype and shape of every
output), and, with ``symbolic_batch=True``, that the first dim of the inputs can be the
symbol ``batch`` and inference keeps it.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np

from kiln.errors import KilnError
from kiln.ir import DType, Graph, dtype, evaluate, verify
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.runtime import Program


def build_single(op: str, inputs: Sequence[Optional[np.ndarray]], attrs: Optional[dict] = None, *,
                 const_inputs: Sequence[int] = (), num_outputs: Optional[int] = None,
                 symbolic_batch: bool = False, domain: str = "") -> tuple[Graph, list[np.ndarray]]:
    """A graph with one node; inputs listed in ``const_inputs`` become initializers."""
    g = Graph("test")
    values = []
    feeds = []
    lead = next((np.asarray(a) for i, a in enumerate(inputs) if a is not None and i not in const_inputs), None)
    for i, a in enumerate(inputs):
        if a is None:
            values.append(None)
        elif i in const_inputs:
            values.append(g.add_initializer(f"c{i}", np.asarray(a)))
        else:
            a = np.asarray(a)
            shape = list(a.shape)
            # The leading dim becomes the symbol "batch" on every input that shares the first
            # input's rank and leading size.
            if symbolic_batch and shape and a.ndim == lead.ndim and a.shape[0] == lead.shape[0]:
                shape[0] = "batch"
            values.append(g.add_input(f"x{i}", a.dtype, shape))
            feeds.append(a)
    node = g.add_node(op, values, attrs or {}, num_outputs=num_outputs, domain=domain)
    g.outputs = list(node.outputs)
    infer_shapes(g)
    verify(g)
    return g, feeds


@functools.lru_cache(maxsize=1)
def _gpu_present() -> bool:
    from kiln.runtime.program import cuda_usable
    return cuda_usable()


def _run_cuda(g: Graph, feeds: list) -> list:
    import kiln
    prog = kiln.load(g.copy(), device="cuda", output="numpy", tf32=False)  # fp32 GEMMs in fp32, as the reference
    return prog.run(feeds, as_list=True)


def _run_ort(g: Graph, feeds: list) -> Optional[list]:
    """Opt-in (``KILN_OPS_ORT=1 pytest tests/ops``): the graph in ONNX Runtime through kiln's ONNX export, an
    audit of the export op by op rather than a CI gate, since ORT itself departs from the ONNX reference in
    places (docs/NOTES.md lists what a run found). None where the backend does not claim the graph: an op
    kiln's export does not write, one ORT has no kernel for at this dtype, or bfloat16 at the interface (ORT's
    Python binding takes no bfloat16)."""
    import os
    if os.environ.get("KILN_OPS_ORT") != "1" or any(v.dtype is DType.BFLOAT16 for v in [*g.inputs, *g.outputs]):
        return None
    import kiln
    try:
        prog = kiln.load(g.copy(), backend="onnxruntime")
    except kiln.UnsupportedOpError:
        return None
    except kiln.KilnError as e:
        if "NOT_IMPLEMENTED" in str(e):  # ORT has no kernel for this op and dtype (an invalid model still fails)
            return None
        raise
    return prog.run(feeds, as_list=True)


def _run_mobile(g: Graph, feeds: list) -> Optional[list]:
    """The mobile stub on the graph packed for these feeds' shapes (kiln mobile pack), where the stub's op set
    has every node's op and dtype; None where it does not claim the graph."""
    import tempfile

    from kiln.mobile_stub import check as mcheck
    from kiln.mobile_stub import pack as mpack
    from kiln.mobile_stub import runtime as mrt
    from kiln.serializer import save
    dims = {}
    for v, f in zip(g.inputs, feeds):
        for d, n in zip(v.type.shape or (), np.shape(f)):
            if isinstance(d, str):
                dims[d] = int(n)
    try:
        packed = mpack.pack(g, dims=dims)
    except KilnError:  # a graph the packer does not take (no static shapes, say): not claimed
        return None
    if mcheck.check_graph(packed):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = save(packed, f"{d}/m.kiln")
        return [np.asarray(o) for o in mrt.load(str(path)).run(*feeds)]


def check_backends(g: Graph, feeds: list, want: list) -> None:
    """The conformance suite: every backend's kernels must agree with the reference outputs: the CPU runtime
    always, the CUDA runtime too where a GPU is present (``pytest tests/ops`` on the GPU machine), the mobile
    stub where it claims the graph, and ONNX Runtime when asked (KILN_OPS_ORT=1). Every op
    test in tests/ops/ runs through it. Kernels may differ from the reference by float rounding only (a fused
    or BLAS-ordered sum; on the GPU also the fused multiply-adds and math intrinsics), never in dtype or shape."""
    backends = [("CPU runtime", lambda: Program(g).run(feeds, as_list=True), 1e-5)]
    # The GPU takes bfloat16 inside a model only (CuPy has no bfloat16 arrays; a bf16 input or output is
    # refused at load with the way out, tested in tests/runtime/test_cuda_half.py): such graphs are CPU-only here.
    bf16_io = any(v.dtype is DType.BFLOAT16 for v in [*g.inputs, *g.outputs])
    # float8/int4...: the GPU runtime refuses them at load by design (tests/runtime/test_cuda_storage_types.py).
    storage = any(v.type is not None and v.type.dtype.is_storage
                  for sub in g.all_graphs() for v in sub.values())
    if _gpu_present() and not bf16_io and not storage:
        backends.append(("CUDA runtime", lambda: _run_cuda(g, feeds), 1e-4))
    backends.append(("mobile stub", lambda: _run_mobile(g, feeds), 1e-4))
    backends.append(("onnxruntime backend", lambda: _run_ort(g, feeds), 1e-5))
    for label, run, tol32 in backends:
        got = run()
        if got is None:
            continue
        for v, w, o in zip(g.outputs, want, got):
            o = np.asarray(o)
            assert o.dtype == w.dtype and o.shape == w.shape, \
                f"{label} {v.name}: {o.dtype}{o.shape} vs {w.dtype}{w.shape}"
            if dtype(w.dtype).is_float:
                tol = tol32 if w.dtype.itemsize >= 4 else 1e-2  # half types: one rounding of 2**-8 .. 2**-11
                # A reordered sum is off by rounding of its terms, not of its result: an element that
                # cancels to ~0 keeps the absolute error of the large terms, so the absolute floor
                # scales with the output's magnitude (OpenBLAS on AMD EPYC put a conv element of
                # 0.0011 1.03e-6 off, past a fixed 1e-6).
                finite = np.abs(w[np.isfinite(w)]).astype(np.float64)
                scale = max(1.0, float(finite.max())) if finite.size else 1.0
                np.testing.assert_allclose(o.astype(np.float64), w.astype(np.float64), rtol=tol,
                                           atol=tol / 10 * scale, equal_nan=True,
                                           err_msg=f"{label} disagrees on {v.name}")
            elif dtype(w.dtype).is_storage:  # float8/int4...: conversions are exact, so the same bits (NaN too)
                np.testing.assert_array_equal(o.view(np.uint8), w.view(np.uint8),
                                              err_msg=f"{label} disagrees on {v.name}")
            else:
                np.testing.assert_array_equal(o, w, err_msg=f"{label} disagrees on {v.name}")


def check_op(op: str, inputs: Sequence[Optional[np.ndarray]], expected: Any = None, attrs: Optional[dict] = None,
             *, const_inputs: Sequence[int] = (), num_outputs: Optional[int] = None, rtol: float = 1e-5,
             atol: float = 1e-6, symbolic_batch: bool = False, domain: str = "") -> list[np.ndarray]:
    """Run ``op`` on ``inputs``; check inference/reference agreement and, if given, the expected outputs."""
    g, feeds = build_single(op, inputs, attrs, const_inputs=const_inputs, num_outputs=num_outputs,
                            symbolic_batch=symbolic_batch, domain=domain)
    outs = evaluate(g, feeds)
    check_backends(g, feeds, outs)
    for v, o in zip(g.outputs, outs):
        assert v.type is not None, f"{op}: output {v.name} has no inferred type"
        assert o.dtype == v.type.dtype.numpy, f"{op}: reference gives {o.dtype}, inference says {v.type.dtype}"
        assert v.type.shape is not None and len(v.type.shape) == o.ndim, \
            f"{op}: reference gives shape {o.shape}, inference says {v.type}"
        for want, got in zip(v.type.shape, o.shape):
            assert want is None or isinstance(want, str) or want == got, \
                f"{op}: reference gives shape {o.shape}, inference says {v.type}"
    if expected is not None:
        exp = list(expected) if isinstance(expected, (list, tuple)) else [expected]
        assert len(exp) == len(outs)
        for o, e in zip(outs, exp):
            e = np.asarray(e)
            assert o.shape == e.shape, f"{op}: shape {o.shape} != expected {e.shape}"
            if dtype(o.dtype).is_float:  # bfloat16 (ml_dtypes) is not numpy kind 'f'
                np.testing.assert_allclose(o.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)
            else:
                np.testing.assert_array_equal(o, e)
    return outs


def i64(*v: int) -> np.ndarray:
    """An int64 vector: shapes, axes, starts/ends given as op inputs."""
    return np.array(v, dtype=np.int64)


def inferred(op: str, inputs: Sequence[Optional[np.ndarray]], attrs: Optional[dict] = None, **kw: Any) -> list:
    """The inferred output shapes of a one-node graph (symbolic batch on by default)."""
    kw.setdefault("symbolic_batch", True)
    g, _ = build_single(op, inputs, attrs, **kw)
    return [v.type.shape for v in g.outputs]


def onnx_reference(op: str, inputs: Sequence[Optional[np.ndarray]], attrs: dict, opset: int = 18) -> np.ndarray:
    """The output of ONNX's reference evaluator (onnx.reference) on a one-node ``op`` model at ``opset`` (None
    inputs are omitted optional inputs); skips the test where onnx is not installed."""
    import pytest
    onnx = pytest.importorskip("onnx")
    from onnx import helper
    from onnx.reference import ReferenceEvaluator
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node(op, names, ["y"], **attrs)
    given = [(n, a) for n, a in zip(names, inputs) if n]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype),
                                                                          a.shape) for n, a in given],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.UNDEFINED, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, dict(given))[0]
