"""Control-flow primitives for ``kiln.script``: what the rewritten ``if``/``while``/``for`` call.

kiln.script (frontend/script.py) rewrites a model's control flow on tensor values into calls
of these functions, then traces the rewritten code with kiln's tracer. The primitives decide
at trace time, so the scripter accepts whatever Python the tracer accepts:

- no tracer active (eager) or paused: plain Python. The rewritten model still runs eagerly, and
  the trace check compares the graph with exactly that.
- a condition / bound that is a Python value, or a tensor that does not depend on the inputs:
  plain Python too (the taken branch only, loops unrolled) -- what the tracer records anyway.
- a traced condition (a tensor computed from the inputs, or a SymInt): an ``If`` node whose
  branches are recorded as subgraphs by running both branch functions on the example values;
  a ``Loop`` node whose body is recorded by running the body once. Bodies read outer values
  directly (ONNX semantics), via ``Tracer.subgraph``.

The eager value a primitive returns while tracing is the *real* one: ``kiln_if`` returns the
taken branch's values (both branches ran), loops run the real Python loop with the tracer
paused; the If/Loop outputs are then bound to those tensors, so the code after the statement
traces on correct example values.

Values through control flow. Tensors become If outputs / loop-carried values. Python ints that
differ between branches, or that a loop changes, become int64 scalars in the graph and come
back as :class:`TracedInt`: an int for Python (``range``, indexing, sizes) whose comparisons
give traced bool tensors, so ``if t > 0`` in a loop body over ``range(x.size(1))`` stays data
dependent instead of being frozen at the example's value. Python bools that differ between
branches come back as 0-d bool tensors (the rewriter's break/continue flags); use
:func:`kiln_not`, :func:`kiln_and` and :func:`kiln_or` on them, since ``not``/``and``/``or``
cannot be overloaded. Other Python values must be equal on both paths (ScriptError otherwise).
A loop-carried tensor whose shape changes per iteration (greedy decoding's growing ids) gets a
fresh symbolic dim in the body's input type for each dim that changed after one traced
iteration: the body is traced once, compared, and re-traced with the relaxed types.

Known limits: both branches run during tracing, so their side effects happen twice; a branch
or body that writes in place into a tensor from outside raises (assign instead); a loop body is
traced on the first iteration's values (a loop the example runs zero times still traces its
body on the initial state); ``kiln_assert`` on a traced condition is a ``kiln.Assert`` node,
checked on every run (and on the example only where the statement is outside any If/Loop body).
"""
from __future__ import annotations

import linecache
import operator
import sys
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from kiln.errors import ScriptError
from kiln.frontend.symbolic import SymInt
from kiln.frontend.tracer import Tracer, active_tracer
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value
from kiln.ir.types import TensorType

__all__ = ["UNDEFINED", "TracedInt", "kiln_if", "kiln_while", "kiln_for_range", "kiln_for_iter", "kiln_assert",
           "kiln_not", "kiln_and", "kiln_or", "kiln_bool", "kiln_int", "kiln_float", "kiln_item", "ScriptError"]


# ---------------------------------------------------------------------------- the undefined sentinel
class _Undefined:
    """The value of a name not assigned on some path (``UNDEFINED``). Using it is a ScriptError."""

    _instance: Optional["_Undefined"] = None

    def __new__(cls) -> "_Undefined":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNDEFINED"

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise ScriptError("a variable is used after an `if` on tensor data that assigns it in one branch only "
                          "(or it is never assigned); assign it in both branches or before the `if`")

    __bool__ = __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __call__ = _fail
    __getitem__ = __iter__ = __len__ = __index__ = __int__ = __float__ = __neg__ = _fail

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls._instance._fail()


UNDEFINED = _Undefined()


# ---------------------------------------------------------------------------- ints that stay symbolic
_COMPARE = {"lt": ("Less", operator.lt), "le": ("LessOrEqual", operator.le), "gt": ("Greater", operator.gt),
            "ge": ("GreaterOrEqual", operator.ge), "eq": ("Equal", operator.eq), "ne": ("Equal", operator.ne)}


