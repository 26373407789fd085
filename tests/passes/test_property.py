"""Property: on random graphs, optimize(level=2) keeps the outputs, the signature and validity.

The graphs are random DAGs over float32 values whose shapes all broadcast into
(batch, 3, 4): elementwise binary and unary ops, MatMul with constant weights, Transpose
and Reshape pairs, Reshape to a Shape, constant subexpressions, neutral operations (x*1,
x+0, ...) that may or may not broadcast x bigger, duplicated subexpressions,
Identity/Dropout/Cast, and dead nodes (whatever no output reads).
"""
from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kiln.ir import Graph, Value, evaluate, verify
from kiln.ir.passes import infer_shapes, optimize

BINARY = ("Add", "Sub", "Mul", "Div", "Max")
UNARY = ("Relu", "Neg", "Abs", "Tanh", "Sigmoid")
CONST_SHAPES = ((), (4,), (3, 1), (1, 4), (3, 4), (1, 3, 1), (1, 1, 4))
NEUTRAL = (("Mul", 1.0, True), ("Add", 0.0, True), ("Sub", 0.0, False), ("Div", 1.0, False))


class RandomGraph:
    """Draws one step at a time into a graph; ``values`` are the non-constant values so far."""

    def __init__(self, data: st.DataObject, symbolic: bool):
        self.data = data
        self.g = Graph("random")
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
        lead = "batch" if symbolic else 2
        self.values: list[Value] = [self.g.add_input("x", "float32", (lead, 3, 4)),
                                    self.g.add_input("y", "float32", (3, 4))]
        self.emitted: list[tuple] = []

    def draw(self, strategy):
        return self.data.draw(strategy)

    def pick(self, pool):
        return pool[self.draw(st.integers(0, len(pool) - 1))]

    def const(self, shape=None, fill=None) -> Value:
        shape = self.pick(CONST_SHAPES) if shape is None else shape
        if fill is None:
            arr = self.rng.uniform(0.5, 2.0, shape) * self.rng.choice([-1.0, 1.0], shape)
        else:
            arr = np.full(shape, fill)
        return self.g.add_constant(arr.astype(np.float32), "c")

    def emit(self, op: str, *args, keep: bool = True, **attrs) -> Value:
        """Add a node; ``keep`` puts its output in the pool (only shapes of the family)."""
        self.emitted.append((op, args, attrs))
        out = self.g.op(op, *args, **attrs)
        if keep:
            self.values.append(out)
        return out

    # ---- the kinds of step
    def binary(self) -> None:
        a = self.pick(self.values)
        b = self.const() if self.draw(st.booleans()) else self.pick(self.values)
        if self.draw(st.booleans()):
            a, b = b, a
        self.emit(self.pick(BINARY), a, b)

    def unary(self) -> None:
        self.emit(self.pick(UNARY), self.pick(self.values))

    def constant_subexpression(self) -> None:
        folded = self.emit(self.pick(BINARY), self.const(), self.const())
        self.emit("Mul", self.pick(self.values), folded)

    def neutral(self) -> None:
        op, value, commutes = self.pick(NEUTRAL)
        x = self.pick(self.values)
        c = self.const(fill=value)
        self.emit(op, *((c, x) if commutes and self.draw(st.booleans()) else (x, c)))

    def matmul(self) -> None:
        candidates = [v for v in self.values if v.shape and v.shape[-1] == 4]
        w = self.g.add_constant((self.rng.normal(size=(4, 4)) * 0.5).astype(np.float32), "w")
        self.emit("MatMul", self.pick(candidates), w)

    def transpose_pair(self) -> None:
        x = self.pick([v for v in self.values if len(v.shape) >= 2])
        perms = list(itertools.permutations(range(len(x.shape))))
        first = self.pick(perms)
        second = tuple(int(i) for i in np.argsort(first)) if self.draw(st.booleans()) else self.pick(perms)
        t = self.emit("Transpose", self.emit("Transpose", x, perm=first, keep=False), perm=second, keep=False)
        self.reshape_to(t, x.shape)

    def reshape_pair(self) -> None:
        x = self.pick(self.values)
        flat = self.emit("Reshape", x, self.g.add_constant(np.array([-1], np.int64), "s"), keep=False)
        self.reshape_to(flat, x.shape)

    def reshape_by_shape(self) -> None:
        """Reshape(x, Shape(v)) for a v of x's shape: a no-op once the shape is known, which
        takes folding Shape (static) or symbolic shape inference (batch)."""
        x = self.pick(self.values)
        same = [v for v in self.values if v.shape == x.shape]
        self.emit("Reshape", x, self.emit("Shape", self.pick(same), keep=False))
        # Graph.op infers one node alone; the whole-graph pass follows Shape's values.
        infer_shapes(self.g)

    def reshape_to(self, v: Value, shape: tuple) -> None:
        # The batch dim (a symbol, or unknown after a flatten) is the one -1.
        dims = [d if isinstance(d, int) else -1 for d in shape]
        self.emit("Reshape", v, self.g.add_constant(np.array(dims, np.int64), "s"))

    def wrapper(self) -> None:
        x = self.pick(self.values)
        kind = self.draw(st.sampled_from(["Identity", "Dropout", "Cast"]))
        self.emit(kind, x, **({"to": 1} if kind == "Cast" else {}))

    def duplicate(self) -> None:
        op, args, attrs = self.pick(self.emitted)
        out = self.emit(op, *args, keep=False, **attrs)
        if out.shape in [v.shape for v in self.values]:
            self.values.append(out)

    STEPS = ("binary", "unary", "constant_subexpression", "neutral", "matmul", "transpose_pair",
             "reshape_pair", "reshape_by_shape", "wrapper", "duplicate")

    def build(self) -> Graph:
        for _ in range(self.draw(st.integers(1, 16))):
            step = self.draw(st.sampled_from(self.STEPS))
            if step == "duplicate" and not self.emitted:
                step = "unary"
            getattr(self, step)()
        count = self.draw(st.integers(1, 2))
        # The last value is always an output, so most graphs have a long live chain.
        outputs = [self.values[-1]] + [self.pick(self.values[:-1]) for _ in range(count - 1)]
        self.g.outputs = list(dict.fromkeys(outputs))
        return self.g


