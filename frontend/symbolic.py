"""Python ints that remember how they were computed from symbolic dims.

With a dynamic batch, ``x.size(0)`` cannot be a constant in the graph. The tracer hands the
model a :class:`SymInt`: an ``int`` (so eager PyTorch code runs unchanged, with the example's
value) that also carries the IR value computing it (``Gather(Shape(x), 0)``). Arithmetic with
other ints records IR ops, so ``x.view(x.size(0), -1)`` or ``x.shape[1] // heads`` stay
symbolic in the exported graph. Static dims stay plain ints.

Comparisons (``<``, ``<=``, ``>``, ``>=``, ``==``, ``!=``) give plain bools, as for any int, and
the answer is baked into the trace: so, unless guards are off, each comparison the model (or
torch's Python code it calls, or a builtin such as ``max(n, 8)``) makes leaves a ``kiln.Guard``
that recomputes it from the graph's sizes and refuses an input that answers otherwise
(``Tracer.compared_size``). Comparisons in kiln's own mappings are kiln's business, not the
model's, and give no guard. The exception is code that ``kiln.script`` rewrote. There ``if
x.size(1) > 4:`` or ``while ids.size(1) < max_len:`` is control flow on a size only known at run
time, so the comparison returns a traced 0-d bool tensor (as
:class:`~kiln.frontend.script_ops.TracedInt`'s do) and the rewritten statement becomes an
``If``/``Loop``. The test is deliberately narrow: the calling frame runs rewritten code (its
globals hold kiln.script's namespace) *and* is executing a comparison operator.
"""
from __future__ import annotations

import dis
import operator
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kiln.frontend.tracer import Tracer
    from kiln.ir.graph import Value


class SymInt(int):
    """An int whose value depends on the inputs' symbolic dims; ``value`` is its int64 scalar."""

    tracer: "Tracer"
    value: "Value"

    def __new__(cls, concrete: int, tracer: "Tracer", value: "Value") -> "SymInt":
        self = super().__new__(cls, concrete)
        self.tracer = tracer
        self.value = value
        return self

    def __repr__(self) -> str:
        return f"SymInt({int(self)}, %{self.value.name})"


def _binary(op: str, fn: Callable[[int, int], int], reflected: bool = False) -> Callable:
    def method(self: SymInt, other: Any) -> Any:
        if not isinstance(other, (int, float)):
            # A tensor: int(self) would bake the size in; its reflected op (Tensor.__rsub__) keeps it.
            return NotImplemented
        if isinstance(other, bool) or not isinstance(other, int):
            return fn(int(other), int(self)) if reflected else fn(int(self), other)
        result = fn(int(other), int(self)) if reflected else fn(int(self), int(other))
        t = self.tracer
        a, b = t.int_value(self), t.int_value(other)
        return SymInt(result, t, t.emit(op, b, a) if reflected else t.emit(op, a, b))

    return method


def _floordiv(a: int, b: int) -> int:
    return a // b


for _name, _op, _fn in (("add", "Add", operator.add), ("sub", "Sub", operator.sub), ("mul", "Mul", operator.mul),
                        ("floordiv", "Div", _floordiv)):
    setattr(SymInt, f"__{_name}__", _binary(_op, _fn))
    setattr(SymInt, f"__r{_name}__", _binary(_op, _fn, reflected=True))


def _neg(self: SymInt) -> SymInt:
    # int.__neg__ would return a plain int: x[:, -n:] with a symbolic n would become a constant.
    return SymInt(-int(self), self.tracer, self.tracer.emit("Neg", self.value))


SymInt.__neg__ = _neg


# kiln.script's rewritten code runs with this key in its globals (frontend/script.py's _NS).
_SCRIPT_NAMESPACE = "__kiln__"
_COMPARE_OP = dis.opmap["COMPARE_OP"]


def _in_scripted_comparison(frame: Any) -> bool:
    """Whether ``frame`` is rewritten (scripted) code evaluating a comparison operator."""
    return (frame is not None and _SCRIPT_NAMESPACE in frame.f_globals
            and frame.f_code.co_code[frame.f_lasti] == _COMPARE_OP)


def _compare(name: str) -> Callable:
    def method(self: SymInt, other: Any) -> Any:
        caller = sys._getframe(1)
        if _in_scripted_comparison(caller):
            # Import here: script_ops imports the tracer, which imports this module.
            from kiln.frontend.script_ops import TracedInt
            return getattr(TracedInt, f"__{name}__")(self, other)
        result = getattr(int, f"__{name}__")(self, other)
        if result is not NotImplemented and isinstance(other, (int, float)) and not isinstance(other, bool):
            self.tracer.compared_size(self, other, name, result, caller)  # the answer is baked: guard it
        return result

    method.__name__ = f"__{name}__"
    return method



for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    setattr(SymInt, f"__{_name}__", _compare(_name))
# Defining __eq__ must not make SymInts unhashable (they key dicts of sizes).
SymInt.__hash__ = int.__hash__