class TracedInt(SymInt):
    """A SymInt for values the graph computes at run time (loop counters, ints carried through
    control flow). Arithmetic keeps it a TracedInt; comparisons in the model's code return a
    traced 0-d bool tensor (so the rewritten ``if`` becomes an If node). Comparisons made with
    no tracer recording (eager, paused, or inside the tracer's own mappings) are plain ints'."""

    __hash__ = int.__hash__

    def __repr__(self) -> str:
        return f"TracedInt({int(self)}, %{self.value.name})"


def _traced_compare(name: str) -> Callable:
    onnx_op, fn = _COMPARE[name]

    def method(self: TracedInt, other: Any) -> Any:
        if isinstance(other, torch.Tensor) or not isinstance(other, (int, float, np.number)):
            return NotImplemented
        concrete = fn(int(self), other)
        t = self.tracer
        if active_tracer() is not t or not torch._C._is_torch_function_mode_enabled():
            return concrete
        a, b = self.value, t.value(other) if isinstance(other, SymInt) else None
        if b is None:
            if isinstance(other, (int, np.integer)) and not isinstance(other, bool):
                b = t.scalar(int(other), DType.INT64)
            else:
                a, b = t.emit("Cast", a, to=DType.FLOAT64.value), t.scalar(float(other), DType.FLOAT64)
        out = t.emit(onnx_op, a, b)
        if name == "ne":
            out = t.emit("Not", out)
        return _bind_new(t, _example(t, concrete), out, method)

    method.__name__ = f"__{name}__"
    return method


def _keep_traced(name: str) -> Callable:
    base = getattr(SymInt, name)

    def method(self: TracedInt, *args: Any) -> Any:
        r = base(self, *args)
        return TracedInt(int(r), r.tracer, r.value) if isinstance(r, SymInt) else r

    method.__name__ = name
    return method


for _n in _COMPARE:
    setattr(TracedInt, f"__{_n}__", _traced_compare(_n))
for _n in ("add", "sub", "mul", "floordiv"):
    for _m in (f"__{_n}__", f"__r{_n}__"):
        setattr(TracedInt, _m, _keep_traced(_m))
TracedInt.__neg__ = _keep_traced("__neg__")


# ---------------------------------------------------------------------------- logic on flags
def kiln_not(x: Any) -> Any:
    """``not x`` for a Python value or a bool tensor (Python's ``not`` cannot be traced)."""
    return torch.logical_not(_as_bool_tensor(x)) if isinstance(x, torch.Tensor) else not x


def kiln_and(a: Any, b_fn: Callable[[], Any]) -> Any:
    """``a and b()``: Python short-circuit on Python values, ``logical_and`` on a tensor ``a``."""
    if not isinstance(a, torch.Tensor):
        return b_fn() if a else a
    b = b_fn()
    if not isinstance(b, torch.Tensor):
        return _as_bool_tensor(a) if b else False
    return torch.logical_and(_as_bool_tensor(a), _as_bool_tensor(b))


def kiln_or(a: Any, b_fn: Callable[[], Any]) -> Any:
    """``a or b()``: Python short-circuit on Python values, ``logical_or`` on a tensor ``a``."""
    if not isinstance(a, torch.Tensor):
        return a if a else b_fn()
    b = b_fn()
    if not isinstance(b, torch.Tensor):
        return True if b else _as_bool_tensor(a)
    return torch.logical_or(_as_bool_tensor(a), _as_bool_tensor(b))


# ---------------------------------------------------------------------------- reads in conditions
# kiln.script rewrites ``bool(e)``, ``int(e)``, ``float(e)`` and ``e.item()`` where they make up an
# if/while/assert condition or a range bound (``while bool(n > 1)``, ``if x.sum().item() > 0``,
# ``for _ in range(int(n))``) into these: on a traced tensor they give the equivalent 0-d tensor,
# so the statement becomes an If/Loop instead of a guarded Python value; on anything else they
# are the builtins (``conv`` is the name the code called, in case it is not the builtin).
def _traced_scalar(x: Any) -> bool:
    t = active_tracer()
    return isinstance(x, torch.Tensor) and _is_traced(t, x) and x.numel() == 1


