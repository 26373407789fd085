"""The recorder behind ``kiln.trace``: a TorchFunctionMode that runs the model eagerly and
writes every tensor operation it performs into a kiln Graph.

Each intercepted call is looked up in the mapping table (frontend/torch_ops.py):
- mapped: the call runs eagerly (the model sees real tensors) and the handler emits the IR
  ops computing the same result; the IR's inferred type is checked against the real output,
  so a wrong mapping fails at the op that has it, not at the end;
- not mapped, a Python function (e.g. ``F.multi_head_attention_forward``): it is re-run with
  the recorder active, so its inner operations are recorded one by one;
- not mapped, returns no tensor (``x.dim()``, ``x.dtype``): passed through;
- not mapped otherwise: UnsupportedOpError naming the torch op, module path and source line.
Reading Python values out of tensor data (``bool(t)``, ``t.item()``, ``t.tolist()``, a symbolic
size compared in Python, ...) bakes the example's value into the graph. Each such read is
reported as a TraceWarning with the source line and, unless guards are off, leaves a
``kiln.Guard`` in the graph (kiln/ir/ops/guard.py): the graph recomputes the value on every run
and refuses an input that gives another one, instead of answering wrong.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from kiln import checks
from kiln.errors import KilnError, TraceWarning, UnsupportedOpError
from kiln.frontend.symbolic import SymInt
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value
from kiln.ir.passes.shape_inference import infer_node
from kiln.ir.types import TensorType

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRONTEND_DIR = os.path.dirname(__file__)
_KILN_INIT = os.path.join(os.path.dirname(_FRONTEND_DIR), "__init__.py")  # the kiln.trace wrapper


def inside(path: str, *dirs: str) -> bool:
    """Whether file ``path`` lies in one of the folders ``dirs``, compared by path components: torchvision's
    .../site-packages/torchvision/ is not inside .../site-packages/torch (a string-prefix test said it was, so errors
    named the caller's line instead of torchvision's, issue 24)."""
    return any(path == d or path.startswith(d.rstrip("/" + os.sep) + os.sep) for d in dirs)


def _library_frame(path: str) -> bool:
    """Frames that are not the model's own code: torch's, kiln's frontend and kiln.trace's wrapper, frozen modules."""
    return inside(path, _TORCH_DIR, _FRONTEND_DIR) or path == _KILN_INIT or "<frozen" in path

TORCH_TO_DTYPE = {torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
                  torch.float64: DType.FLOAT64, torch.int8: DType.INT8, torch.int16: DType.INT16,
                  torch.int32: DType.INT32, torch.int64: DType.INT64, torch.uint8: DType.UINT8, torch.bool: DType.BOOL}


def kiln_dtype(t: torch.dtype) -> DType:
    if t not in TORCH_TO_DTYPE:
        raise UnsupportedOpError(f"tensors of dtype {t} are not supported; kiln supports "
                                 f"{', '.join(str(k).replace('torch.', '') for k in TORCH_TO_DTYPE)}")
    return TORCH_TO_DTYPE[t]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.BFLOAT16.numpy).copy()
    return t.numpy().copy()


def op_name(func: Callable) -> str:
    """``torch.nn.functional.linear``, ``Tensor.view``: how errors and warnings name a torch op."""
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if "getset_descriptor" in repr(func):
        qual = f"Tensor.{getattr(getattr(func, '__self__', None), '__name__', '?')}"
    qual = qual.replace("TensorBase.", "Tensor.").replace("_VariableFunctionsClass.", "torch.")
    module = getattr(func, "__module__", None) or "torch"
    if qual.startswith(("torch.", "Tensor.")):
        return qual
    return f"{module}.{qual}" if module.startswith("torch") else qual


# The tracers recording now, innermost last; ``None`` marks a pause (see Tracer.paused). The
# control-flow primitives (frontend/script_ops.py) ask active_tracer() whether they are traced.
_ACTIVE: list[Optional["Tracer"]] = []


def active_tracer() -> Optional["Tracer"]:
    """The tracer recording the code running now, or None (eager, or a paused tracer)."""
    return _ACTIVE[-1] if _ACTIVE else None


class Tracer(TorchFunctionMode):
    """Records one eager run of a model into ``self.graph``.

    Nodes go to ``self.current``: the root graph, or the If branch / Loop body being recorded
    (:meth:`subgraph`). Constants and parameters always go to the root graph, which every
    subgraph may read.
    """

    def __init__(self, graph: Graph, param_names: dict[int, str], module_names: dict[int, str], *,
                 guards: bool = True):
        super().__init__()
        self.graph = graph
        self.guards = guards  # leave a kiln.Guard where the model reads a Python value from tensor data
        self._guarded: set = set()  # (value, read, expected value): one guard per distinct read
        self._warned: set = set()  # (source line, what): one TraceWarning per line and kind of read
        self.current = graph
        self.param_names = param_names
        self.module_names = module_names
        self.values: dict[int, Value] = {}
        self._alive: list[torch.Tensor] = []  # keeps traced tensors alive so their ids stay unique
        self.dependent: set[Value] = set()  # values computed from the graph inputs
        self.scope: list[str] = []
        self.warnings: list[str] = []
        self._const_cache: dict[tuple, Value] = {}
        self.symbols: dict = {}  # symbolic values of shape tensors, so dims stay exact while tracing
        # Tensors changed by a write through an alias: (why using them fails, id of the tensor written).
        self.stale: dict[int, tuple[str, int]] = {}
        # Views made by basic indexing (``x[a:b]``, ``x[:, 0]``): id of the view -> (its base, the
        # index). An in-place write to such a view is written back into its base (``_write_back``).
        self.views: dict[int, tuple[torch.Tensor, Any]] = {}
        self._by_storage: dict[int, list[torch.Tensor]] = {}  # storage address -> traced tensors on it

    def __enter__(self) -> "Tracer":
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        _ACTIVE.pop()
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self):
        """Run code eagerly without recording (the real loop of a traced while: its result
        tensors are bound to the Loop node afterwards). active_tracer() is None meanwhile."""
        _ACTIVE.append(None)
        try:
            with torch._C.DisableTorchFunction():
                yield
        finally:
            _ACTIVE.pop()

    @contextlib.contextmanager
    def subgraph(self, g: Graph):
        """Record into ``g`` (an If branch or Loop body nested in the current graph) and restore.

        Tensors of enclosing graphs keep their values: the body reads them directly, as ONNX
        allows. Tensors made inside are bound to ``g``'s values only until the block ends (the
        caller reads the body's outputs before that), so nothing after it can use a value of
        ``g``. An in-place write to an outer tensor inside the body would change it in eager
        Python but not in the graph: UnsupportedOpError.
        """
        if g.parent is not self.current:
            raise KilnError(f"subgraph '{g.name}' is not nested in the graph being recorded")
        outer, saved_values, saved_stale = self.current, dict(self.values), dict(self.stale)
        self.current = g
        ok = False
        try:
            yield g
            ok = True
        finally:
            self.current = outer
            written = [k for k, v in saved_values.items() if self.values.get(k) is not v]
            # Constants and parameters met first inside live in the root graph: still in scope.
            saved_values.update((k, v) for k, v in self.values.items()
                                if k not in saved_values and v.graph.is_ancestor_of(outer))
            self.values, self.stale = saved_values, saved_stale
            if ok and written:
                raise UnsupportedOpError(
                    f"{self.where()}: a tensor from outside a data-dependent branch or loop body is written in "
                    "place inside it ('x += y', 'x.add_(y)', 'x[i] = v'); assign a new tensor instead "
                    "('x = x + y')")

    # ------------------------------------------------------------------ the interception point
    def __torch_function__(self, func: Callable, types: Any, args: Sequence = (), kwargs: Optional[dict] = None) -> Any:
        from kiln.frontend.torch_ops import DATA_DEPENDENT, TABLE

        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3:
            written = self.stale.get(id(args[0]))
            if written is not None and written[1] == id(args[2]):
                # ``y[i] += v``: the view written in place is stored back into its base, which is
                # then up to date again (the __setitem__ mapping computes the new base).
                del self.stale[id(args[0])]
        entry = TABLE.get(func)
        if entry is not None:
            handler, returns_value = entry
            res = func(*args, **kwargs)
            if returns_value:
                return handler(self, res, *args, **kwargs)
            self.bind(func, res, handler(self, res, *args, **kwargs))
            if args and res is args[0] and _writes_in_place(func):
                self.invalidate_aliases(res, f"it shares memory with a tensor written in place by "
                                             f"'{op_name(func)}' at {self.where()}")
            if args and isinstance(args[0], torch.Tensor) and (func is torch.Tensor.__setitem__ or (
                    res is args[0] and _writes_in_place(func))):
                self._write_back(args[0])
            elif func is torch.Tensor.__getitem__ and isinstance(res, torch.Tensor):
                self._note_view(res, args[0], args[1])
            return res
        if func in DATA_DEPENDENT:
            out = func(*args, **kwargs)
            self.data_dependent(func, args, kwargs, out)
            return out
        if _is_python_function(func):
            with self:
                return _redispatch(func, types, args, kwargs)
        out = func(*args, **kwargs)
        if not any(isinstance(t, torch.Tensor) for t in _flatten(out)):
            return out
        raise UnsupportedOpError(
            f"{self.where()}: op '{op_name(func)}' is not supported by kiln's tracer; add a mapping to the "
            "table in kiln/frontend/torch_ops/ (one decorated function, with its unit test)")

    # ------------------------------------------------------------------ values
    def value(self, x: Any, dtype: Optional[DType] = None) -> Value:
        """The IR value of a tensor (traced, parameter or constant) or a Python scalar.

        Scalars become constants of ``dtype``; SymInts become their traced value, cast to ``dtype``.
        """
        if isinstance(x, torch.Tensor):
            if id(x) in self.stale:
                raise UnsupportedOpError(f"{self.where()}: {self.stale[id(x)][0]}")
            v = self.values.get(id(x))
            if v is None:
                v = self._constant_tensor(x)
            if dtype is not None and v.type.dtype is not dtype:
                v = self.emit("Cast", v, to=dtype.value)
            return v
        if isinstance(x, SymInt):
            v = x.value
            return v if dtype in (None, DType.INT64) else self.emit("Cast", v, to=dtype.value)
        if isinstance(x, (bool, int, float, np.number)):
            return self.scalar(x, dtype)
        raise KilnError(f"{self.where()}: cannot use {type(x).__name__} {x!r:.40} as a tensor operand")

    def scalar(self, x: Any, dtype: Optional[DType] = None) -> Value:
        if dtype is None:
            dtype = DType.BOOL if isinstance(x, bool) else DType.INT64 if isinstance(x, int) else DType.FLOAT32
        return self.constant(np.array(x, dtype=dtype.numpy), "scalar")

    def constant(self, array: np.ndarray, hint: str = "const") -> Value:
        """A constant (small ones are shared: the same scalar is one initializer)."""
        if array.size <= 16:
            key = (array.dtype.str, array.shape, array.tobytes())
            if key not in self._const_cache:
                self._const_cache[key] = self.graph.add_constant(array, hint)
            return self._const_cache[key]
        return self.graph.add_constant(array, hint)

    def int_value(self, x: Any) -> Value:
        """An int64 scalar value of an int, a SymInt or a one-element integer tensor (for shape
        arithmetic). A tensor keeps its traced value: ``int(t)`` here would bake the example's value
        without a guard, since the tracer does not see reads made inside its own handlers (code
        written for torch.jit.trace passes sizes as 0-dim tensors: MobileViT's
        ``reshape(batch * channels * num_patch_height, ...)``)."""
        if isinstance(x, SymInt):
            return x.value
        if isinstance(x, torch.Tensor):
            if x.numel() != 1 or x.dtype.is_floating_point or x.dtype.is_complex:
                raise UnsupportedOpError(f"{self.where()}: a size given as a tensor must hold one integer, "
                                         f"got {x.dtype} of shape {tuple(x.shape)}")
            v = self.value(x)
            if v.type.dtype is not DType.INT64:
                v = self.emit("Cast", v, to=DType.INT64.value)
            if x.dim():
                v = self.emit("Reshape", v, self.constant(np.array([], np.int64), "shape"))
            return v
        return self.constant(np.array(int(x), np.int64), "dim")

    def shape_value(self, dims: Iterable[Any]) -> Value:
        """A 1-D int64 shape tensor from ints, SymInts and one-element integer tensors (constant when
        all are plain ints)."""
        dims = list(dims)
        if not any(isinstance(d, (SymInt, torch.Tensor)) for d in dims):
            return self.constant(np.array([int(d) for d in dims], np.int64), "shape")
        parts = [self.emit("Unsqueeze", self.int_value(d), self.constant(np.array([0], np.int64), "axes"))
                 for d in dims]
        return self.emit("Concat", *parts, axis=0)

    def _constant_tensor(self, t: torch.Tensor) -> Value:
        name = self.param_names.get(id(t))
        if name is not None:
            v = self.graph.add_initializer(name, to_numpy(t))
        else:
            v = self.graph.add_constant(to_numpy(t), "const")
        self.values[id(t)] = v
        self._alive.append(t)
        return v

    # ------------------------------------------------------------------ emitting
    def emit(self, op: str, *inputs: Optional[Value], outputs: int = 1, domain: str = "", **attrs: Any) -> Any:
        node = self.current.add_node(op, inputs, attrs, domain=domain, num_outputs=outputs,
                                   meta={"scope": self.scope_name(), "source": self.source_line()})
        infer_node(node, self.symbols)
        if any(v is not None and v in self.dependent for v in inputs):
            self.dependent.update(node.outputs)
        return node.outputs[0] if outputs == 1 else tuple(node.outputs)

    def bind(self, func: Callable, out: Any, values: Any) -> None:
        tensors = [t for t in _flatten(out)]
        vals = [values] if isinstance(values, Value) else list(values)
        if len(tensors) != len(vals):
            raise KilnError(f"{self.where()}: the mapping of '{op_name(func)}' gave {len(vals)} values for "
                            f"{len(tensors)} tensors")
        for t, v in zip(tensors, vals):
            if not isinstance(t, torch.Tensor):
                continue
            self._check(func, t, v)
            self.values[id(t)] = v
            self._alive.append(t)
            ptr = t.untyped_storage().data_ptr()
            if ptr:
                same = self._by_storage.setdefault(ptr, [])
                if not any(o is t for o in same[-4:]):  # a tensor rebound by an in-place op is listed once
                    same.append(t)

    def invalidate_aliases(self, x: torch.Tensor, why: str) -> None:
        """After an in-place write to x, the other traced tensors sharing its memory (its views, its
        base) hold values the graph no longer computes: using one raises UnsupportedOpError(why)."""
        ptr = x.untyped_storage().data_ptr()
        if ptr == 0:
            return
        for other in self._by_storage.get(ptr, ()):
            if other is not x:
                self.stale.setdefault(id(other), (why, id(x)))

    def _note_view(self, view: torch.Tensor, base: Any, index: Any) -> None:
        """Remember ``view = base[index]`` when it is a view (basic indexing, no tensor in the index)."""
        items = index if isinstance(index, tuple) else (index,)
        if (not isinstance(base, torch.Tensor) or any(isinstance(i, torch.Tensor) for i in items)
                or id(base) not in self.values or view.untyped_storage().data_ptr() == 0
                or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()):
            return
        self.views[id(view)] = (base, index)

    def _write_back(self, x: torch.Tensor) -> None:
        """x, a view of a traced tensor, was just written in place (``x[a:b].zero_()``,
        ``x[0].add_(1)``, ``x[:, 0][mask] = v``): store its new value into its base, and the base's into
        its own base, so they stay up to date instead of stale. Other views of the same memory stay
        stale (the graph does not follow them). A base already stale for another reason is left so."""
        from kiln.frontend.torch_ops.assign import assign

        written = id(x)
        while id(x) in self.views:
            base, index = self.views[id(x)]
            mark = self.stale.get(id(base))
            if mark is None or mark[1] != written or id(base) not in self.values:
                return
            del self.stale[id(base)]
            self.bind(torch.Tensor.__setitem__, base, assign(self, base, index, x))
            x = base

    def _check(self, func: Callable, t: torch.Tensor, v: Value) -> None:
        want = TensorType(kiln_dtype(t.dtype), tuple(t.shape))
        got = v.type
        ok = got is not None and got.dtype is want.dtype and (
            got.shape is None or (len(got.shape) == len(want.shape) and all(
                not isinstance(g, int) or g == w for g, w in zip(got.shape, want.shape))))
        if not ok:
            raise KilnError(f"{self.where()}: kiln's mapping of '{op_name(func)}' gives {got}, "
                            f"torch gives {want} (a bug in the mapping table, kiln/frontend/torch_ops/)")

    def data_dependent(self, func: Callable, args: Sequence, kwargs: dict, out: Any) -> None:
        """The model read ``out`` (a Python value) from tensor data through ``func``: warn and,
        when the tensor depends on the inputs, guard the read (see :meth:`guard`)."""
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        v = self.values.get(id(t)) if t is not None else None
        others = [self.values.get(id(a)) for a in args[1:3] if isinstance(a, torch.Tensor)]
        if not any(x is not None and x in self.dependent for x in [v, *others]):
            return  # constants: reading them does not tie the trace to the inputs
        read = _READS.get(func)
        if func is torch.Tensor.__len__:
            if not self._guard_len(t, out):
                return  # a static dim 0: nothing read from the inputs
        elif func in (torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose):
            self._guard_comparison(func, args, kwargs, out)
        elif func is torch.Tensor.__contains__:
            tv = self.value(t)  # the element may be what depends on the inputs
            hit = self.emit("Equal", tv, self.value(args[1], tv.type.dtype))
            found = self.emit("ReduceMax", self.emit("Cast", hit, to=DType.INT32.value), keepdims=0)
            self.guard(found, "bool", np.array(bool(out)), "'element in tensor'")
        elif read == "value":
            self.guard(v, read, to_numpy(t), _READ_NAMES[func])
        elif read == "item":
            self.guard(v, read, np.asarray(out, dtype=kiln_dtype(t.dtype).numpy), _READ_NAMES[func])
        elif read is not None:
            self.guard(v, read, np.asarray(out), _READ_NAMES[func])
        self._warn_read(f"'{op_name(func)}' reads a Python value from tensor data")

    def _warn_read(self, what: str) -> None:
        """One TraceWarning per source line and kind of read (a layer repeated 12 times reads at
        the same line 12 times: one warning says it)."""
        tail = ("a kiln.Guard in the graph refuses inputs that give another value" if self.guards else
                "guards are off, so the graph may answer wrong for inputs that give another value")
        frame = self._user_frame()
        key = (self.source_line(), what)
        if key in self._warned:
            return
        self._warned.add(key)
        msg = f"{self.where()}: {what}; the trace records this example's value and {tail}"
        self.warnings.append(msg)
        if frame is None:
            warnings.warn(msg, TraceWarning, stacklevel=3)
        else:  # attributed to the model's line, so warning filters and the printed location are the user's
            warnings.warn_explicit(msg, TraceWarning, frame.f_code.co_filename, frame.f_lineno,
                                   module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault(
                                       "__warningregistry__", {}))

    def guard(self, v: Value, read: str, expected: np.ndarray, what: str) -> None:
        """Emit a ``kiln.Guard`` checking that ``read`` of ``v`` equals ``expected`` on every run,
        once per distinct (value, read, expected) in the graph being recorded."""
        if not self.guards or v not in self.dependent:
            return
        expected = np.asarray(expected)
        if read in ("bool", "int", "float"):
            expected = expected.astype({"bool": np.bool_, "int": np.int64, "float": np.float64}[read])
        key = (v, read, expected.dtype.str, expected.shape, expected.tobytes())
        if key in self._guarded:
            return
        self._guarded.add(key)
        frame = self._user_frame()
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() if frame is not None else ""
        scope = self.scope_name()
        location = self.source_line() + (f" in {scope}" if scope else "")
        rtol = checks.FLOAT_RTOL if expected.dtype.kind in "fc" else 0.0
        self.emit("Guard", v, outputs=0, domain="kiln", expected=expected, read=read, rtol=rtol, what=what,
                  location=location, code=code[:200])

    def _guard_len(self, t: torch.Tensor, out: int) -> bool:
        """``len(t)`` is dim 0: a guard only when that dim is symbolic in the graph (returns whether)."""
        v = self.values.get(id(t))
        if v is None or v.type.shape is None or not v.type.shape or isinstance(v.type.shape[0], int):
            return False
        size = self.emit("Shape", v, start=0, end=1)
        self.dependent.add(size)
        self.guard(size, "value", np.array([out], np.int64), "len(tensor)")
        return True

    def _guard_comparison(self, func: Callable, args: Sequence, kwargs: dict, out: bool) -> None:
        """``torch.equal(a, b)`` / ``torch.allclose(a, b, ...)``, recomputed in the graph."""
        a, b = args[0], args[1]
        if tuple(a.shape) != tuple(b.shape) and func in (torch.equal, torch.Tensor.equal):
            return  # a size mismatch answers False whatever the data
        va, vb = self.value(a, DType.FLOAT64), self.value(b, DType.FLOAT64)
        if func in (torch.equal, torch.Tensor.equal):
            ok = self.emit("Equal", va, vb)
        else:
            bound = {**dict(zip(("input", "other", "rtol", "atol", "equal_nan"), args)), **kwargs}
            tol = self.emit("Add", self.scalar(float(bound.get("atol", 1e-8)), DType.FLOAT64),
                            self.emit("Mul", self.scalar(float(bound.get("rtol", 1e-5)), DType.FLOAT64),
                                      self.emit("Abs", vb)))
            ok = self.emit("LessOrEqual", self.emit("Abs", self.emit("Sub", va, vb)), tol)
            if bound.get("equal_nan", False):
                ok = self.emit("Or", ok, self.emit("And", self.emit("IsNaN", va), self.emit("IsNaN", vb)))
        every = self.emit("ReduceMin", self.emit("Cast", ok, to=DType.INT32.value), keepdims=0)
        self.guard(every, "bool", np.array(bool(out)), f"'{op_name(func)}'")

    def compared_size(self, a: Any, b: Any, op: str, result: bool, caller: Any) -> None:
        """A symbolic size compared in Python (``if x.size(1) > 8``, ``max(n, 8)``), by the model or
        by torch's Python code it calls: the example's answer is baked in, so guard it (called by
        SymInt's comparisons). Comparisons in kiln's own mappings, and those torch makes while
        running an op (the recorder is off then), are not the model's reads."""
        if not self.guards or active_tracer() is not self or not torch._C._is_torch_function_mode_enabled():
            return
        path = caller.f_code.co_filename if caller is not None else ""
        if inside(path, _FRONTEND_DIR) or path == _KILN_INIT:
            return
        x = a.value if hasattr(a, "value") else self.int_value(a)
        if isinstance(b, float):
            x, y = self.emit("Cast", x, to=DType.FLOAT64.value), self.scalar(b, DType.FLOAT64)
        else:
            y = b.value if hasattr(b, "value") else self.int_value(b)
            same = self.symbols.get(x)
            if same is not None and same == self.symbols.get(y) and all(isinstance(d, str) for d in same):
                return  # the same symbolic size on both sides (one size per run): always the same answer
        onnx_op, negate = _SIZE_COMPARE[op]
        c = self.emit(onnx_op, x, y)
        if negate:
            c = self.emit("Not", c)
        self.dependent.add(c)
        what = f"a symbolic size compared with '{_COMPARE_SYMBOLS[op]}'"
        in_torch = inside(path, _TORCH_DIR)
        if in_torch:
            what += f" in torch's {'/'.join(path.replace(os.sep, '/').split('/')[-2:])}:{caller.f_lineno}"
        self.guard(c, "bool", np.array(result), what)
        if not in_torch:
            # torch's own Python (shape checks in F.multi_head_attention_forward, ...) is guarded and
            # listed by `kiln inspect`, but is not worth a warning about the user's model.
            self._warn_read(what)

    @staticmethod
    def _user_frame():
        """The innermost frame of the model's own code (not torch's, not kiln's), or None."""
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            if not _library_frame(path):
                return frame
            frame = frame.f_back
        return None

    # ------------------------------------------------------------------ where we are
    def scope_name(self) -> str:
        return self.scope[-1] if self.scope else ""

    def source_line(self) -> str:
        frame = sys._getframe(1)
        while frame is not None:
            path = frame.f_code.co_filename
            if not _library_frame(path):
                parts = path.replace("\\", "/").split("/")
                return f"{'/'.join(parts[-2:])}:{frame.f_lineno}"
            frame = frame.f_back
        return ""

    def where(self) -> str:
        scope = self.scope_name() or "<model>"
        src = self.source_line()
        return f"{scope} ({src})" if src else scope

    # ------------------------------------------------------------------ module scopes
    def push_module(self, module: torch.nn.Module, *_: Any) -> None:
        self.scope.append(self.module_names.get(id(module), type(module).__name__))

    def pop_module(self, module: torch.nn.Module, *_: Any) -> None:
        if self.scope:
            self.scope.pop()


# How each data-dependent read reads: see kiln.checks.READS.
_READS = {torch.Tensor.__bool__: "bool", torch.is_nonzero: "bool", torch.Tensor.is_nonzero: "bool",
          torch.Tensor.__int__: "int", torch.Tensor.__index__: "int", torch.Tensor.__float__: "float",
          torch.Tensor.item: "item", torch.Tensor.tolist: "value", torch.Tensor.numpy: "value",
          torch.Tensor.__array__: "value"}
_READ_NAMES = {torch.Tensor.__bool__: "bool(tensor)", torch.Tensor.__int__: "int(tensor)",
               torch.Tensor.__index__: "a tensor used as an index", torch.Tensor.__float__: "float(tensor)",
               torch.Tensor.item: "tensor.item()", torch.Tensor.tolist: "tensor.tolist()",
               torch.Tensor.numpy: "tensor.numpy()", torch.Tensor.__array__: "a tensor as a numpy array"}
_SIZE_COMPARE = {"lt": ("Less", False), "le": ("LessOrEqual", False), "gt": ("Greater", False),
                 "ge": ("GreaterOrEqual", False), "eq": ("Equal", False), "ne": ("Equal", True)}
_COMPARE_SYMBOLS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _flatten(x: Any) -> list:
    if isinstance(x, (tuple, list)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def _writes_in_place(func: Callable) -> bool:
    """``add_``, ``relu_``, ``__iadd__``: torch's naming of ops that write into their first argument."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or (name.startswith("__i") and name.endswith("__"))


def _redispatch(func, types, args, kwargs):
    """Call ``func`` skipping one level of ``__torch_function__`` dispatch, so a Python composite
    runs its body with the tracer still active: torch's redispatch hook where this torch has one,
    else the function's own body past its has_torch_function guard (frontend/compat.py)."""
    from kiln.frontend.compat import redispatch

    return redispatch(func, types, args, kwargs)


def _is_python_function(func: Callable) -> bool:
    return hasattr(func, "__code__")
