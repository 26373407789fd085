"""Batch independence: may a server stack requests along the batch dim and split the answers?

Stacking requests along dim 0 and splitting the outputs back is only right when output row *i*
depends on input row *i* alone, with the same function whatever the number of rows. A model
``y = x - x.mean(axis=0)`` breaks it: stacked, every request's answer mixes in the others' rows.
:func:`analyze_batching` proves the property from the graph, op by op, or says which node breaks
it and where it came from (op, node name, module path, source line).

Each value gets one state (a small lattice, evaluated in graph order, subgraphs included):

- ``CONST``: the same for every request and every batch size: weights, and values computed from
  them and from non-batch dims (``seq``, ``x.size(-1)``);
- ``Size(mask)``: depends on the batch *size* N but not on row data: ``Shape(x)``,
  ``Shape(x)[0] * 4``. ``mask`` tells, for a value of rank <= 1, which elements depend on N, so
  ``Shape(x)[1]`` is CONST again. Such values may shape a tensor (``Reshape(x, [N, -1])``, checked
  by the op's rule) but never enter arithmetic with row data: ``x / x.shape[0]`` is dependent;
- ``Rows(axis, outer, inner)``: carries the batch at ``axis`` (its dim is outer x N x inner, the
  batch index in the middle), and slice *i* along it depends only on row *i* of the inputs. Outer
  and inner factors come from reshapes that fold the batch with another dim in row-major order
  (``nn.MultiheadAttention``'s ``[seq, N * heads, hd]`` and ``[seq * N, E]``), which keep each
  request's rows apart as long as nothing slices, reduces or mixes along that axis;
- ``Index(axis, stride)``: positions in the stacked batch (``arange(N)``, and the flat indices
  ``arange(N)[:, None] * seq + arange(seq)`` that ``mask[batch_idx, kv_idx]`` is lowered to): only
  a Gather that stays inside each row's own block of its data turns it back into rows;
- ``Mixed(reason)``: anything else, with the first node that made it so.

Rules are a table keyed by op (``RULES``); **an op without a rule is dependent**, as is every
shape the rules cannot read (an unknown rank, a non-literal axis). The model is batchable when
every graph input and output has the same symbol as dim 0 (and nowhere else), every output is
``Rows(0)`` and no side-effect check reads a value that mixes rows or depends on N: a
``kiln.Guard`` must read a constant (a comparison of N that no batch size changes counts as one),
since a guard on the batch could pass stacked and refuse alone; a ``kiln.Assert`` may read rows
(``np.all`` of row-wise conditions passes stacked iff it passes for each row, and a failed batch
is re-run request by request). If/Loop bodies and the bodies of fused kiln ops are analysed with the
values they read; If branches must agree, a Loop's carried states must reach a fixed point.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import numpy as np

from kiln.ir.graph import Graph, Node, Value
from kiln.ir.ops._dims import END_OF_AXIS
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN

__all__ = ["BatchAnalysis", "analyze_batching", "batch_symbol", "RULES"]

# ---------------------------------------------------------------------------------------- states

# A product of non-batch dims, canonical: (int coefficient, sorted ((symbol, power), ...)).
Prod = tuple
ONE: Prod = (1, ())


class _Const:
    def __repr__(self) -> str:
        return "CONST"


CONST = _Const()


@dataclass(frozen=True)
class Size:
    """Depends on the batch size N; ``mask[j]``: element j of this rank <= 1 value does (None:
    all, or unknown)."""

    mask: Optional[tuple] = None


@dataclass(frozen=True)
class Rows:
    """The batch lies along ``axis`` (dim = outer x N x inner); slice i depends only on row i."""

    axis: int
    outer: Prod = ONE
    inner: Prod = ONE

    @property
    def plain(self) -> bool:
        return self.outer == ONE and self.inner == ONE

    def at(self, axis: int) -> "Rows":
        return Rows(axis, self.outer, self.inner)


@dataclass(frozen=True)
class Index:
    """An int tensor of positions in the stacked batch: along ``axis`` (N long), the element at batch
    position i is i x ``stride`` + r with 0 <= r < stride (r = 0 when ``exact``). ``arange(N)`` and
    the flat indices ``arange(N)[:, None] * seq + arange(seq)`` that advanced indexing
    (``mask[batch_idx, kv_idx]``) is lowered to. Not row data: only a Gather that picks, for row i,
    inside row i's block of its data keeps rows apart; anything else it meets is dependent."""

    axis: int
    stride: Prod = ONE
    exact: bool = True

    def at(self, axis: int) -> "Index":
        return Index(axis, self.stride, self.exact)


@dataclass(frozen=True)
class Mixed:
    """Rows are mixed (or N is used as a value): ``reason`` names the node that did it."""

    reason: str
    node: Optional[Node] = None


State = Union[_Const, Size, Rows, Index, Mixed]

# Ops that may read an Index (see Index); any other op reading one is dependent.
_INDEX_OPS = frozenset({"Unsqueeze", "Squeeze", "Identity", "Cast", "Mul", "Add", "Where", "Gather"})


def _size(mask: Optional[Sequence[bool]]) -> State:
    """A Size state, CONST when no element depends on N."""
    if mask is not None and not any(mask):
        return CONST
    return Size(None if mask is None else tuple(bool(m) for m in mask))


class Dependent(Exception):
    """Raised by a rule: the op mixes rows (or uses N as a value); the message says how."""


# ---------------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class BatchAnalysis:
    """The verdict: ``batchable``, the batch ``symbol``, and a one-line ``reason``. When not
    batchable because of a node, ``op``, ``node``, ``scope`` (module path) and ``source`` name it."""

    batchable: bool
    symbol: Optional[str]
    reason: str
    op: Optional[str] = None
    node: Optional[str] = None
    scope: Optional[str] = None
    source: Optional[str] = None

    def to_json(self) -> dict:
        return {"batchable": self.batchable, "symbol": self.symbol, "reason": self.reason, "op": self.op,
                "node": self.node, "module": self.scope, "source": self.source}


def batch_symbol(graph: Graph) -> tuple[Optional[str], str]:
    """The symbol that is dim 0 of every graph input and output and appears in no other of their
    dims, or (None, why not)."""
    symbol = None
    if not graph.inputs:
        return None, "the model has no inputs"
    for kind, values in (("input", graph.inputs), ("output", graph.outputs)):
        for v in values:
            shape = v.shape
            if not shape or not isinstance(shape[0], str):
                dim = "unknown rank" if shape is None else ("a scalar" if not shape else f"dim 0 {shape[0]!r}")
                return None, f"{kind} '{v.name}' has no symbolic dim 0 ({dim}), so requests cannot be stacked"
            if shape[0] in shape[1:]:
                return None, f"{kind} '{v.name}' has the symbol '{shape[0]}' in more than one dim {list(shape)}"
            if symbol is None:
                symbol = shape[0]
            elif shape[0] != symbol:
                return None, f"{kind} '{v.name}' has dim 0 '{shape[0]}', not '{symbol}' like the others"
    return symbol, ""