def kiln_bool(conv: Callable, x: Any) -> Any:
    if conv is bool and _traced_scalar(x):
        return _as_bool_tensor(x.reshape(()))
    return conv(x)


def kiln_int(conv: Callable, x: Any) -> Any:
    if conv is int and _traced_scalar(x):
        x = x.reshape(())
        return x.trunc().to(torch.int64) if x.dtype.is_floating_point else x.to(torch.int64)
    return conv(x)


def kiln_float(conv: Callable, x: Any) -> Any:
    if conv is float and _traced_scalar(x):
        return x.reshape(()).to(torch.float64)
    return conv(x)


def kiln_item(x: Any) -> Any:
    if _traced_scalar(x):
        return x.reshape(())
    return x.item()


def _as_bool_tensor(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype is torch.bool else x != 0


# ---------------------------------------------------------------------------- helpers
def _is_traced(t: Optional[Tracer], x: Any) -> bool:
    """Whether x's value depends on the graph inputs (so control flow on it needs If/Loop)."""
    if t is None:
        return False
    if isinstance(x, SymInt):
        return True
    if isinstance(x, torch.Tensor):
        v = t.values.get(id(x))
        return v is not None and v in t.dependent
    return False


def _truth(t: Optional[Tracer], x: Any) -> bool:
    """bool(x) of the example's value, without recording or warning."""
    if t is None:
        return bool(x)
    with t.paused():
        return bool(int(x)) if isinstance(x, SymInt) else bool(x)


def _plain(t: Optional[Tracer], x: Any) -> int:
    if t is None:
        return int(x)
    with t.paused():
        return int(x)


def _cond_value(t: Tracer, cond: Any) -> Value:
    """The traced condition as a bool scalar (a 1-element tensor is reshaped, others cast)."""
    if isinstance(cond, torch.Tensor) and cond.numel() != 1:
        _truth(t, cond)  # torch's own error for an ambiguous truth value
        raise ScriptError(f"{t.where()}: a condition must hold one element, it has shape {tuple(cond.shape)}")
    v = t.value(cond)
    if v.type.shape is None or len(v.type.shape) != 0:
        v = t.emit("Reshape", v, t.constant(np.zeros(0, np.int64), "shape"))
    if v.type.dtype is not DType.BOOL:
        v = t.emit("Cast", v, to=DType.BOOL.value)
    return v


def _example(t: Tracer, x: Any) -> torch.Tensor:
    """A 0-d tensor of a Python value, made without recording."""
    with t.paused():
        return torch.tensor(x)


def _bind_new(t: Tracer, x: torch.Tensor, v: Value, what: Callable) -> torch.Tensor:
    """Bind v to a tensor holding its example value. A tensor that already has a value (an outer
    tensor returned unchanged, a loop's state after zero iterations) is aliased first, so its old
    binding stays right."""
    if id(x) in t.values:
        with t.paused():
            x = x.detach()
    t._check(what, x, v)
    t.values[id(x)] = v
    t._alive.append(x)
    t.dependent.add(v)
    return x


def _defined_in(t: Tracer, g: Graph, v: Value) -> Value:
    """v as a value of g itself (an Identity when v comes from outside), for g's outputs."""
    if v.graph is g and v.producer is not None:
        return v
    with t.subgraph(g):
        return t.emit("Identity", v)


def _outline(x: Any) -> str:
    """A structure of values for messages (tensors by dtype: their repr would run ops)."""
    leaves, spec = tree_flatten(x)
    return repr(tree_unflatten([_describe(v) for v in leaves], spec))[:120]


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(type(a) is type(b) and a == b)
    except Exception:  # noqa: BLE001 - objects without a plain equality are simply not equal
        return False


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor"
    return f"{type(x).__name__} {x!r:.40}"


# ---------------------------------------------------------------------------- if
def kiln_if(cond: Any, then_fn: Callable[[], Any], else_fn: Callable[[], Any]) -> Any:
    """``then_fn() if cond else else_fn()``, kept as an If node when cond is traced.

    The branch functions take no arguments and return the values of the names the statement
    assigns (a tuple, the same structure in both). Traced, both run on the example values; the
    result is the taken branch's values bound to the If node's outputs.
    """
    t = active_tracer()
    if not _is_traced(t, cond):
        return then_fn() if _truth(t, cond) else else_fn()
    taken = _truth(t, cond)
    c = _cond_value(t, cond)
    recorded = []
    for name, fn in (("then_branch", then_fn), ("else_branch", else_fn)):
        g = t.current.subgraph(name)
        with t.subgraph(g):
            out = fn()
            leaves, spec = tree_flatten(out)
            vals = [t.value(x) if isinstance(x, (torch.Tensor, SymInt)) else None for x in leaves]
        recorded.append((g, out, leaves, spec, vals))
    (g_then, out_then, l_then, s_then, v_then), (g_else, out_else, l_else, s_else, v_else) = recorded
    if s_then != s_else:
        raise ScriptError(f"{t.where()}: the branches of an `if` on tensor data give differently shaped results "
                          f"({_outline(out_then)} vs {_outline(out_else)})")
    result = list(l_then if taken else l_else)
    outputs: list[tuple[int, str]] = []  # (leaf position, kind of value) for each If output
    for k, (a, b) in enumerate(zip(l_then, l_else)):
        kind = _merge_kind(t, k, a, b)
        if kind == "undefined":
            result[k] = UNDEFINED
        elif kind != "python":
            outputs.append((k, kind))
    if outputs:
        then_outs, else_outs = [], []
        for k, kind in outputs:
            for g, leaves, vals, outs in ((g_then, l_then, v_then, then_outs), (g_else, l_else, v_else, else_outs)):
                v = vals[k]
                if v is None:  # a Python int or bool differing between the branches
                    v = t.scalar(leaves[k], DType.BOOL if kind == "bool" else DType.INT64)
                outs.append(_defined_in(t, g, v))
        g_then.outputs, g_else.outputs = then_outs, else_outs
        new = t.emit("If", c, outputs=len(outputs), then_branch=g_then, else_branch=g_else)
        new = (new,) if isinstance(new, Value) else new
        for (k, kind), v in zip(outputs, new):
            x = result[k]
            if kind == "tensor":
                result[k] = _bind_new(t, x, v, kiln_if)
            elif kind == "int":
                result[k] = TracedInt(int(x), t, v)
            else:
                result[k] = _bind_new(t, _example(t, bool(x)), v, kiln_if)
    return tree_unflatten(result, s_then)


def _merge_kind(t: Tracer, k: int, a: Any, b: Any) -> str:
    """How leaf k of the two branches' results merges: 'tensor', 'int' or 'bool' (an If output),
    'python' (equal Python values), 'undefined' (assigned on one path only)."""
    if a is UNDEFINED or b is UNDEFINED:
        return "python" if a is b else "undefined"
    ta, tb = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
    if ta and a is b:
        return "python"  # a tensor from before the `if`, unchanged on both paths
    if ta and tb:
        if a.dtype is not b.dtype:
            raise ScriptError(f"{t.where()}: value {k} of an `if` on tensor data is {_describe(a)} in the then "
                              f"branch and {_describe(b)} in the else branch; the dtypes must agree")
        return "tensor"
    if _bool_flag(a, ta) and _bool_flag(b, tb):
        return "bool"  # a Python bool on one path, a traced 0-d bool on the other: a break flag, say
    if ta or tb:
        raise ScriptError(f"{t.where()}: value {k} of an `if` on tensor data is {_describe(a)} in the then branch "
                          f"and {_describe(b)} in the else branch; make both tensors")
    if _is_int(a) and _is_int(b):
        return "int" if isinstance(a, SymInt) or isinstance(b, SymInt) or int(a) != int(b) else "python"
    if isinstance(a, (bool, np.bool_)) and isinstance(b, (bool, np.bool_)):
        return "python" if bool(a) == bool(b) else "bool"
    if _equal(a, b):
        return "python"
    raise ScriptError(f"{t.where()}: value {k} of an `if` on tensor data is {_describe(a)} in the then branch and "
                      f"{_describe(b)} in the else branch; Python values other than ints and bools must be "
                      "the same on both paths (make it a tensor)")


def _bool_flag(x: Any, is_tensor: bool) -> bool:
    """A Python bool or a 0-d bool tensor (the two forms a flag like ``broke`` takes)."""
    if is_tensor:
        return x.dtype is torch.bool and x.dim() == 0
    return isinstance(x, (bool, np.bool_))


# ---------------------------------------------------------------------------- loops
class _Carried:
    """The plan for one leaf of a loop's state: carried ('tensor' or 'int') or fixed ('python')."""

    def __init__(self, kind: str, relaxed: frozenset = frozenset()):
        self.kind = kind
        self.relaxed = relaxed


def _record_loop(t: Tracer, state: tuple, step: Callable, trips: Optional[Value], cond: Optional[Value],
                 counter: Optional[Callable[[Value], Any]]) -> tuple[list, list[_Carried], Any]:
    """Record a Loop node. ``step(counter_value, state) -> (cond_after or None, new_state)`` runs
    one iteration. Returns the node's outputs, the plan of each state leaf, and the state's spec.

    The body is traced on the initial values; if that iteration changes a carried tensor's shape
    or a Python int, the body is re-traced with those dims symbolic / that int carried.
    """
    leaves, spec = tree_flatten(state)
    plan = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            plan.append(_Carried("tensor"))
        elif isinstance(x, SymInt):
            plan.append(_Carried("int"))
        else:
            plan.append(_Carried("python"))
    for _attempt in range(4):
        body = t.current.subgraph("loop_body")
        retrace = False
        it = _add_input(body, "iter", DType.INT64, [])
        go = _add_input(body, "cond_in", DType.BOOL, [])
        inner = []
        for k, (x, p) in enumerate(zip(leaves, plan)):
            if p.kind == "tensor":
                ty = t.value(x).type
                shape = [f"{body.name}_{k}_{d}" if d in p.relaxed else s for d, s in enumerate(ty.shape)]
                v = _add_input(body, f"carried_{k}", ty.dtype, shape)
                with t.paused():
                    y = x.clone()
                t.values[id(y)] = v
                t._alive.append(y)
                inner.append(y)
            elif p.kind == "int":
                v = _add_input(body, f"carried_{k}", DType.INT64, [])
                inner.append(TracedInt(_plain(t, x), t, v))
            else:
                inner.append(x)
            if p.kind != "python":
                t.dependent.add(v)
        t.dependent.update((it, go))
        with t.subgraph(body):
            c_after, new_state = step(None if counter is None else counter(it), tree_unflatten(inner, spec))
            new_leaves, new_spec = tree_flatten(new_state)
            if new_spec != spec:
                raise ScriptError(f"{t.where()}: a loop body changes the structure of the loop's variables "
                                  f"({_outline(state)} becomes {_outline(new_state)})")
            for k, (x, y, p) in enumerate(zip(leaves, new_leaves, plan)):
                retrace |= _update_plan(t, k, x, y, p)
            if retrace:
                outs = None
            else:
                c_v = t.emit("Identity", go) if c_after is None else _cond_value(t, c_after)
                outs = [c_v] + [t.value(y) if p.kind == "tensor" else t.int_value(y)
                                for y, p in zip(new_leaves, plan) if p.kind != "python"]
        if retrace:
            for node in reversed(body.nodes):
                body.remove_node(node, force=True)
            continue
        body.outputs = [_defined_in(t, body, v) for v in outs]
        inits = [t.value(x) if p.kind == "tensor" else t.int_value(x) for x, p in zip(leaves, plan)
                 if p.kind != "python"]
        if not inits:
            return [], plan, spec
        res = t.emit("Loop", trips, cond, *inits, outputs=len(inits), body=body)
        return ([res] if isinstance(res, Value) else list(res)), plan, spec
    raise ScriptError(f"{t.where()}: the loop's variables keep changing type after 4 traced iterations")


def _add_input(body: Graph, hint: str, dtype: DType, shape: list) -> Value:
    """A body input with a fresh name derived from ``hint`` (Graph.add_input takes exact names)."""
    v = body._new_value(None, TensorType(dtype, shape), hint)
    body.inputs.append(v)
    return v


def _update_plan(t: Tracer, k: int, x: Any, y: Any, p: _Carried) -> bool:
    """Compare leaf k before and after one iteration; widen its plan. True when the body must be
    traced again (a dim to relax, an int to carry)."""
    if p.kind == "tensor":
        if not isinstance(y, torch.Tensor) or y.dtype is not x.dtype or y.dim() != x.dim():
            raise ScriptError(f"{t.where()}: loop variable {k} is {_describe(x)} of rank {x.dim()} before an "
                              f"iteration and {_describe(y)}"
                              f"{f' of rank {y.dim()}' if isinstance(y, torch.Tensor) else ''} after it; a loop "
                              "variable keeps its dtype and rank")
        changed = frozenset(d for d in range(x.dim()) if x.shape[d] != y.shape[d]) - p.relaxed
        p.relaxed |= changed
        return bool(changed)
    if p.kind == "int":
        if not _is_int(y):
            raise ScriptError(f"{t.where()}: loop variable {k} is an int before an iteration and "
                              f"{_describe(y)} after it")
        return False
    if _is_int(x) and _is_int(y):
        if isinstance(y, SymInt) or int(x) != int(y):
            p.kind = "int"
            return True
        return False
    if isinstance(y, torch.Tensor) and x is not y:
        raise ScriptError(f"{t.where()}: loop variable {k} is {_describe(x)} before the loop and a tensor after an "
                          "iteration; initialise it with a tensor before the loop")
    if not _equal(x, y):
        raise ScriptError(f"{t.where()}: loop variable {k} is {_describe(x)} before an iteration and "
                          f"{_describe(y)} after it; only tensors and ints can change in a loop on tensor data")
    return False


def _finish_loop(t: Tracer, outs: list, plan: list[_Carried], spec: Any, final: Any) -> Any:
    """Bind the Loop outputs to the real loop's final state (run eagerly)."""
    leaves, final_spec = tree_flatten(final)
    if final_spec != spec:
        raise ScriptError(f"{t.where()}: the loop's variables changed structure while running")
    result, it = [], iter(outs)
    for x, p in zip(leaves, plan):
        if p.kind == "tensor":
            result.append(_bind_new(t, x, next(it), _record_loop))
        elif p.kind == "int":
            result.append(TracedInt(int(x), t, next(it)))
        else:
            result.append(x)
    return tree_unflatten(result, spec)


def _eager_state(state: tuple) -> tuple:
    """The state with SymInts as plain ints, for a run with the tracer paused."""
    leaves, spec = tree_flatten(state)
    return tree_unflatten([int(x) if isinstance(x, SymInt) else x for x in leaves], spec)


def kiln_while(cond_fn: Callable[..., Any], body_fn: Callable[..., Any], state: tuple) -> tuple:
    """``while cond_fn(*state): state = body_fn(*state)``; a Loop node once the condition is traced.

    While the condition is a Python value the loop runs in Python (unrolled into the trace); from
    the first iteration whose condition is traced, the rest is one Loop node.
    """
    t = active_tracer()
    state = tuple(state)
    while True:
        c = cond_fn(*state)
        if _is_traced(t, c):
            break
        if not _truth(t, c):
            return state
        state = tuple(body_fn(*state))

    def step(_: Any, st: tuple) -> tuple:
        new = tuple(body_fn(*st))
        return cond_fn(*new), new

    outs, plan, spec = _record_loop(t, state, step, None, _cond_value(t, c), None)
    with t.paused():
        final = _eager_state(state)
        while bool(cond_fn(*final)):
            final = tuple(body_fn(*final))
    return _finish_loop(t, outs, plan, spec, final)


def kiln_for_range(start: Any, stop: Any, step: Any, body_fn: Callable[..., Any], state: tuple) -> tuple:
    """``for i in range(start, stop, step): state = body_fn(i, *state)``.

    With Python-int bounds (or constant tensors) the loop is unrolled, as the tracer would; a
    traced bound (``x.size(1)`` of a dynamic dim, a tensor computed from the inputs) gives a Loop
    with trip count ``max(0, ceil((stop - start) / step))``; ``i`` is then a :class:`TracedInt`.
    ``step`` must be known when tracing.
    """
    t = active_tracer()
    state = tuple(state)
    if not any(_is_traced(t, b) for b in (start, stop, step)):
        for i in range(_plain(t, start), _plain(t, stop), _plain(t, step)):
            state = tuple(body_fn(i, *state))
        return state
    if _is_traced(t, step):
        raise ScriptError(f"{t.where()}: the step of a `range` with a data-dependent bound must be known when "
                          "scripting (a Python int or a static size)")
    k = _plain(t, step)
    if k == 0:
        raise ValueError("range() arg 3 must not be zero")
    lo, hi = _int64(t, start), _int64(t, stop)
    span = t.emit("Sub", hi, lo) if k > 0 else t.emit("Sub", lo, hi)
    span = t.emit("Add", span, t.scalar(abs(k) - 1, DType.INT64))
    trips = t.emit("Max", t.emit("Div", span, t.scalar(abs(k), DType.INT64)), t.scalar(0, DType.INT64))
    first = _plain(t, start)

    def counter(it: Value) -> TracedInt:
        v = t.emit("Add", lo, t.emit("Mul", it, t.scalar(k, DType.INT64)))
        return TracedInt(first, t, v)

    def one(i: Any, st: tuple) -> tuple:
        return None, tuple(body_fn(i, *st))

    outs, plan, spec = _record_loop(t, state, one, trips, None, counter)
    with t.paused():
        final = _eager_state(state)
        for i in range(first, _plain(t, stop), k):
            final = tuple(body_fn(i, *final))
    return _finish_loop(t, outs, plan, spec, final)


def _int64(t: Tracer, x: Any) -> Value:
    """A loop bound as an int64 scalar value."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype.is_floating_point or x.dtype is torch.bool:
            raise ScriptError(f"{t.where()}: a `range` bound must be an integer scalar, got {_describe(x)} of "
                              f"shape {tuple(x.shape)}")
        v = t.value(x, DType.INT64)
        return v if v.type.shape == () else t.emit("Reshape", v, t.constant(np.zeros(0, np.int64), "shape"))
    return t.int_value(x)


def kiln_for_iter(iterable: Any, body_fn: Callable[..., Any], state: tuple) -> tuple:
    """``for item in iterable: state = body_fn(item, *state)``.

    Modules, tuples, lists (anything but a tensor) are unrolled. A tensor is iterated over dim 0:
    unrolled when that dim is static, a Loop (items gathered by the counter) when it is symbolic.
    """
    state = tuple(state)
    if isinstance(iterable, torch.Tensor):
        if iterable.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        return kiln_for_range(0, iterable.size(0), 1, lambda i, *st: body_fn(iterable[i], *st), state)
    for item in iterable:
        state = tuple(body_fn(item, *state))
    return state


def kiln_assert(cond: Any, message: Any = None) -> None:
    """``assert cond, message``. A Python condition (or one that does not depend on the inputs)
    is a plain assert. A traced condition becomes a ``kiln.Assert`` node (kiln/ir/ops/assertion.py),
    so the graph checks it on every run: all its elements must be true. The node's ``location`` is
    the assert's ``file:line`` and source, read from the caller's frame (the rewritten code keeps
    the original file and line numbers). In the root graph the example must pass it too (the
    statement is reached unconditionally, so a failing example is the caller's error, raised
    now); inside an If branch or a Loop body it is not checked while tracing: both branches are
    traced on the example, and a loop body on the initial state, even where eager Python would
    not run them."""
    t = active_tracer()
    if not _is_traced(t, cond):
        if not _truth(t, cond):
            raise AssertionError(message) if message is not None else AssertionError()
        return
    caller = sys._getframe(1)
    source = linecache.getline(caller.f_code.co_filename, caller.f_lineno).strip()
    scope = t.scope_name()
    location = t.source_line() + (f" in {scope}" if scope else "") + (f": {source}" if source else "")
    if t.current is t.graph and not _truth(t, cond):
        raise AssertionError(message) if message is not None else AssertionError()
    if isinstance(cond, torch.Tensor):
        c = _cond_value(t, cond)  # one element, as Python's `assert` on a tensor requires
    else:
        c = t.emit("Cast", t.int_value(cond), to=DType.BOOL.value)
    t.emit("Assert", c, outputs=0, domain="kiln", message="" if message is None else str(message),
           location=location)
