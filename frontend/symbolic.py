"""Python ints that remember how they were computed from symbolic dims.

With a dynamic batch, ``x.size(0)`` cannot be a constant in the graph. The tracer hands the
model a :class:`SymInt`: an ``int`` (so eager PyTorch code runs unchanged, with the example's
value) that also carries the IR value computing it (``Gather(Shape(x), 0)``). Arithmetic with
other ints records IR ops, so ``x.view(x.size(0), -1)`` or ``x.shape[1] // heads`` stay
symbolic in the exported graph. Static dims stay plain ints.
"""
from __future__ import annotations

import operator
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


def is_symbolic(x: Any) -> bool:
    return isinstance(x, SymInt)