@given(st.data(), st.booleans())
def test_optimize_preserves_meaning(data, symbolic):
    g = RandomGraph(data, symbolic).build()
    verify(g)
    original = g.copy()
    optimize(g, level=2, verify_each=True)
    verify(g)
    assert [v.name for v in g.outputs] == [v.name for v in original.outputs]
    assert [(v.name, v.type) for v in g.inputs] == [(v.name, v.type) for v in original.inputs]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(2, 3, 4)).astype(np.float32), "y": rng.normal(size=(3, 4)).astype(np.float32)}
    # Divisions may overflow to inf and nan: the same on both sides, so compared, not warned.
    with np.errstate(all="ignore"):
        pairs = list(zip(evaluate(original, feeds), evaluate(g, feeds)))
    for want, got in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Nothing dead is left, no Dropout, and an Identity only where it keeps an output's name.
    outputs = {id(v) for v in g.outputs}
    assert all(any(v.uses or id(v) in outputs for v in n.outputs) for n in g.nodes)
    assert all(n.op != "Dropout" for n in g.nodes)
    assert all(id(n.outputs[0]) in outputs and not n.outputs[0].uses for n in g.nodes if n.op == "Identity")
    # A second run finds nothing to do: at once, by the mark the first one left, and when it does run every
    # pass (the mark removed), no pass changes anything.
    again = optimize(g, level=2)
    assert again.iterations == 0 and again.converged
    del g.metadata.props["kiln.optimized"]
    again = optimize(g, level=2)
    assert again.iterations == 1 and again.converged
    assert all(s.changed == 0 for name, s in again.passes.items() if name != "infer_shapes")
