"""Run-time checks: ``kiln.Guard`` (a value a traced model read from tensor data, rechecked on
every run: kiln/ir/ops/guard.py) and ``kiln.Assert`` (a scripted ``assert``). Neither has outputs;
a failed one stops the run with the message every kiln runtime gives (kiln/checks.py, which a
bundle ships with this module). Packing fixes every dim, so guards on sizes are decided at pack
time; those that remain read tensor data.
"""
from __future__ import annotations

import numpy as np

from kiln import checks
from kiln.errors import ExecutionError

_ALL = {"float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "bool"}


class AssertionFailed(ExecutionError, AssertionError):
    """A scripted assert failed (what kiln.ir.ops.assertion.AssertionFailed is, without kiln.ir)."""


def guard(ins, outs, attrs):
    checks.check(ins[0], expected=np.asarray(attrs["expected"]), read=attrs.get("read", "value"),
                 rtol=float(attrs.get("rtol", 0.0)), what=attrs.get("what", "a value"),
                 location=attrs.get("location", ""), code=attrs.get("code", ""))


def assert_(ins, outs, attrs):
    if not np.all(ins[0]):
        text = attrs.get("message") or "assertion failed"
        where = attrs.get("location")
        raise AssertionFailed(f"{text} (kiln.Assert at {where})" if where else text)


KERNELS = {"kiln.Guard": guard, "kiln.Assert": assert_}
SUPPORTS = {"kiln.Guard": _ALL, "kiln.Assert": {"bool"}}