def analyze_batching(graph: Graph) -> BatchAnalysis:
    """Whether stacking requests along the batch dim of ``graph`` and splitting the outputs gives each
    request exactly its own answer (see the module docstring). Never raises for a well-formed graph:
    anything it cannot prove is reported as not batchable, with the reason."""
    symbol, why = batch_symbol(graph)
    if symbol is None:
        return BatchAnalysis(False, None, why)
    an = _Analysis(symbol)
    for v in graph.inputs:
        an.states[v] = Rows(0)
    an.run(graph)
    for v in graph.outputs:
        s = an.state(v)
        if s != Rows(0):
            return _verdict(symbol, s, f"output '{v.name}'")
    for node, s in an.checks:
        return _verdict(symbol, s, f"the check {node.describe()}")
    n = sum(1 for _ in graph.walk())
    return BatchAnalysis(True, symbol, f"every output row depends only on its own input row along '{symbol}' "
                                       f"({n} nodes checked)")


def _verdict(symbol: str, s: State, what: str) -> BatchAnalysis:
    if isinstance(s, Mixed):
        node = s.node
        reason = s.reason
        if node is not None:
            return BatchAnalysis(False, symbol, f"{node.describe()}: {reason}", node.qualified_op, node.name,
                                 node.meta.get("scope") or None, node.meta.get("source") or None)
        return BatchAnalysis(False, symbol, f"{what}: {reason}")
    if isinstance(s, Size):
        return BatchAnalysis(False, symbol, f"{what} depends on the batch size '{symbol}', not only on its own rows")
    if s is CONST:
        return BatchAnalysis(False, symbol, f"{what} does not depend on the batch rows")
    return BatchAnalysis(False, symbol, f"{what} carries the batch at axis {s.axis}"
                                        f"{'' if s.plain else ' folded with other dims'}, not as dim 0")


# ---------------------------------------------------------------------------------------- the walk


class _Analysis:
    def __init__(self, symbol: str):
        self.symbol = symbol
        self.states: dict[Value, State] = {}
        self.checks: list[tuple[Node, State]] = []  # side-effect nodes reading something not allowed
        # Symbolic values of small int vectors (shapes and what is computed from them), each
        # element a Prod with N included, None where unknown: what Reshape targets are made of.
        self.values: dict[Value, list] = {}
        # Dims as Prods (N included) where a value's type lost them: kiln's shape inference keeps a
        # product like N x 4 as an unknown dim, and attention layers reshape through such dims.
        self.dims: dict[Value, list] = {}
        # Exclusive upper bounds (as Prods) of CONST int values known to lie in [0, bound):
        # arange(seq) and what keeps its values; what makes seq-major flat indices provably in range.
        self.bounds: dict[Value, Prod] = {}

    def state(self, v: Optional[Value]) -> State:
        if v is None:
            return CONST
        s = self.states.get(v)
        if s is None:
            if v.is_initializer:
                return CONST
            return Mixed(f"value '{v.name}' is read before it is defined")
        return s

    def run(self, graph: Graph) -> None:
        for v in graph.initializers.values():
            self.states[v] = CONST
        for node in graph.nodes:
            outs = self.node(node)
            for v, s in zip(node.outputs, outs):
                self.states[v] = self._checked(node, v, s)
            if node.outputs:
                self._propagate_dims(node)
                self._record_bounds(node)
            if len(node.outputs) == 1 and node.domain == ONNX_DOMAIN:
                vals = self._shape_values(node)
                if vals is not None:
                    self.values[node.outputs[0]] = vals

    def node(self, node: Node) -> list:
        ins = [self.state(v) for v in node.inputs]
        mixed = next((s for s in ins if isinstance(s, Mixed)), None)
        n_out = len(node.outputs)
        if node.schema.side_effect:
            return self._check_node(node, ins)
        wrapped = _negative_wrap(node)
        if wrapped is not None and (isinstance(self.state(wrapped), Index) or wrapped in self.bounds):
            return [self.state(wrapped)]  # values >= 0: Where(x < 0, x + n, x) is x
        if mixed is not None:
            return [mixed] * n_out
        has_body = any(True for _ in node.subgraphs())
        if not has_body and all(s is CONST for s in ins):
            return [CONST] * n_out
        if any(isinstance(s, Index) for s in ins) and not (node.domain == ONNX_DOMAIN and node.op in _INDEX_OPS):
            return [Mixed("it uses positions in the stacked batch (an arange over the batch size) as values",
                          node)] * n_out
        rule = RULES.get((node.domain, node.op))
        if rule is None:
            return [Mixed(f"op {node.qualified_op} has no batch-independence rule (unknown means dependent)",
                          node)] * n_out
        try:
            outs = rule(_Ctx(self, node, ins))
        except Dependent as e:
            return [Mixed(str(e), node)] * n_out
        if len(outs) != n_out:
            outs = list(outs) + [Mixed(f"output {i} has no batch rule", node) for i in range(len(outs), n_out)]
        return list(outs)

    def _check_node(self, node: Node, ins: list) -> list:
        """kiln.Assert passes on a stacked batch iff it passes on every row (np.all of row-wise
        conditions) and a failure re-runs each request alone; a Guard compares a read against the
        traced value, so any read of the batch (its rows or its size) could pass stacked and fail
        alone."""
        for s in ins:
            ok = s is CONST or (isinstance(s, Rows) and node.op == "Assert" and node.domain == KILN_DOMAIN)
            if not ok:
                bad = s if isinstance(s, Mixed) else Mixed(
                    "checks a value read from the batch (its rows or its size): stacked requests could pass "
                    "a check that one alone fails", node)
                self.checks.append((node, bad))
                break
        return []

    def _checked(self, node: Node, v: Value, s: State) -> State:
        """Rows must agree with the value's type: the batch symbol at the axis (if unfolded) and
        nowhere else."""
        if not isinstance(s, Rows):
            return s
        shape = v.shape
        if shape is None:
            return Mixed(f"output '{v.name}' has an unknown shape, so the batch axis cannot be followed", node)
        if not 0 <= s.axis < len(shape):
            return Mixed(f"output '{v.name}' of rank {len(shape)} has no axis {s.axis} for the batch", node)
        for i, d in enumerate(shape):
            if d == self.symbol and i != s.axis:
                return Mixed(f"output '{v.name}' {list(shape)} has the batch dim '{self.symbol}' at axis {i}, "
                             f"not only at axis {s.axis}", node)
        d = shape[s.axis]
        if s.plain and d is not None and d != self.symbol:
            return Mixed(f"output '{v.name}' {list(shape)} should carry the batch '{self.symbol}' at axis {s.axis}",
                         node)
        return s

    def dims_of(self, v: Value) -> list:
        """``v``'s dims as Prods (N included; None unknown): its type, completed from ``dims``, and
        the batch axis of a Rows value as outer x N x inner."""
        shape = v.shape or ()
        known = self.dims.get(v)
        s = self.states.get(v)
        out = []
        for j, d in enumerate(shape):
            if isinstance(s, Rows) and j == s.axis:
                out.append(_mul(_mul(s.outer, (1, ((self.symbol, 1),))), s.inner))
            elif d is not None:
                out.append(_prod([d], ""))
            else:
                out.append(known[j] if known is not None and j < len(known) else None)
        return out

    def _propagate_dims(self, node: Node) -> None:
        """Fill ``dims`` for an output whose type has unknown dims, for the ops attention layers
        put between their reshapes (transposes, products, elementwise ops)."""
        out = node.outputs[0]
        if out.shape is None or all(d is not None for d in out.shape) or node.domain != ONNX_DOMAIN \
                or out in self.dims:
            return
        ins = [None if v is None else self.dims_of(v) for v in node.inputs]
        op, dims = node.op, None
        if op == "Transpose" and ins[0] is not None:
            perm = node.attrs.get("perm") or tuple(range(len(ins[0])))[::-1]
            dims = [ins[0][p] for p in perm]
        elif op == "Gemm" and len(ins[0]) == 2 and len(ins[1]) == 2:
            a = node.attrs
            dims = [ins[0][1 if a.get("transA", 0) else 0], ins[1][0 if a.get("transB", 0) else 1]]
        elif op in _UNARY or op in ("Softmax", "LogSoftmax", "LayerNormalization"):
            dims = ins[0]
        elif op in _BROADCAST or op == "MatMul":
            dims = _broadcast_dims(op, [d for d in ins if d is not None], len(out.shape))
        elif op == "Expand" and ins[0] is not None:
            target = self._vals(node.inputs[1])
            if target is not None and all(t is None or t[0] >= 0 for t in target):
                dims = _broadcast_dims("Add", [ins[0], target], len(out.shape))
        if dims is not None and len(dims) == len(out.shape):
            self.dims[out] = dims

    def _record_bounds(self, node: Node) -> None:
        """``bounds`` of a node's CONST int output: arange(0, L) lies in [0, L); reshaping ops and the
        negative-index wrap keep the bound."""
        out = node.outputs[0]
        if self.states.get(out) is not CONST or node.domain != ONNX_DOMAIN:
            return
        bound = None
        if node.op == "Range":
            start, limit, delta = (self._vals(v) for v in node.inputs[:3])
            if start == [(0, ())] and delta == [(1, ())] and limit is not None and len(limit) == 1 \
                    and limit[0] is not None and not _has_n(limit[0], self.symbol):
                bound = limit[0]
        elif node.op in ("Unsqueeze", "Squeeze", "Identity", "Cast", "Reshape") and node.inputs[0] is not None:
            bound = self.bounds.get(node.inputs[0])
        elif node.op == "Where":
            wrapped = _negative_wrap(node)
            bound = None if wrapped is None else self.bounds.get(wrapped)
        if bound is not None:
            self.bounds[out] = bound

    def _vals(self, v: Optional[Value]) -> Optional[list]:
        if v is None:
            return None
        if v in self.values:
            return self.values[v]
        lit = _literal(v)
        if lit is not None and lit.dtype.kind in "iu" and lit.ndim <= 1:
            return [(int(x), ()) for x in lit.reshape(-1)]
        return None

    def _shape_values(self, node: Node) -> Optional[list]:
        """The symbolic value of a node's rank <= 1 int output, for the ops shape code is made of."""
        op, ins = node.op, node.inputs
        out = node.outputs[0]
        if out.shape is None or len(out.shape) > 1:
            return None
        if op == "Shape":
            x = ins[0]
            if x.shape is None:
                return None
            dims = self.dims_of(x)
            a = node.schema.fill_attrs(node.attrs)
            return dims[slice(a["start"], a["end"])]
        if op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
            return self._vals(ins[0])
        args = [self._vals(v) for v in ins]
        if op == "Gather" and args[0] is not None and args[1] is not None and len(ins[0].shape or ()) == 1:
            n = len(args[0])
            picks = [p[0] for p in args[1]]
            if all(not p[1] and -n <= p[0] < n for p in args[1]):
                return [args[0][p + n if p < 0 else p] for p in picks]
            return None
        if op == "Concat" and all(a is not None for a in args):
            return [x for a in args for x in a]
        if op in ("Mul", "Div", "Add", "Sub") and len(args) == 2 and all(a is not None for a in args):
            x, y = args
            if len(x) != len(y) and 1 not in (len(x), len(y)):
                return None
            n = max(len(x), len(y))
            return [_arith(op, x[0 if len(x) == 1 else j], y[0 if len(y) == 1 else j]) for j in range(n)]
        return None

    def subgraph(self, graph: Graph, inputs: Sequence[State]) -> list:
        for v, s in zip(graph.inputs, inputs):
            self.states[v] = s
        self.run(graph)
        return [self.state(v) for v in graph.outputs]


