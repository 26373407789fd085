"""``kiln.Assert``: a run-time check, what ``assert <tensor condition>, "message"`` in scripted code becomes.

Why an op at all: a traced model's ``assert`` on tensor data is only checked on the example, so
a graph run on an input that breaks the model's precondition silently computes garbage. The
Assert node makes the graph check it every run, where the model's author put it.

Why no outputs (rather than an identity that threads a value through): nothing has to be
rewired to keep the check, and no later op waits on it. It is the IR's one op with a side effect,
which the passes know: dead-code elimination keeps it (and any If/Loop whose body holds one;
it is registered with ``side_effect=True``), and such ops are not foldable, so constant folding
and CSE leave it alone; the fusion pass only groups default-domain elementwise ops. The runtime
runs a plan's nodes in graph order, so the check happens where it was traced, after what
computes its condition; other nodes of the run may have run before it, and a failure stops the
run.

Semantics: ``cond`` is a bool tensor of any shape (a 0-d one from a comparison, typically);
the check passes when every element is true (an empty ``cond`` passes, like ``np.all``).
Otherwise the run fails with :class:`AssertionFailed`, both a :class:`kiln.ExecutionError` (what
any failed run raises) and an ``AssertionError`` (what the eager model raises), whose message is
``message`` followed by ``location`` (the scripted model's ``file:line`` and the ``assert``
statement's source, recorded when scripting: it names the check in a saved model too, where the
Python source may be gone).

ONNX has no assertion op (and no way to fail a run on purpose), so the ONNX exporter drops
Assert nodes with a logged warning naming each one (serializer/onnx.py).
"""
from __future__ import annotations

import numpy as np

from kiln.errors import ExecutionError
from kiln.ir.ops._common import BOOL
from kiln.ir.registry import KILN_DOMAIN, Attr, AttrKind, In, InferContext, op

ASSERT_OP = "Assert"


class AssertionFailed(ExecutionError, AssertionError):
    """An Assert node's condition was not all true while running a graph."""


def _infer_assert(ctx: InferContext) -> list:
    ctx.input(0)  # a typed condition (its dtype is checked against the schema by the verifier)
    return []


@op(ASSERT_OP, domain=KILN_DOMAIN, inputs=[In("cond", BOOL)], outputs=[],
    attrs=[Attr("message", AttrKind.STRING, ""), Attr("location", AttrKind.STRING, "")],
    infer=_infer_assert, side_effect=True)
def assert_(cond: np.ndarray, *, message: str = "", location: str = "") -> tuple:
    """Fail the run unless every element of ``cond`` is true; no outputs."""
    if not np.all(cond):
        text = message or "assertion failed"
        raise AssertionFailed(f"{text} (kiln.Assert at {location})" if location else text)
    return ()
