"""pytest plugin: the op conformance suite (tests/ops) through the CUDA backend too.

Every op test calls ``op_harness.check_backends(graph, feeds, want)``; this plugin wraps it so
that each call also builds a CudaProgram of the same one-node graph, runs it and compares with
the reference outputs at the CPU runtime's tolerances (float32: 1e-5 relative). A mismatch fails
the test; each op's record (cases, cases that fell back to the host, failures) goes to the JSON
file named by ``KILN_CONFORMANCE_JSON``. Run on a GPU machine:

    python -m pytest tests/ops -p gpu_conformance   (with bench/ on PYTHONPATH)
"""
from __future__ import annotations

import json
import os

import numpy as np

RECORD: dict = {}


def pytest_configure(config):
    import op_harness
    from kiln.ir import dtype
    from kiln.runtime.cuda_program import CudaProgram

    original = op_harness.check_backends

    def check_backends(g, feeds, want):
        original(g, feeds, want)
        node = g.nodes[-1] if g.nodes else None
        op = node.qualified_op if node is not None else "?"
        rec = RECORD.setdefault(op, {"cases": 0, "fallback": 0, "failed": 0, "errors": []})
        rec["cases"] += 1
        try:
            p = CudaProgram(g.copy(), output="numpy", cuda_graphs=False)
            got = p.run(feeds, as_list=True)
            if p.fallback_ops:
                rec["fallback"] += 1
            for v, w, o in zip(g.outputs, want, got):
                assert o.dtype == w.dtype and o.shape == w.shape, f"cuda {v.name}: {o.dtype}{o.shape} vs {w.dtype}{w.shape}"
                if dtype(w.dtype).is_float:
                    tol = 1e-5 if w.dtype.itemsize >= 4 else 1e-2
                    np.testing.assert_allclose(o.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol / 10,
                                               equal_nan=True, err_msg=f"CUDA runtime disagrees on {v.name}")
                else:
                    np.testing.assert_array_equal(o, w, err_msg=f"CUDA runtime disagrees on {v.name}")
        except Exception as e:
            rec["failed"] += 1
            if len(rec["errors"]) < 3:
                rec["errors"].append(f"{type(e).__name__}: {str(e)[:300]}")
            raise

    op_harness.check_backends = check_backends


def pytest_unconfigure(config):
    path = os.environ.get("KILN_CONFORMANCE_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(RECORD, f, indent=1, sort_keys=True)
