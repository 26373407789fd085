"""Run-time checks that every backend shares: what a ``kiln.Guard`` compares, and the error a
failed one raises.

A guard stands where a traced model read a Python value out of tensor data (``bool(t)``,
``t.item()``, ``int(t)``, ``t.tolist()``, a size compared in Python ...). The trace recorded
the one path that value chose; the guard recomputes the value on every run and fails the run,
naming the source line and both values, when it differs. See kiln/ir/ops/guard.py for the op.

Only numpy and kiln.errors are imported: the CPU runtime (through the op's reference), the
CUDA runtime (for its message) and the mobile stub (whose bundle ships this file) use it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.errors import ExecutionError

# How the traced code read the tensor: ``bool(t)``; ``int(t)`` (truncates floats, as Python
# does); ``float(t)``; ``t.item()`` (the element in the tensor's dtype); the whole tensor
# (``t.tolist()``, ``t.numpy()``).
READS = ("bool", "int", "float", "item", "value")

# Float reads compare with this relative tolerance by default: backends sum in different orders,
# and a value the trace baked in that is off by a few float32 roundings changes nothing.
FLOAT_RTOL = 1e-5


class GuardFailed(ExecutionError):
    """A value a traced model read from tensor data differs from the value the trace recorded."""


def read_value(x: np.ndarray, read: str) -> Optional[np.ndarray]:
    """What ``read`` gives for ``x`` now, as a numpy array; None when a scalar read meets a
    tensor that does not hold exactly one element (eager PyTorch raises there)."""
    x = np.asarray(x)
    if read == "value":
        return x
    if x.size != 1:
        return None
    v = x.reshape(())
    if read == "bool":
        return np.array(bool(v))
    if read == "int":
        return np.array(int(v), np.int64)
    if read == "float":
        return np.array(float(v), np.float64)
    if read == "item":
        return v.copy()
    raise ValueError(f"unknown guard read {read!r} (one of {', '.join(READS)})")


def holds(now: np.ndarray, expected: np.ndarray, rtol: float) -> bool:
    """Same shape and values; floats within ``rtol`` (relative), NaN equal to NaN."""
    if now.shape != expected.shape:
        return False
    if now.dtype.kind in "fc" or expected.dtype.kind in "fc":
        a, b = now.astype(np.float64), expected.astype(np.float64)
        with np.errstate(invalid="ignore"):
            ok = (a == b) | (np.abs(a - b) <= rtol * np.maximum(np.abs(a), np.abs(b))) | (np.isnan(a) & np.isnan(b))
        return bool(np.all(ok))
    return bool(np.array_equal(now, expected))


def describe(a: Optional[np.ndarray], of: Optional[np.ndarray] = None) -> str:
    """A value for a message: a scalar as Python prints it, a tensor by shape and first values."""
    if a is None:
        return f"a tensor of {np.asarray(of).size} elements" if of is not None else "no value"
    a = np.asarray(a)
    if a.ndim == 0:
        return repr(a.item())
    flat = a.reshape(-1)
    head = ", ".join(repr(v) for v in flat[:6].tolist()) + (", ..." if flat.size > 6 else "")
    return f"a {a.dtype} tensor of shape {list(a.shape)} [{head}]"


def message(*, expected: np.ndarray, now: Optional[np.ndarray], x: Optional[np.ndarray], read: str, what: str,
            location: str, code: str, now_text: Optional[str] = None) -> str:
    """The error of a failed guard; ``now_text`` describes the value now where ``now`` is not
    at hand (the CUDA runtime reports the first differing element)."""
    where = location or "an unknown line"
    src = f" `{code}`" if code else ""
    now_text = now_text or describe(now, x)
    return (f"kiln.Guard failed at {where}{src}: {what} gave {describe(expected)} while the model was traced; "
            f"this input gives {now_text}. The exported graph holds "
            "only for inputs that give the same value there. Export with example inputs that represent what "
            "the model will see, mark the code around that line with @kiln.script so its if/while stays "
            "control flow, or give the input a value range for the export check "
            "(--input NAME:SHAPE:DTYPE:LOW:HIGH)")


def check(x: np.ndarray, *, expected: np.ndarray, read: str, rtol: float = 0.0, what: str = "a value",
          location: str = "", code: str = "") -> None:
    """Raise :class:`GuardFailed` unless ``read`` of ``x`` equals ``expected``."""
    now = read_value(x, read)
    if now is None or not holds(now, expected, rtol):
        raise GuardFailed(message(expected=expected, now=now, x=x, read=read, what=what, location=location,
                                  code=code))