# ---------------------------------------------------------------------------------------- rule helpers


class _Ctx:
    """What a rule sees: the node, its input states, shapes and literal values."""

    def __init__(self, an: _Analysis, node: Node, ins: list):
        self.an, self.node, self.ins = an, node, ins
        self.attrs = node.schema.fill_attrs(node.attrs)

    def has(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def shape(self, i: int) -> tuple:
        v = self.node.inputs[i]
        if v.shape is None:
            raise Dependent(f"input '{v.name}' has an unknown shape")
        return v.shape

    def rank(self, i: int) -> int:
        return len(self.shape(i))

    def out_shape(self, k: int = 0) -> tuple:
        v = self.node.outputs[k]
        if v.shape is None:
            raise Dependent(f"output '{v.name}' has an unknown shape")
        return v.shape

    def literal(self, i: int) -> Optional[list]:
        """Input i's values as ints when it is a constant in the file (an initializer or a
        Constant node's output), else None."""
        if not self.has(i):
            return None
        arr = _literal(self.node.inputs[i])
        if arr is None or arr.dtype.kind not in "iuf":
            return None
        return [int(x) if arr.dtype.kind in "iu" else float(x) for x in arr.reshape(-1)]

    def need_literal(self, i: int, what: str) -> list:
        vals = self.literal(i)
        if vals is None:
            raise Dependent(f"its {what} is not a constant, so it cannot be checked against the batch axis")
        return vals

    def only_const(self, *positions: int, what: str = "") -> None:
        for i in positions:
            s = self.ins[i] if i < len(self.ins) else CONST
            if s is not CONST:
                name = self.node.inputs[i].name
                raise Dependent(f"input {i} ('{name}'{', ' + what if what else ''}) "
                                f"{'depends on the batch size' if isinstance(s, Size) else 'carries batch rows'}; "
                                "only constants are allowed there")

    def n_out(self) -> int:
        return len(self.node.outputs)


def _literal(v: Value) -> Optional[np.ndarray]:
    if v.const is not None:
        return np.asarray(v.const)
    p = v.producer
    if p is not None and p.op == "Constant" and p.domain == ONNX_DOMAIN:
        try:
            return np.asarray(p.schema.reference(**p.schema.fill_attrs(p.attrs)))
        except Exception:  # noqa: BLE001 - a malformed Constant is simply not a literal here
            return None
    return None


def _norm(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise Dependent(f"axis {axis} is out of range for rank {rank}")
    return a


def _prod(dims: Sequence, symbol: str) -> Optional[Prod]:
    """The product of ``dims`` as a canonical Prod; None if a dim is unknown or is ``symbol`` (pass
    "" to keep every symbol, the batch's included)."""
    coef, syms = 1, Counter()
    for d in dims:
        if isinstance(d, (int, np.integer)):
            coef *= int(d)
        elif isinstance(d, str) and (d != symbol or not symbol):
            syms[d] += 1
        else:
            return None
    return (coef, tuple(sorted(syms.items())))


def _mul(a: Prod, b: Prod) -> Prod:
    syms = Counter(dict(a[1]))
    syms.update(dict(b[1]))
    return (a[0] * b[0], tuple(sorted(syms.items())))


def _div(a: Prod, b: Prod) -> Optional[Prod]:
    """a / b when b divides a exactly (as coefficient and symbol powers), else None."""
    if b[0] == 0 or a[0] % b[0]:
        return None
    syms = Counter(dict(a[1]))
    for s, n in b[1]:
        if syms[s] < n:
            return None
        syms[s] -= n
    return (a[0] // b[0], tuple(sorted((s, n) for s, n in syms.items() if n)))


def _numel(ctx: _Ctx, i: int) -> Optional[int]:
    shape = ctx.node.inputs[i].shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


# ---------------------------------------------------------------------------------------- rules

Rule = Callable[[_Ctx], list]
RULES: dict[tuple[str, str], Rule] = {}


def rule(*ops: str, domain: str = ONNX_DOMAIN) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for op in ops:
            RULES[(domain, op)] = fn
        return fn
    return deco


_UNARY = ("Abs", "Cast", "Ceil", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish",
          "Identity", "IsInf", "IsNaN", "LeakyRelu", "Log", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Selu",
          "Sigmoid", "Sign", "Sin", "Softplus", "Softsign", "Sqrt", "Tanh", "Dropout", "CastLike",
          "Tan", "Acos", "Asin", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Round", "Celu",
          "ThresholdedRelu", "Shrink", "BitwiseNot")


@rule(*_UNARY)
def _unary(ctx: _Ctx) -> list:
    """Elementwise on input 0; the other inputs (Dropout's ratio and mode) must be constants.
    CastLike's second input gives only a dtype."""
    if ctx.node.op != "CastLike":
        ctx.only_const(*range(1, len(ctx.ins)))
    return [ctx.ins[0]] * ctx.n_out()


_BROADCAST = ("Add", "Sub", "Mul", "Div", "Mod", "Pow", "And", "Or", "Xor", "Equal", "Greater", "GreaterOrEqual",
              "Less", "LessOrEqual", "Max", "Min", "Mean", "Sum", "Where", "PRelu", "Clip", "BitwiseAnd", "BitwiseOr",
              "BitwiseXor", "BitShift")


@rule(*_BROADCAST)
def _broadcast(ctx: _Ctx) -> list:
    """numpy broadcasting: every operand carrying rows must put the batch on the same output axis
    (with the same folding); a constant operand broadcasts along it only with dim 1 (or none)."""
    if any(isinstance(s, Index) for s in ctx.ins):
        return [_index_arith(ctx)]
    out_rank = len(ctx.out_shape())
    target: Optional[Rows] = None
    for i, s in enumerate(ctx.ins):
        if isinstance(s, Rows):
            cand = s.at(s.axis + out_rank - ctx.rank(i))
            if target is not None and cand != target:
                raise Dependent(f"its operands carry the batch on different axes ({target.axis} and {cand.axis}): "
                                "rows of different requests would meet")
            target = cand
    if target is None:
        return [CONST if _same_for_every_n(ctx) else _size_broadcast(ctx)]
    for i, s in enumerate(ctx.ins):
        if not ctx.has(i) or isinstance(s, Rows):
            continue
        if isinstance(s, Size):
            raise Dependent(f"it combines row data with '{ctx.node.inputs[i].name}', which depends on the batch "
                            "size (the number of stacked rows would change the answer)")
        shape = ctx.shape(i)
        pos = target.axis - (out_rank - len(shape))
        if pos >= 0 and shape[pos] != 1:
            raise Dependent(f"operand '{ctx.node.inputs[i].name}' {list(shape)} has dim {shape[pos]!r} on the "
                            "batch axis instead of broadcasting along it")
    return [target]


def _index_arith(ctx: _Ctx) -> Index:
    """Flat indices into a batch-major tensor: i x L (L a known positive size) and i x L + c with
    c in [0, L) (a bounded arange) stay inside row i's block of L elements."""
    op = ctx.node.op
    if op not in ("Mul", "Add") or len(ctx.ins) != 2:
        raise Dependent("it computes with positions in the stacked batch")
    k = 0 if isinstance(ctx.ins[0], Index) else 1
    idx, other = ctx.ins[k], ctx.ins[1 - k]
    v = ctx.node.inputs[1 - k]
    if other is not CONST:
        raise Dependent("it combines positions in the stacked batch with row data or the batch size")
    out_rank = len(ctx.out_shape())
    axis = idx.axis + out_rank - ctx.rank(k)
    shape = ctx.shape(1 - k)
    pos = axis - (out_rank - len(shape))
    if pos >= 0 and shape[pos] != 1:
        raise Dependent("its operands do not broadcast along the batch")
    if op == "Mul":
        vals = ctx.an._vals(v)
        if idx.exact and vals is not None and len(vals) == 1 and vals[0] is not None and vals[0][0] > 0 \
                and not _has_n(vals[0], ctx.an.symbol):
            return Index(axis, _mul(idx.stride, vals[0]), True)
        raise Dependent("it scales positions in the stacked batch by a value not known to be a positive size")
    bound = ctx.an.bounds.get(v)
    if idx.exact and bound is not None and bound == idx.stride:
        return Index(axis, idx.stride, False)
    raise Dependent("it offsets positions in the stacked batch by values not known to stay inside a row")


def _negative_wrap(node: Node) -> Optional[Value]:
    """x, if ``node`` is ``Where(Less(x, 0), Add(x, n), x)`` (how a negative index is wrapped)."""
    if node.op != "Where" or node.domain != ONNX_DOMAIN or len(node.inputs) != 3:
        return None
    cond, plus, x = node.inputs
    if x is None or cond is None or plus is None:
        return None
    less, add = cond.producer, plus.producer
    if less is None or add is None or less.op != "Less" or add.op != "Add":
        return None
    zero = _literal(less.inputs[1]) if less.inputs[1] is not None else None
    if less.inputs[0] is not x or zero is None or zero.size != 1 or zero.reshape(-1)[0] != 0:
        return None
    return x if x in add.inputs else None


_COMPARE = {"Equal": lambda x, k: x == k, "Greater": lambda x, k: x > k, "Less": lambda x, k: x < k,
            "GreaterOrEqual": lambda x, k: x >= k, "LessOrEqual": lambda x, k: x <= k}


def _same_for_every_n(ctx: _Ctx) -> bool:
    """Whether a comparison of a x N (a > 0) with a constant k has one answer for every N >= 1 (a
    trace's ``if x.size(0) == 1`` on a batch folded with 4 heads: 4N is never 1), so the result,
    and any guard on it, is the same stacked or alone."""
    op = ctx.node.op
    if op not in _COMPARE or len(ctx.ins) != 2:
        return False
    x, y = (ctx.an._vals(v) for v in ctx.node.inputs)
    if x is None or y is None or len(x) != 1 or len(y) != 1 or x[0] is None or y[0] is None:
        return False
    n = ((ctx.an.symbol, 1),)
    if x[0][1] == n and not y[0][1]:
        a, k, swap = x[0][0], y[0][0], False
    elif y[0][1] == n and not x[0][1]:
        a, k, swap = y[0][0], x[0][0], True
    else:
        return False
    if a <= 0:
        return False
    cmp = _COMPARE[op]
    # a x N runs over a, 2a, 3a, ...: the answer changes only where a x N crosses or meets k.
    probes = {a, a * max(1, k // a), a * max(1, k // a + 1), a * max(1, k // a + 2)}
    answers = {cmp(k, p) if swap else cmp(p, k) for p in probes}
    return len(answers) == 1


def _size_broadcast(ctx: _Ctx) -> State:
    """Elementwise arithmetic on shape values (no rows): element j of the result depends on N if
    element j of some operand does (operands of rank <= 1 and static length, else all of it)."""
    lengths, masks = [], []
    for i, s in enumerate(ctx.ins):
        if not ctx.has(i):
            continue
        n = _numel(ctx, i)
        if n is None or ctx.rank(i) > 1:
            return Size(None)
        mask = s.mask if isinstance(s, Size) else (False,) * n
        if mask is None:
            return Size(None)
        lengths.append(n)
        masks.append(mask)
    length = max(lengths)
    if any(n not in (1, length) for n in lengths):
        return Size(None)
    out = [any(m[0] if len(m) == 1 else m[j] for m in masks) for j in range(length)]
    return _size(out)


# ---- shape values


@rule("Shape")
def _shape_of(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    if isinstance(s, Size):
        return [Size(None)]
    axes = range(ctx.rank(0))[slice(ctx.attrs["start"], ctx.attrs["end"])]
    return [_size([j == s.axis for j in axes])]


@rule("Size")
def _size_of(ctx: _Ctx) -> list:
    return [Size(None)]


@rule("Constant")
def _constant(ctx: _Ctx) -> list:
    return [CONST]


@rule("Range")
def _range(ctx: _Ctx) -> list:
    """arange(N) numbers rows by their position in the batch: an Index (see Index), never row data."""
    if any(isinstance(s, Rows) for s in ctx.ins):
        raise Dependent("its bounds are read from row data")
    start, limit, delta = (ctx.an._vals(v) for v in ctx.node.inputs[:3])
    if start == [(0, ())] and delta == [(1, ())] and limit == [(1, ((ctx.an.symbol, 1),))]:
        return [Index(0)]
    return [Size(None)]


# ---- layout


@rule("Transpose")
def _transpose(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    if isinstance(s, Size):
        return [Size(None)]
    rank = ctx.rank(0)
    perm = ctx.attrs.get("perm")
    perm = list(range(rank))[::-1] if perm is None else [_norm(p, rank) for p in perm]
    return [s.at(perm.index(s.axis))]


@rule("Squeeze")
def _squeeze(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="axes")
    if isinstance(s, Size):
        return [s if s.mask is None or _numel(ctx, 0) is not None else Size(None)]
    rank = ctx.rank(0)
    if ctx.has(1):
        axes = [_norm(a, rank) for a in ctx.need_literal(1, "axes")]
    else:
        shape = ctx.shape(0)
        if any(not isinstance(d, int) for j, d in enumerate(shape) if j != s.axis):
            raise Dependent("it squeezes every dim of size 1 and some dims are not known")
        axes = [j for j, d in enumerate(shape) if d == 1 and j != s.axis]
    if s.axis in axes:
        raise Dependent("it squeezes the batch axis away")
    return [s.at(s.axis - sum(1 for a in axes if a < s.axis))]


@rule("Unsqueeze")
def _unsqueeze(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="axes")
    if isinstance(s, Size):
        return [s]
    out_rank = len(ctx.out_shape())
    axes = sorted(_norm(a, out_rank) for a in ctx.need_literal(1, "axes"))
    kept = [j for j in range(out_rank) if j not in axes]
    return [s.at(kept[s.axis])]


@rule("Flatten")
def _flatten(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    if isinstance(s, Size):
        return [Size(None)]
    return _reshaped(ctx, s)


@rule("Reshape")
def _reshape(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    if isinstance(ctx.ins[1], Rows):
        raise Dependent("its target shape is computed from row data")
    if isinstance(s, Size):
        return [s if s.mask is not None and len(s.mask) == _numel(ctx, 0) else Size(None)]
    if s is CONST:  # a constant reshaped to a shape that depends on N
        return [Size(None)]
    if ctx.node.attrs.get("allowzero", 0):
        raise Dependent("allowzero reshapes are not followed")
    return _reshaped(ctx, s)


def _reshaped(ctx: _Ctx, s: Rows) -> list:
    """Where the batch lands after a row-major reshape. With P the elements before the batch index
    and Q those after it (in the flat order), the output keeps each request's rows apart exactly when
    the one output dim holding N is P' x N x Q' with P' = P / prod(dims before it) and
    Q' = Q / prod(dims after it), both exact: the batch index keeps its place in the flat order."""
    sym = ctx.an.symbol
    n = (1, ((sym, 1),))
    shape = ctx.shape(0)
    dims = ctx.an.dims_of(ctx.node.inputs[0])
    if any(d is None or _has_n(d, sym) for j, d in enumerate(dims) if j != s.axis):
        raise Dependent(f"the dims around the batch in {list(shape)} are not known")
    before, after = _product(dims[:s.axis]), _product(dims[s.axis + 1:])
    P, Q = _mul(before, s.outer), _mul(s.inner, after)
    out = _target_dims(ctx, shape, s)
    unknown = [j for j, d in enumerate(out) if d is None]
    if len(unknown) == 1:  # the one unknown dim follows from the element count P x N x Q
        out[unknown[0]] = _div(_mul(_mul(P, n), Q), _product([d for d in out if d is not None]))
    holding = [j for j, d in enumerate(out) if d is not None and _has_n(d, sym)]
    shown = [None if d is None else _format_prod(d) for d in out]
    if None in out or len(holding) != 1:
        raise Dependent(f"it reshapes {list(shape)} to {shown}, which may fold the batch into other dims "
                        "(rows of different requests would be mixed)")
    a = holding[0]
    pre, post = _product(out[:a]), _product(out[a + 1:])
    outer, inner = _div(P, pre), _div(Q, post)
    if outer is None or inner is None or _mul(_mul(outer, n), inner) != out[a]:
        raise Dependent(f"it reshapes {list(shape)} to {shown}, folding the batch into other dims "
                        "(rows of different requests would be mixed)")
    ctx.an.dims[ctx.node.outputs[0]] = out
    return [Rows(a, outer, inner)]


def _product(dims: Sequence[Prod]) -> Prod:
    out = (1, ())
    for d in dims:
        out = _mul(out, d)
    return out


def _arith(op: str, x: Optional[Prod], y: Optional[Prod]) -> Optional[Prod]:
    """One element of shape arithmetic on Prods, exact or None."""
    if x is None or y is None:
        return None
    if op == "Mul":
        return _mul(x, y)
    if op == "Div":
        return _div(x, y)
    if x[1] or y[1]:
        return None
    return (x[0] + y[0], ()) if op == "Add" else (x[0] - y[0], ())


def _broadcast_dims(op: str, ins: list, rank: int) -> Optional[list]:
    """Output dims of numpy broadcasting (MatMul: of its stacked dims, then M and N)."""
    if op == "MatMul":
        if len(ins) != 2 or len(ins[0]) < 2 or len(ins[1]) < 2:
            return None
        a, b = ins
        lead = _broadcast_dims("Add", [a[:-2], b[:-2]], rank - 2)
        return None if lead is None else lead + [a[-2], b[-1]]
    out = []
    for j in range(rank):
        picked, unknown = (1, ()), False
        for d in ins:
            k = j - (rank - len(d))
            if k < 0:
                continue
            if d[k] is None:
                unknown = True  # 1 or the others' dim: a known dim other than 1 decides
            elif d[k] != (1, ()):
                if picked != (1, ()) and picked != d[k]:
                    return None
                picked = d[k]
        out.append(None if unknown and picked == (1, ()) else picked)
    return out


def _has_n(p: Prod, sym: str) -> bool:
    return any(name == sym for name, _ in p[1])


def _format_prod(p: Prod) -> str:
    parts = [str(p[0])] if p[0] != 1 or not p[1] else []
    parts += [name if k == 1 else f"{name}^{k}" for name, k in p[1]]
    return "*".join(parts)


def _target_dims(ctx: _Ctx, shape: tuple, s: Rows) -> list:
    """The output dims of a Reshape/Flatten as Prods (N included), None where unknown: from the
    output type, else from the symbolic values of the target shape."""
    out = ctx.out_shape()
    dims: list = [None if d is None else _prod([d], "") for d in out]
    if ctx.node.op == "Reshape":
        vals = ctx.an.values.get(ctx.node.inputs[1])
        if vals is not None and len(vals) == len(out):
            for j, v in enumerate(vals):
                if dims[j] is not None or v is None or v[0] < 0:
                    continue
                if v == (0, ()):  # 0 copies the input dim
                    if j < len(shape):
                        dims[j] = ctx.an.dims_of(ctx.node.inputs[0])[j]
                    continue
                dims[j] = v
    return dims


@rule("Expand")
def _expand(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    if isinstance(ctx.ins[1], Rows):
        raise Dependent("its target shape is computed from row data")
    out = ctx.out_shape()
    if isinstance(s, Rows):
        axis = s.axis + len(out) - ctx.rank(0)
        if any(d is None or d == ctx.an.symbol for j, d in enumerate(out) if j != axis):
            shape = ctx.ins[1]
            if not (isinstance(shape, Size) and shape.mask is not None and len(shape.mask) == len(out)
                    and not any(m for j, m in enumerate(shape.mask) if j != axis)) and shape is not CONST:
                raise Dependent(f"its target shape {list(out)} may grow other dims with the batch size")
        return [s.at(axis)]
    return [_constant_rows(ctx, out, 1)]


@rule("ConstantOfShape")
def _constant_of_shape(ctx: _Ctx) -> list:
    if isinstance(ctx.ins[0], Rows):
        raise Dependent("its shape is computed from row data")
    return [_constant_rows(ctx, ctx.out_shape(), 0)]


def _constant_rows(ctx: _Ctx, out: tuple, shape_at: int) -> State:
    """A tensor made N rows long by a shape value, each row the same (``expand(N, seq)`` of a
    constant): Rows when the batch symbol is on exactly one output axis and nothing else depends on
    N (every other dim known, or the shape value's N-dependent element is that axis alone), else a
    value that depends on N."""
    sym = ctx.an.symbol
    axes = [j for j, d in enumerate(out) if d == sym]
    if len(axes) != 1:
        return Size(None)
    b = axes[0]
    if ctx.node.op == "Expand":
        shape = ctx.shape(0)
        pos = b - (len(out) - len(shape))
        if pos >= 0 and shape[pos] != 1:
            return Size(None)
    if all(d is not None for d in out):
        return Rows(b)
    s = ctx.ins[shape_at]
    if isinstance(s, Size) and s.mask is not None and len(s.mask) == len(out) \
            and [j for j, m in enumerate(s.mask) if m] == [b]:
        return Rows(b)
    return Size(None)


@rule("Tile")
def _tile(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="repeats")
    if isinstance(s, Size):
        return [Size(None)]
    reps = ctx.need_literal(1, "repeats")
    if s.axis >= len(reps) or reps[s.axis] != 1:
        raise Dependent("it repeats along the batch axis")
    return [s]


@rule("Concat")
def _concat(ctx: _Ctx) -> list:
    out = ctx.out_shape()
    axis = _norm(ctx.attrs["axis"], len(out))
    rows = [s for s in ctx.ins if isinstance(s, Rows)]
    if not rows:
        masks = []
        for i, s in enumerate(ctx.ins):
            n = _numel(ctx, i)
            m = (False,) * n if s is CONST and n is not None else (s.mask if isinstance(s, Size) else None)
            if m is None or ctx.rank(i) != 1:
                return [Size(None)]
            masks.extend(m)
        return [_size(masks)]
    if any(r != rows[0] for r in rows) or len(rows) != len(ctx.ins):
        raise Dependent("it joins tensors that do not all carry the batch on the same axis")
    if rows[0].axis == axis:
        raise Dependent("it concatenates along the batch axis")
    return [rows[0]]


@rule("Split")
def _split(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="split")
    if isinstance(s, Size):
        return [Size(None)] * ctx.n_out()
    if _norm(ctx.attrs["axis"], ctx.rank(0)) == s.axis:
        raise Dependent("it splits along the batch axis")
    return [s] * ctx.n_out()


@rule("Slice")
def _slice(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, 2, 3, 4, what="slice bounds")
    if isinstance(s, Size):
        starts, ends = ctx.literal(1), ctx.literal(2)
        axes, steps = ctx.literal(3), ctx.literal(4)
        if s.mask is None or starts is None or ends is None or len(starts) != 1 or ctx.rank(0) != 1 \
                or (ctx.has(3) and axes is None) or (ctx.has(4) and steps is None):
            return [Size(None)]
        step = steps[0] if steps else 1
        return [_size(s.mask[slice(*_py_slice(starts[0], ends[0], step))])]
    rank = ctx.rank(0)
    if ctx.has(3):
        axes = [_norm(a, rank) for a in ctx.need_literal(3, "axes")]
    elif ctx.shape(1) and isinstance(ctx.shape(1)[0], int):
        axes = list(range(ctx.shape(1)[0]))
    else:
        raise Dependent("the number of sliced axes is not known")
    if s.axis in axes:
        j = axes.index(s.axis)
        starts, ends = ctx.need_literal(1, "starts"), ctx.need_literal(2, "ends")
        steps = ctx.literal(4) if ctx.has(4) else [1] * len(axes)
        if steps is None or starts[j] != 0 or steps[j] != 1 or ends[j] < END_OF_AXIS:
            raise Dependent("it slices along the batch axis")
    return [s]


def _py_slice(start: int, end: int, step: int) -> tuple:
    return (start, None if end >= END_OF_AXIS else end, step)


@rule("Pad")
def _pad(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, 2, 3, what="pads")
    if isinstance(s, Size):
        return [Size(None)]
    rank = ctx.rank(0)
    pads = ctx.need_literal(1, "pads")
    axes = [_norm(a, rank) for a in ctx.need_literal(3, "axes")] if ctx.has(3) else list(range(rank))
    if s.axis in axes:
        j = axes.index(s.axis)
        if pads[j] != 0 or pads[j + len(axes)] != 0:
            raise Dependent("it pads along the batch axis")
    return [s]


# ---- indexing


@rule("Gather")
def _gather(ctx: _Ctx) -> list:
    data, idx = ctx.ins[0], ctx.ins[1]
    rank = ctx.rank(0)
    axis = _norm(ctx.attrs["axis"], rank)
    if isinstance(idx, Index):
        return [_gather_own_rows(ctx, data, idx, axis)]
    if isinstance(data, Index):
        raise Dependent("it gathers from positions in the stacked batch")
    if isinstance(idx, Size):
        raise Dependent("its indices depend on the batch size (positions in the stacked batch)")
    if isinstance(data, Size):
        picks = ctx.literal(1)
        if data.mask is None or picks is None or rank != 1 or ctx.rank(1) > 1:
            return [Size(None)]
        n = len(data.mask)
        return [_size([data.mask[p + n if p < 0 else p] for p in picks if -n <= p < n])]
    if isinstance(data, Rows) and isinstance(idx, Rows):
        raise Dependent("both its data and its indices carry batch rows")
    if isinstance(data, Rows):
        if axis == data.axis:
            raise Dependent("it indexes the batch axis (picks rows by position)")
        return [data if data.axis < axis else data.at(data.axis - 1 + ctx.rank(1))]
    return [idx.at(axis + idx.axis)]  # an embedding lookup: constant table, indices per row


def _gather_own_rows(ctx: _Ctx, data: State, idx: Index, axis: int) -> Rows:
    """data[flat index]: for batch position i the indices lie in [i x L, (i + 1) x L), which is row
    i's block when the data carries the batch on the gathered axis with L elements a row."""
    if not isinstance(data, Rows) or data.axis != axis or data.outer != ONE or data.inner != idx.stride:
        raise Dependent("its indices are positions in the stacked batch, not within each row's own block")
    return Rows(axis + idx.axis)


@rule("GatherElements")
def _gather_elements(ctx: _Ctx) -> list:
    data, idx = ctx.ins[0], ctx.ins[1]
    if not (isinstance(data, Rows) and data == idx):
        raise Dependent("its data and indices do not both carry the batch on the same axis")
    if _norm(ctx.attrs["axis"], ctx.rank(0)) == data.axis:
        raise Dependent("it indexes along the batch axis")
    return [data]


@rule("Trilu")
def _trilu(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="k")
    if isinstance(s, Size):
        return [Size(None)]
    if s.axis >= ctx.rank(0) - 2:
        raise Dependent("the batch is one of the two matrix axes it masks")
    return [s]


# ---- along one axis


def _not_batch_axis(ctx: _Ctx, axis: int, what: str) -> Rows:
    s = ctx.ins[0]
    if isinstance(s, Size):
        raise Dependent(f"it {what} a value that depends on the batch size")
    if _norm(axis, ctx.rank(0)) == s.axis:
        raise Dependent(f"it {what} along the batch axis {s.axis}: every row's answer would depend on the others")
    return s


@rule("Softmax", "LogSoftmax")
def _softmax(ctx: _Ctx) -> list:
    return [_not_batch_axis(ctx, ctx.attrs["axis"], "normalizes")]


@rule("CumSum")
def _cumsum(ctx: _Ctx) -> list:
    ctx.only_const(1, what="axis")
    return [_not_batch_axis(ctx, ctx.need_literal(1, "axis")[0], "sums cumulatively")]


@rule("ArgMax", "ArgMin")
def _arg(ctx: _Ctx) -> list:
    axis = _norm(ctx.attrs["axis"], ctx.rank(0))
    s = _not_batch_axis(ctx, axis, "reduces")
    keep = ctx.attrs.get("keepdims", 1)
    return [s if keep or axis > s.axis else s.at(s.axis - 1)]


@rule("TopK")
def _topk(ctx: _Ctx) -> list:
    ctx.only_const(1, what="K")
    return [_not_batch_axis(ctx, ctx.attrs["axis"], "ranks")] * 2


@rule("ReduceL2", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum")
def _reduce(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, what="axes")
    if isinstance(s, Size):
        return [Size(None)]
    rank = ctx.rank(0)
    axes = ctx.need_literal(1, "axes") if ctx.has(1) else []
    if not axes:
        if ctx.attrs.get("noop_with_empty_axes", 0):
            return [s]
        raise Dependent("it reduces over every axis, the batch included")
    axes = [_norm(a, rank) for a in axes]
    if s.axis in axes:
        raise Dependent(f"it reduces over the batch axis {s.axis}: every row's answer would depend on the others")
    keep = ctx.attrs.get("keepdims", 1)
    return [s if keep else s.at(s.axis - sum(1 for a in axes if a < s.axis))]


@rule("LayerNormalization")
def _layer_norm(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, 2, what="scale/bias")
    if isinstance(s, Size):
        raise Dependent("it normalizes a value that depends on the batch size")
    if _norm(ctx.attrs["axis"], ctx.rank(0)) <= s.axis:
        raise Dependent("it normalizes over the batch axis")
    return [s] * ctx.n_out()


# ---- per item along axis 0 (N first, as in ONNX's NCHW ops)


def _per_item(ctx: _Ctx, *params: int, outputs: int = 1) -> list:
    s = ctx.ins[0]
    ctx.only_const(*params, what="weights")
    if not isinstance(s, Rows) or s.axis != 0:
        raise Dependent("its input does not carry the batch as dim 0 (the N of N x C x ...)")
    return [s] * outputs + [Mixed("this output mixes positions of the whole batch", ctx.node)] * (
        ctx.n_out() - outputs)


@rule("Conv", "ConvTranspose")
def _conv(ctx: _Ctx) -> list:
    return _per_item(ctx, 1, 2)


@rule("AveragePool", "GlobalAveragePool", "GlobalMaxPool", "DepthToSpace", "SpaceToDepth")
def _pool(ctx: _Ctx) -> list:
    return _per_item(ctx)


@rule("MaxPool")
def _max_pool(ctx: _Ctx) -> list:
    # Indices (output 1) are positions in the flattened input, batch offset included.
    return _per_item(ctx, outputs=1)


@rule("InstanceNormalization")
def _instance_norm(ctx: _Ctx) -> list:
    return _per_item(ctx, 1, 2)


@rule("BatchNormalization")
def _batch_norm(ctx: _Ctx) -> list:
    if ctx.attrs.get("training_mode", 0):
        raise Dependent("training-mode BatchNormalization normalizes with the statistics of the whole batch")
    return _per_item(ctx, 1, 2, 3, 4)


@rule("Resize")
def _resize(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, 2, 3, what="roi/scales/sizes")
    if not isinstance(s, Rows) or not s.plain:
        raise Dependent("its input does not carry the batch as a plain axis")
    if ctx.attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise Dependent("tf_crop_and_resize may crop the batch axis")
    if ctx.out_shape()[s.axis] != ctx.an.symbol:
        raise Dependent("it may resize the batch axis")
    return [s]


@rule("DequantizeLinear")
def _dequantize(ctx: _Ctx) -> list:
    s = ctx.ins[0]
    ctx.only_const(1, 2, what="scale/zero point")
    if isinstance(s, Rows) and _norm(ctx.attrs["axis"], ctx.rank(0)) == s.axis and _numel(ctx, 1) != 1:
        raise Dependent("its per-axis scale runs along the batch axis")
    if isinstance(s, Rows) and ctx.attrs.get("block_size", 0) and _numel(ctx, 1) != 1:
        raise Dependent("its blocked scale has x's shape, the batch axis included")
    return [s]


# ---- products


@rule("Gemm")
def _gemm(ctx: _Ctx) -> list:
    a, b = ctx.ins[0], ctx.ins[1]
    ctx.only_const(2, what="C")
    if isinstance(a, Size) or isinstance(b, Size):
        raise Dependent("it multiplies a value that depends on the batch size")
    if isinstance(a, Rows) and isinstance(b, Rows):
        raise Dependent("both operands carry batch rows (a product across requests)")
    if isinstance(a, Rows):
        free = 1 if ctx.attrs.get("transA", 0) else 0
        if a.axis != free:
            raise Dependent("the batch is its contracted dim")
        if ctx.has(2) and ctx.rank(2) == 2 and ctx.shape(2)[0] != 1:
            raise Dependent("its C operand has no broadcast dim along the batch")
        return [a.at(0)]
    free = 0 if ctx.attrs.get("transB", 0) else 1
    if b.axis != free:
        raise Dependent("the batch is its contracted dim")
    if ctx.has(2) and ctx.rank(2) >= 1 and ctx.shape(2)[-1] != 1:
        raise Dependent("its C operand has no broadcast dim along the batch")
    return [b.at(1)]


@rule("MatMul")
def _matmul(ctx: _Ctx) -> list:
    """numpy matmul: the batch may be a row of A (axis -2), a column of B (axis -1), or a stacked
    dim of either (broadcast against the other's); never a contracted one."""
    a, b = ctx.ins[0], ctx.ins[1]
    if isinstance(a, Size) or isinstance(b, Size):
        raise Dependent("it multiplies a value that depends on the batch size")
    ra, rb = ctx.rank(0), ctx.rank(1)
    out_rank = len(ctx.out_shape())
    lead = out_rank - (ra > 1) - (rb > 1)  # the output's stacked dims come first
    found: list[Rows] = []
    if isinstance(a, Rows):
        if a.axis == ra - 1:
            raise Dependent("the batch is the contracted dim of operand A")
        found.append(a.at(lead if a.axis == ra - 2 else lead - (ra - 2) + a.axis))
    if isinstance(b, Rows):
        if rb == 1 or b.axis == rb - 2:
            raise Dependent("the batch is the contracted dim of operand B")
        found.append(b.at(out_rank - 1 if b.axis == rb - 1 else lead - (rb - 2) + b.axis))
    if len(found) == 2 and found[0] != found[1]:
        raise Dependent("its operands carry the batch on different axes (a product across requests)")
    target = found[0]
    if target.axis < lead:  # a stacked dim: a constant operand must broadcast along it
        for i, r in ((0, ra), (1, rb)):
            if ctx.ins[i] is CONST and r > 2:
                pos = target.axis - (lead - (r - 2))
                if pos >= 0 and ctx.shape(i)[pos] != 1:
                    raise Dependent(f"operand '{ctx.node.inputs[i].name}' {list(ctx.shape(i))} has dim "
                                    f"{ctx.shape(i)[pos]!r} on the batch axis")
    return [target]


@rule("Einsum")
def _einsum(ctx: _Ctx) -> list:
    from kiln.ir.ops.linalg import ELLIPSIS, parse_equation

    terms, out = parse_equation(ctx.attrs["equation"], len(ctx.ins))
    if any(ELLIPSIS in t for t in terms) or ELLIPSIS in out:
        raise Dependent("equations with '...' are not followed")
    label, state = None, None
    for i, (t, s) in enumerate(zip(terms, ctx.ins)):
        if isinstance(s, Size):
            raise Dependent("it multiplies a value that depends on the batch size")
        if isinstance(s, Rows):
            if label is not None and (t[s.axis] != label or s != state.at(s.axis)):
                raise Dependent("its operands carry the batch under different subscripts")
            label, state = t[s.axis], s
    for t, s in zip(terms, ctx.ins):
        if t.count(label) > 1 or (s is CONST and label in t):
            raise Dependent(f"subscript '{label}' of the batch is repeated or shared with a constant")
    if label not in out:
        raise Dependent(f"it sums over the batch subscript '{label}'")
    return [state.at(out.index(label))]


# ---- bodies


@rule("If")
def _if(ctx: _Ctx) -> list:
    if ctx.ins[0] is not CONST:
        raise Dependent("its condition depends on the batch (its rows or its size), so one request could "
                        "change which branch the others take")
    then = ctx.an.subgraph(ctx.attrs["then_branch"], [])
    other = ctx.an.subgraph(ctx.attrs["else_branch"], [])
    return [_join(ctx, x, y) for x, y in zip(then, other)]


def _join(ctx: _Ctx, x: State, y: State) -> State:
    if x == y:
        return x
    for s in (x, y):
        if isinstance(s, Mixed):
            return s
    if isinstance(x, Rows) or isinstance(y, Rows):
        return Mixed("its branches do not give the batch the same place", ctx.node)
    return Size(None)


@rule("Loop")
def _loop(ctx: _Ctx) -> list:
    ctx.only_const(0, 1, what="trip count/condition")
    body: Graph = ctx.attrs["body"]
    carried = list(ctx.ins[2:])
    n = len(carried)
    for _ in range(4):
        outs = ctx.an.subgraph(body, [CONST, CONST, *carried])
        if ctx.has(1) and outs[0] is not CONST:
            raise Dependent("its body's continue condition depends on the batch")
        new = [_join(ctx, c, o) for c, o in zip(carried, outs[1:1 + n])]
        if new == carried:
            break
        carried = new
    else:
        raise Dependent("its carried values do not settle")
    scans = [s.at(s.axis + 1) if isinstance(s, Rows) else (Size(None) if isinstance(s, Size) else s)
             for s in outs[1 + n:]]
    return carried + scans


@rule("FusedElementwise", "FusedEpilogue", "FusedAttention", domain=KILN_DOMAIN)
def _fused(ctx: _Ctx) -> list:
    """A closed body: its inputs are the node's inputs, 1:1."""
    return ctx.an.subgraph(ctx.attrs["body"], ctx.ins)
