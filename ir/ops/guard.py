"""``kiln.Guard``: the check a trace leaves where the model read a Python value from tensor data.

``if mask.all(): ...``, ``n = int(t)``, ``t.tolist()``, ``if x.size(0) > 1`` with a symbolic size:
a trace runs the Python on the example's value and records only the path it chose, so the graph
is right only for inputs that give the same value there. torch.jit.trace bakes such values in
silently; torch.export refuses them. kiln keeps the model and makes the graph check the
assumption: the Guard recomputes the read on every run (its input is the tensor the model read,
computed by the graph) and fails the run with :class:`kiln.checks.GuardFailed` (an
``ExecutionError``) naming the source line, the value at export and the value now.

Attributes: ``expected`` (the value the trace saw, as a tensor), ``read`` (how the model read
it: one of ``kiln.checks.READS``), ``rtol`` (relative tolerance of float reads, 0 for exact),
``what`` (the Python construct, e.g. ``bool(tensor)``), ``location`` (``file:line in scope``) and
``code`` (the source line), so a saved file names its checks without the model's source.

Like ``kiln.Assert`` it has no outputs and a side effect: dead-code elimination keeps it,
folding and CSE leave it alone (``side_effect=True``), and the runtime runs it in graph order.
A guard whose input is a constant is decided at export (``ir.passes.simplify``: it holds, since
the trace computed that constant, and goes). The ONNX exporter drops guards with a warning:
ONNX has no op that fails a run.
"""
from __future__ import annotations

import numpy as np

from kiln import checks
from kiln.ir.registry import KILN_DOMAIN, Attr, AttrKind, In, InferContext, op

GUARD_OP = "Guard"


def _infer_guard(ctx: InferContext) -> list:
    ctx.input(0)
    if ctx.attrs["read"] not in checks.READS:
        ctx.fail(f"read must be one of {', '.join(checks.READS)}, not {ctx.attrs['read']!r}")
    return []


@op(GUARD_OP, domain=KILN_DOMAIN, inputs=[In("X")], outputs=[],
    attrs=[Attr("expected", AttrKind.TENSOR), Attr("read", AttrKind.STRING, "value"),
           Attr("rtol", AttrKind.FLOAT, 0.0), Attr("what", AttrKind.STRING, "a value"),
           Attr("location", AttrKind.STRING, ""), Attr("code", AttrKind.STRING, "")],
    infer=_infer_guard, side_effect=True)
def guard(x: np.ndarray, *, expected: np.ndarray, read: str = "value", rtol: float = 0.0, what: str = "a value",
          location: str = "", code: str = "") -> tuple:
    """Fail the run unless ``read`` of ``x`` equals ``expected``; no outputs."""
    checks.check(x, expected=np.asarray(expected), read=read, rtol=rtol, what=what, location=location, code=code)
    return ()
