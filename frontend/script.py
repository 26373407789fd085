"""``kiln.script``: keep a model's data-dependent ``if``/``while``/``for`` as IR control flow.

Tracing records the one path the example inputs take. ``kiln.script`` first rewrites the Python
source of ``forward`` (AutoGraph-style, with :mod:`ast`) so that every control-flow statement
becomes a call to a control-flow primitive (frontend/script_ops.py), and then traces the
rewritten code with kiln's tracer. The primitives decide at trace time: a condition that is a
Python value (a flag, ``x is None``, a static shape) runs only the branch taken, exactly as the
original Python would; a condition on tensor data records both branches as an ``If`` node, a
loop over tensor data a ``Loop`` node. So the scripter accepts whatever Python the tracer
accepts, plus control flow on tensors, and it reuses the tracer's whole torch -> IR mapping.

Why rewrite the source instead of compiling it ourselves: the rewritten function is still
Python, it runs eagerly (the primitives just run Python when nothing is traced), and every
expression keeps its Python meaning; only statements change shape. The rewrites are:

- ``if c: A else: B`` -> two closures returning the names the statement assigns that are used
  later, and ``n1, n2 = kiln_if(c, then, else)``. The closures take the names the branches
  rebind as parameters, so running both branches (as tracing a tensor condition does) cannot
  leak an assignment of one into the other.
- ``return`` inside branches (early return) -> the rest of the block moves into the branches
  that fall through, every path assigns one return variable, and the function ends in a single
  ``return``.
- ``while c: B`` -> ``state = kiln_while(cond, body, state)``; ``for i in range(...)`` ->
  ``kiln_for_range``; ``for x in <other>`` -> ``kiln_for_iter``. The loop-carried state is
  the names the body assigns that are defined before the loop, read after it, or read in the
  body before being assigned (carried from the previous iteration).
- ``break``/``continue`` -> flags (carried in the loop state) that guard the rest of the body;
  ``while`` also stops on the break flag; a loop's ``else`` runs when the flag is unset.
- ``assert`` -> ``kiln_assert``; ``a if c else b`` -> ``kiln_if``; ``and``/``or``/``not`` and
  chained comparisons in conditions -> helpers that combine tensors with logical ops (Python's
  own operators would read a bool out of the tensor) and short-circuit on Python values
  (``kiln_not``/``kiln_and``/``kiln_or`` of the primitives' module when it has them).
- ``with torch.no_grad()`` -> its body (scripting records no gradients anyway).

Constructs whose meaning the closures cannot preserve (``try``, other ``with`` blocks,
generators, ``global``/``nonlocal``, ``del``, ``return`` inside a loop, ...) raise
:class:`~kiln.errors.ScriptError` naming the file, line and column, with the source line, a
caret and what to do instead. Rewritten nodes keep the original line numbers and the code is
compiled under the original file name, so tracer errors and tracebacks point at user lines.

Methods the rewritten code calls as ``self.method(...)`` and module-level functions of the same
module called by name are rewritten too (recursively), and so are submodules: every user module
below the scripted one (torch.nn's own modules run their library code, which holds no control flow
on tensor data; a torch container such as ``nn.Sequential`` is copied when user modules sit in
it). The user's model is never changed: the rewritten methods are bound to shallow copies that
share parameters, buffers and hooks, so the tracer names parameters as in the original.

Hybrid: ``kiln.script(obj)`` without example inputs compiles nothing; it marks a module class
(``@kiln.script``), a module instance or a function (:func:`mark`). Marked code runs its original
Python eagerly, and its rewritten code while kiln.trace records, so tracing a whole model keeps
the marked parts' control flow (as scripted functions survive inside ``torch.jit.trace``).
"""
from __future__ import annotations

import ast
import copy
import functools
import inspect
import itertools
import linecache
import types
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

from kiln.errors import ScriptError

# The one global name the rewritten code uses: a namespace with the primitives and helpers.
_NS = "__kiln__"
_RET = "__kiln_ret"
_PRIMITIVES = ("kiln_if", "kiln_while", "kiln_for_range", "kiln_for_iter", "kiln_assert", "UNDEFINED")
_NO_GRAD = {"no_grad", "inference_mode"}


# ============================================================================ public API
def script(module_or_function: Any, example_inputs: Any = None, *, dynamic=None, dynamic_batch: bool = False,
           check: bool = True, optimize: bool = True, name: Optional[str] = None, rtol: float = 1e-4,
           atol: float = 1e-5, guards: bool = True, ranges=None):
    """Script ``module_or_function`` into a kiln Graph, keeping control flow on tensor data.

    The source of ``forward`` (or of the function) is rewritten so ``if``/``while``/``for`` call
    kiln's control-flow primitives, then traced with :func:`kiln.trace` on ``example_inputs``
    (``dynamic``/``dynamic_batch`` as there). Submodules are scripted recursively (torch.nn's own
    modules run as they are: their Python holds no data-dependent control flow). With ``check``,
    the graph is compared with the *original* model on the examples and on fresh inputs (a
    data-dependent branch is fine: the eager model runs its real Python). ``optimize`` runs the
    pass pipeline. ``guards``, ``ranges``, ``rtol`` and ``atol`` are kiln.trace's: in scripted code,
    ``bool(t)``, ``int(t)``, ``float(t)`` and ``t.item()`` inside an ``if``/``while`` condition (or a
    ``range`` bound) stay tensor conditions; elsewhere such reads are guarded as in a trace.

    Without ``example_inputs`` nothing is compiled: ``module_or_function`` is *marked* for the
    hybrid mode and returned (see :func:`mark`), so ``@kiln.script`` decorates a module class or
    a function, and ``kiln.script(model.head)`` marks one submodule of a model that is then traced
    as a whole with :func:`kiln.trace`, keeping the marked part's control flow.
    """
    if example_inputs is None:
        if dynamic is not None or dynamic_batch or name is not None:
            raise ScriptError("kiln.script without example inputs marks its argument for kiln.trace (hybrid "
                              "mode) and compiles nothing: give dynamic=/dynamic_batch=/name= to kiln.trace, "
                              "or pass example inputs to compile a Graph here")
        return mark(module_or_function)
    from kiln.frontend import script_ops
    from kiln.frontend import trace as trace_mod
    from kiln.ir.passes import optimize as run_optimize
    from kiln.ir.verifier import verify

    scripted = scripted_model(module_or_function, ops=script_ops)
    graph = trace_mod.trace(scripted, example_inputs, dynamic=dynamic, dynamic_batch=dynamic_batch, check=False,
                            optimize=False, name=name, guards=guards)
    if check:
        import torch
        if isinstance(module_or_function, torch.nn.Module):
            module_or_function.eval()  # the trace ran in eval mode; compare with the same
        names, tensors = trace_mod._bind_inputs(module_or_function, example_inputs)
        dims = trace_mod._dynamic_dims(names, tensors, dynamic, dynamic_batch)
        trace_mod.check_trace(graph, module_or_function, names, tensors, dims, rtol=rtol, atol=atol, ranges=ranges)
    if optimize:
        run_optimize(graph)
        verify(graph)
    return graph


# ============================================================================ hybrid: marked parts of traced models
# Most of a model is traced; the few parts with data-dependent control flow are marked with
# kiln.script (no example inputs). A marked part keeps running its original Python whenever no
# tracer records it (eager calls, kiln.trace's eager check, the real iterations of a traced
# while); while kiln.trace records, its calls run the rewritten code instead, so its control
# flow becomes If/Loop in the whole model's graph. The switch is made per call (through the
# tracer's active_tracer()), which is why marking needs no change to kiln.trace itself and a
# marked module stays an ordinary module (state_dict, .to(), hooks, isinstance all unchanged).
_ORIGINAL = "__kiln_script_original__"


def mark(obj: Any) -> Any:
    """Mark ``obj`` so that :func:`kiln.trace` keeps its control flow; returns what to use:

    - an ``nn.Module`` subclass (``@kiln.script`` on the class): its ``forward`` is replaced in
      the class by a dispatcher; the class is returned, and every instance is marked;
    - an ``nn.Module`` instance: the instance alone gets the dispatching ``forward`` (an instance
      attribute, as when one patches ``module.forward``); the same instance is returned;
    - a function (``@kiln.script`` on a ``def``): a wrapper with the same name and signature is
      returned (the function itself cannot be changed in place).

    Marking twice is harmless. The rewrite happens at the first traced call (so a source that is
    outside the subset raises ScriptError then, from inside kiln.trace).
    """
    import torch

    cls = obj if isinstance(obj, type) else type(obj)
    if issubclass(cls, torch.nn.Module) and cls.__module__.split(".")[0] == "torch":
        raise ScriptError(f"{cls.__qualname__} is a torch.nn module: its code has no control flow on tensor data to "
                          "keep, and kiln.trace maps it as it is; mark your own module (or function) instead")
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        fwd = inspect.getattr_static(obj, "forward")
        if not isinstance(fwd, types.FunctionType):
            raise ScriptError(f"cannot mark {obj.__qualname__} for kiln.script: its forward is not a plain method")
        if not hasattr(fwd, _ORIGINAL):
            obj.forward = _dispatching_forward(fwd)
        return obj
    if isinstance(obj, torch.nn.Module):
        current = obj.__dict__.get("forward")
        if current is not None and hasattr(getattr(current, "__func__", None), _ORIGINAL):
            return obj
        fwd = inspect.getattr_static(type(obj), "forward")
        if current is not None or not isinstance(fwd, types.FunctionType):
            raise ScriptError(f"cannot mark this {type(obj).__qualname__} for kiln.script: its forward is "
                              "replaced on the instance or is not a plain method; mark its class instead")
        if hasattr(fwd, _ORIGINAL):
            return obj  # its class is marked already
        obj.__dict__["forward"] = types.MethodType(_dispatching_forward(fwd), obj)
        return obj
    if isinstance(obj, types.FunctionType):
        return obj if hasattr(obj, _ORIGINAL) else _dispatching_function(obj)
    raise ScriptError(f"kiln.script marks an nn.Module class or instance or a function, got {type(obj).__name__}")


def is_marked(obj: Any) -> bool:
    """Whether ``obj`` (a module, module class or function) was marked by :func:`mark`."""
    if isinstance(obj, type):
        return hasattr(inspect.getattr_static(obj, "forward", None), _ORIGINAL)
    if _is_module(obj):
        fwd = obj.__dict__.get("forward")
        return hasattr(getattr(fwd, "__func__", None), _ORIGINAL) or is_marked(type(obj))
    return hasattr(obj, _ORIGINAL)


def _recording() -> bool:
    from kiln.frontend.tracer import active_tracer
    return active_tracer() is not None


class _PerTrace:
    """The rewriter a marked object uses while one tracer records: made at its first traced call
    and reused by the later calls of the same trace (a marked block in every layer is rewritten
    once), made again for the next trace (the rewrite reads module globals as they are then)."""

    def __init__(self):
        self.tracer: Any = None
        self.rewriter: Optional[_Rewriter] = None

    def get(self) -> "_Rewriter":
        from kiln.frontend import script_ops
        from kiln.frontend.tracer import active_tracer
        tracer = active_tracer()
        if self.rewriter is None or self.tracer is None or self.tracer() is not tracer:
            # A weak reference: the finished trace (its graph and tensors) is not kept alive by the mark.
            self.tracer, self.rewriter = weakref.ref(tracer), _Rewriter(script_ops)
        return self.rewriter


def _dispatching_forward(fn: types.FunctionType) -> types.FunctionType:
    per_trace = _PerTrace()

    @functools.wraps(fn)
    def forward(self, *args, **kwargs):
        if not _recording():
            return fn(self, *args, **kwargs)
        rw = per_trace.get()
        saved, rw.proxies = rw.proxies, {}  # a fresh copy per call: it reads the module's attributes as they are now
        try:
            proxy = rw.module(self, forward=fn)
        finally:
            rw.proxies = saved
        return proxy.forward(*args, **kwargs)

    setattr(forward, _ORIGINAL, fn)
    return forward


def _dispatching_function(fn: types.FunctionType) -> types.FunctionType:
    per_trace = _PerTrace()

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _recording():
            return fn(*args, **kwargs)
        return per_trace.get().function(fn)(*args, **kwargs)

    setattr(call, _ORIGINAL, fn)
    return call


def scripted_model(model: Any, ops: Any) -> Any:
    """The rewritten model: for a module, a shallow copy whose ``forward`` (and the methods it
    calls) are rewritten; for a function, the rewritten function. ``ops`` provides the
    primitives (frontend/script_ops.py, or plain-Python stand-ins in tests)."""
    rw = _Rewriter(ops)
    if _is_module(model):
        return rw.module(model)
    if isinstance(model, types.MethodType):
        return types.MethodType(rw.function(model.__func__), model.__self__)
    if isinstance(model, types.FunctionType):
        return rw.function(model)
    raise ScriptError(f"kiln.script takes a torch.nn.Module or a Python function, got {type(model).__name__}")


def rewrite_function(fn: Callable, ops: Any) -> Callable:
    """``fn`` with its control flow rewritten into calls of ``ops``' primitives (see the module doc)."""
    return scripted_model(fn, ops)


def rewritten_source(fn: Callable) -> str:
    """The rewritten source of ``fn`` as Python text (what kiln.script traces), for reading."""
    return ast.unparse(_parse_and_rewrite(_Source.of(inspect.unwrap(getattr(fn, "__func__", fn))))[0])


# ============================================================================ helpers the rewritten code calls
def _is_tensor(x: Any) -> bool:
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _not(x: Any) -> Any:
    """``not x``: elementwise on a tensor (a traced condition stays in the graph)."""
    if _is_tensor(x):
        return x.logical_not()
    return not x


def _and(x: Any, b: Callable[[], Any]) -> Any:
    """``x and b()`` with Python's short circuit on Python values, a logical and on tensors."""
    if not _is_tensor(x):
        return b() if x else x
    y = b()
    if not _is_tensor(y):
        return x if y else y
    return x.logical_and(y)


def _or(x: Any, b: Callable[[], Any]) -> Any:
    """``x or b()`` with Python's short circuit on Python values, a logical or on tensors."""
    if not _is_tensor(x):
        return x if x else b()
    y = b()
    if not _is_tensor(y):
        return True if y else x
    return x.logical_or(y)


def _namespace(ops: Any) -> types.SimpleNamespace:
    missing = [p for p in _PRIMITIVES if not hasattr(ops, p)]
    if missing:
        raise ScriptError(f"the control-flow primitives {missing} are missing from {ops!r}")
    # The primitives' module may define how not/and/or and the reads of conditions treat its traced
    # values; these are the fallbacks (plain Python).
    return types.SimpleNamespace(**{p: getattr(ops, p) for p in _PRIMITIVES}, not_=getattr(ops, "kiln_not", _not),
                                 and_=getattr(ops, "kiln_and", _and), or_=getattr(ops, "kiln_or", _or),
                                 bool_=getattr(ops, "kiln_bool", _convert), int_=getattr(ops, "kiln_int", _convert),
                                 float_=getattr(ops, "kiln_float", _convert),
                                 item_=getattr(ops, "kiln_item", _item))


def _convert(conv: Callable, x: Any) -> Any:
    return conv(x)


def _item(x: Any) -> Any:
    return x.item()


# ============================================================================ source and errors
class _Source:
    """A function's source: its AST (parsed at the original columns) and the file's lines."""

    def __init__(self, fn: types.FunctionType, tree: ast.FunctionDef, filename: str, lines: list[str]):
        self.fn, self.tree, self.filename, self.lines = fn, tree, filename, lines

    @staticmethod
    def of(fn: types.FunctionType) -> "_Source":
        name = getattr(fn, "__qualname__", repr(fn))
        if fn.__name__ == "<lambda>":
            raise ScriptError(f"cannot script the lambda {name}: kiln.script needs a def (give it a name), "
                              "or trace it with kiln.trace")
        try:
            lines, first = inspect.getsourcelines(fn)
            filename = inspect.getsourcefile(fn) or fn.__code__.co_filename
        except (OSError, TypeError) as e:
            raise ScriptError(f"cannot read the source of {name} ({e}); kiln.script needs the function's source "
                              "file: define it in a file, or trace it with kiln.trace") from None
        text = "".join(lines)
        indented = bool(lines) and lines[0][:1] in (" ", "\t")
        # Parse an indented method as the body of 'if 1:' so columns stay those of the file.
        module = ast.parse("if 1:\n" + text if indented else text, filename=filename)
        ast.increment_lineno(module, first - 1 - (1 if indented else 0))
        tree = module.body[0].body[0] if indented else module.body[0]
        if not isinstance(tree, ast.FunctionDef):
            raise ScriptError(f"{filename}:{first}: cannot script {name}: its source is not a plain 'def' "
                              f"({type(tree).__name__}); trace it with kiln.trace")
        file_lines = linecache.getlines(filename) or []
        return _Source(fn, tree, filename, file_lines)

    def error(self, node: ast.AST, construct: str, advice: str) -> ScriptError:
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        text = self.lines[line - 1].rstrip("\n") if 0 < line <= len(self.lines) else ""
        where = f"{self.filename}:{line}:{col + 1}"
        snippet = f"\n    {text}\n    {' ' * col}^" if text else ""
        return ScriptError(f"{where}: {construct} is not supported by kiln.script (in {self.fn.__qualname__}){snippet}"
                           f"\n{advice}")


# ============================================================================ name analysis
def _target_names(t: ast.AST) -> list[str]:
    if isinstance(t, ast.Name):
        return [t.id]
    if isinstance(t, (ast.Tuple, ast.List)):
        return [n for e in t.elts for n in _target_names(e)]
    if isinstance(t, ast.Starred):
        return _target_names(t.value)
    return []  # attribute / subscript stores bind no name


class _Assigned(ast.NodeVisitor):
    """The names a piece of code binds in its own scope, in order of first binding."""

    def __init__(self):
        self.names: dict[str, None] = {}

    def add(self, names: Iterable[str]) -> None:
        self.names.update((n, None) for n in names)

    def visit_Assign(self, node):
        self.visit(node.value)
        for t in node.targets:
            self.add(_target_names(t))

    def visit_AugAssign(self, node):
        self.visit(node.value)
        self.add(_target_names(node.target))

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)
            self.add(_target_names(node.target))

    def visit_For(self, node):
        self.visit(node.iter)
        self.add(_target_names(node.target))
        for s in node.body + node.orelse:
            self.visit(s)

    def visit_With(self, node):
        for item in node.items:
            if item.optional_vars is not None:
                self.add(_target_names(item.optional_vars))
        for s in node.body:
            self.visit(s)

    def visit_NamedExpr(self, node):
        self.visit(node.value)
        self.add(_target_names(node.target))

    def visit_Import(self, node):
        self.add((a.asname or a.name.split(".")[0]) for a in node.names)

    visit_ImportFrom = visit_Import

    def visit_FunctionDef(self, node):
        self.add([node.name])  # its body is another scope

    visit_ClassDef = visit_FunctionDef

    def visit_Lambda(self, node):
        pass

    def _comprehension(self, node):
        pass  # comprehension variables are local to the comprehension

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension


def _assigned(nodes: Sequence[ast.AST]) -> dict[str, None]:
    v = _Assigned()
    for n in nodes:
        v.visit(n)
    return v.names


def _loads(nodes: Sequence[ast.AST]) -> set[str]:
    """Every name read anywhere in ``nodes`` (nested functions included: they read when called)."""
    out = set()
    for n in nodes:
        for sub in ast.walk(n):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                out.add(sub.id)
            elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name):
                out.add(sub.target.id)
    return out


def _meet(a: Optional[set], b: Optional[set]) -> Optional[set]:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


class _Flow:
    """Definite assignment through statements: which names are bound on every path (``None``:
    the point is unreachable), and which names are read where they may not be bound yet
    (``exposed``: in a loop body, the values carried from the previous iteration)."""

    def __init__(self):
        self.exposed: set[str] = set()

    def block(self, stmts: Sequence[ast.stmt], d: Optional[set]) -> Optional[set]:
        for s in stmts:
            if d is None:
                break
            d = self.stmt(s, d)
        return d

    def expr(self, node: Optional[ast.AST], d: set) -> set:
        if node is None:
            return d
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in d:
                self.exposed.add(sub.id)
        return d | set(_assigned([node])) if isinstance(node, ast.expr) else d

    def stmt(self, s: ast.stmt, d: set) -> Optional[set]:
        if isinstance(s, ast.If):
            d = self.expr(s.test, d)
            return _meet(self.block(s.body, set(d)), self.block(s.orelse, set(d)))
        if isinstance(s, ast.While):
            d = self.expr(s.test, d)
            self.block(s.body, set(d))
            self.block(s.orelse, set(d))
            return d
        if isinstance(s, ast.For):
            d = self.expr(s.iter, d)
            self.block(s.body, d | set(_target_names(s.target)))
            self.block(s.orelse, set(d))
            return d
        if isinstance(s, (ast.Return, ast.Raise)):
            for part in (getattr(s, "value", None), getattr(s, "exc", None), getattr(s, "cause", None)):
                self.expr(part, d)
            return None
        if isinstance(s, (ast.Break, ast.Continue)):
            return None
        if isinstance(s, ast.With):
            for item in s.items:
                d = self.expr(item.context_expr, d)
                if item.optional_vars is not None:
                    d = d | set(_target_names(item.optional_vars))
            return self.block(s.body, d)
        if isinstance(s, ast.Assign):
            d = self.expr(s.value, d)
            for t in s.targets:
                if not isinstance(t, ast.Name):
                    self.expr(t, d)
            return d | set(_assigned([s]))
        if isinstance(s, ast.AugAssign):
            if isinstance(s.target, ast.Name) and s.target.id not in d:
                self.exposed.add(s.target.id)
            self.expr(s.target, d)
            return self.expr(s.value, d) | set(_target_names(s.target))
        if isinstance(s, (ast.FunctionDef, ast.ClassDef)):
            for sub in ast.walk(s):  # a nested function reads its free names when called: count them now
                if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in d:
                    self.exposed.add(sub.id)
            return d | {s.name}
        for sub in ast.walk(s):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in d:
                self.exposed.add(sub.id)
        return d | set(_assigned([s]))


# ============================================================================ validation
def _is_no_grad(item: ast.withitem) -> bool:
    e = item.context_expr
    f = e.func if isinstance(e, ast.Call) and not e.args and not e.keywords else None
    return item.optional_vars is None and (
        (isinstance(f, ast.Attribute) and f.attr in _NO_GRAD) or (isinstance(f, ast.Name) and f.id in _NO_GRAD))


_REJECT = {
    ast.Try: ("try/except", "kiln.script cannot keep exception handling in a graph: check the condition "
              "explicitly (if ...), or move the try/except out of the scripted code"),
    ast.AsyncFunctionDef: ("async def", "scripted code must be synchronous"),
    ast.AsyncFor: ("async for", "scripted code must be synchronous"),
    ast.AsyncWith: ("async with", "scripted code must be synchronous"),
    ast.Await: ("await", "scripted code must be synchronous"),
    ast.Yield: ("yield (a generator)", "return a tuple or list of the values instead of yielding them"),
    ast.YieldFrom: ("yield from (a generator)", "return a tuple or list of the values instead of yielding them"),
    ast.Global: ("a global declaration", "pass the value in as an argument or return it; scripted code cannot "
                 "rebind module globals"),
    ast.Nonlocal: ("a nonlocal declaration", "return the new value from the inner function and assign it "
                   "in the outer one"),
    ast.Delete: ("del", "rebind the name instead (x = None) or drop the statement; deleting names or items "
                 "cannot be expressed in a graph"),
    ast.ClassDef: ("a class definition", "define the class at module level"),
    ast.Match: ("a match statement", "use if/elif/else"),
}
if hasattr(ast, "TryStar"):
    _REJECT[ast.TryStar] = _REJECT[ast.Try]


class _Validator(ast.NodeVisitor):
    """Rejects what the rewrite cannot keep the meaning of, at the first offending node."""

    def __init__(self, src: _Source):
        self.src = src
        self.loop_depth = 0

    def generic_visit(self, node):
        rule = _REJECT.get(type(node))
        if rule is not None:
            raise self.src.error(node, *rule)
        super().generic_visit(node)

    def visit_With(self, node):
        if not all(_is_no_grad(i) for i in node.items):
            raise self.src.error(node, "a with-statement (other than 'with torch.no_grad()')",
                                 "call what the context manager does explicitly, or move the with-block into "
                                 "a submodule or function that is traced")
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        depth, self.loop_depth = self.loop_depth, 0  # a nested def's returns are its own
        self.generic_visit(node)
        self.loop_depth = depth

    def _loop(self, node):
        if isinstance(node, ast.While):
            for sub in ast.walk(node.test):
                if isinstance(sub, ast.NamedExpr):
                    raise self.src.error(sub, "an assignment expression (:=) in a while condition",
                                         "assign the value before the loop and again at the end of the body")
        self.loop_depth += 1
        self.generic_visit(node)
        self.loop_depth -= 1

    visit_While = visit_For = _loop

    def visit_Return(self, node):
        if self.loop_depth:
            raise self.src.error(node, "return inside a loop",
                                 "assign the result to a variable and 'break', then return it after the loop")
        self.generic_visit(node)


# ============================================================================ lowering passes
def _fresh(counter: Iterable[int], what: str) -> str:
    return f"__kiln_{what}_{next(counter)}"


def _name(n: str, store: bool = False) -> ast.Name:
    return ast.Name(id=n, ctx=ast.Store() if store else ast.Load())


def _tuple(names: Sequence[str], store: bool = False) -> ast.Tuple:
    return ast.Tuple(elts=[_name(n, store) for n in names], ctx=ast.Store() if store else ast.Load())


def _ns_call(fn: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=_name(_NS), attr=fn, ctx=ast.Load()), args=list(args), keywords=[])


def _funcdef(name: str, args: ast.arguments, body: list[ast.stmt]) -> ast.FunctionDef:
    extra = {"type_params": []} if "type_params" in ast.FunctionDef._fields else {}
    return ast.FunctionDef(name=name, args=args, body=body, decorator_list=[], returns=None, **extra)


def _thunk(e: ast.expr) -> ast.Lambda:
    return ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], vararg=None, kwonlyargs=[], kw_defaults=[],
                                         kwarg=None, defaults=[]), body=e)


def _located(new: Any, like: ast.AST) -> Any:
    """Give the new nodes (those without a position) the position of ``like``."""
    for node in (new if isinstance(new, list) else [new]):
        for sub in ast.walk(node):
            if "lineno" in sub._attributes and not hasattr(sub, "lineno"):
                ast.copy_location(sub, like)
    return new


def _walk_scope(nodes: Iterable[ast.AST]):
    """ast.walk that does not enter nested functions, lambdas or classes."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        yield n
        for child in ast.iter_child_nodes(n):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                todo.append(child)


def _inline_no_grad(stmts: list[ast.stmt]) -> list[ast.stmt]:
    out = []
    for s in stmts:
        for field in ("body", "orelse"):
            if isinstance(getattr(s, field, None), list) and not isinstance(s, ast.FunctionDef):
                setattr(s, field, _inline_no_grad(getattr(s, field)))
        if isinstance(s, ast.With):
            out.extend(s.body)  # validated: only torch.no_grad()/inference_mode()
        else:
            out.append(s)
    return out


def _has_return(nodes: Iterable[ast.AST]) -> bool:
    return any(isinstance(n, ast.Return) for n in _walk_scope(nodes))


def _lower_returns(body: list[ast.stmt]) -> list[ast.stmt]:
    """Make every path assign ``__kiln_ret`` and end the function in one ``return``.

    The statements after an ``if`` that returns in a branch move into the branches that fall
    through (so a data-dependent early return becomes an If whose branches both compute the
    result). Returns inside loops were rejected by the validator.
    """
    last = body[-1] if body else None
    if not _has_return(body[:-1]) and not (last is not None and not isinstance(last, ast.Return)
                                           and _has_return([last])):
        return body  # returns only at the very end: nothing to do

    def lower(stmts: list[ast.stmt], rest: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for i, s in enumerate(stmts):
            if isinstance(s, ast.Return):
                value = s.value if s.value is not None else ast.Constant(None)
                out.append(_located(ast.Assign(targets=[_name(_RET, True)], value=value), s))
                return out
            if isinstance(s, ast.Raise):
                out.append(s)
                return out
            if isinstance(s, ast.If) and _has_return([s]):
                cont = stmts[i + 1:] + rest
                s.body = lower(s.body, copy.deepcopy(cont))
                s.orelse = lower(s.orelse, copy.deepcopy(cont))
                out.append(s)
                return out
            out.append(s)
        return out + lower(rest, []) if rest else out

    init = _located(ast.Assign(targets=[_name(_RET, True)], value=ast.Constant(None)), body[0])
    lowered = lower(body, [])
    ret = _located(ast.Return(value=_name(_RET)), lowered[-1] if lowered else body[0])
    return [init] + lowered + [ret]


def _jumps(nodes: Iterable[ast.AST], kinds: tuple) -> bool:
    """Whether ``nodes`` contain a break/continue of the enclosing loop (not of a nested one)."""
    todo = list(nodes)
    while todo:
        n = todo.pop()
        if isinstance(n, kinds):
            return True
        if isinstance(n, (ast.For, ast.While)):
            todo.extend(n.orelse)  # a nested loop's else belongs to the outer loop's body
            continue
        if isinstance(n, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        todo.extend(ast.iter_child_nodes(n))
    return False


def _lower_jumps(stmts: list[ast.stmt], counter) -> list[ast.stmt]:
    """Replace break/continue in every loop of ``stmts`` by flags (innermost loops first)."""
    out = []
    for s in stmts:
        if isinstance(s, ast.If):
            s.body, s.orelse = _lower_jumps(s.body, counter), _lower_jumps(s.orelse, counter)
            out.append(s)
        elif isinstance(s, (ast.While, ast.For)):
            s.body, s.orelse = _lower_jumps(s.body, counter), _lower_jumps(s.orelse, counter)
            out.extend(_lower_loop_jumps(s, counter))
        else:
            out.append(s)
    return out


def _lower_loop_jumps(loop: ast.While | ast.For, counter) -> list[ast.stmt]:
    has_break = _jumps(loop.body, (ast.Break,))
    has_cont = _jumps(loop.body, (ast.Continue,))
    orelse, loop.orelse = loop.orelse, []
    if not has_break and not has_cont:
        return [loop] + orelse
    broke = _fresh(counter, "break") if has_break else None
    cont = _fresh(counter, "continue") if has_cont else None
    flags = [f for f in (broke, cont) if f]

    def still_running() -> ast.expr:  # not (broke or cont)
        test = _name(flags[0]) if len(flags) == 1 else _ns_call("or_", _name(broke), _thunk(_name(cont)))
        return _ns_call("not_", test)

    def guard(stmts: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        for i, s in enumerate(stmts):
            if isinstance(s, ast.Break):
                out.append(_located(ast.Assign(targets=[_name(broke, True)], value=ast.Constant(True)), s))
                return out
            if isinstance(s, ast.Continue):
                out.append(_located(ast.Assign(targets=[_name(cont, True)], value=ast.Constant(True)), s))
                return out
            if isinstance(s, ast.If) and _jumps([s], (ast.Break, ast.Continue)):
                s.body, s.orelse = guard(s.body), guard(s.orelse)
                out.append(s)
                rest = stmts[i + 1:]
                if rest:
                    out.append(_located(ast.If(test=still_running(), body=guard(rest), orelse=[]), rest[0]))
                return out
            out.append(s)
        return out

    body = guard(loop.body)
    if broke and isinstance(loop, ast.While):
        loop.test = _located(_ns_call("and_", _ns_call("not_", _name(broke)), _thunk(loop.test)), loop.test)
    elif broke:  # a for loop keeps iterating, doing nothing (not even binding its target) once broken
        item = _fresh(counter, "item")
        body.insert(0, _located(ast.Assign(targets=[loop.target], value=_name(item)), loop.target))
        loop.target = _located(_name(item, True), loop.target)
        body = [_located(ast.If(test=_ns_call("not_", _name(broke)), body=body, orelse=[]), loop)]
    if cont:
        body.insert(0, _located(ast.Assign(targets=[_name(cont, True)], value=ast.Constant(False)), loop))
    loop.body = body
    out: list[ast.stmt] = []
    if broke:
        out.append(_located(ast.Assign(targets=[_name(broke, True)], value=ast.Constant(False)), loop))
    out.append(loop)
    if orelse and broke:  # the else clause runs when the loop did not break
        out.append(_located(ast.If(test=_ns_call("not_", _name(broke)), body=orelse, orelse=[]), orelse[0]))
    else:
        out.extend(orelse)
    return out


# ============================================================================ control flow -> primitives
class _Converter:
    """Turns if/while/for/assert (after the lowering passes) into primitive calls with closures.

    Walks each block in order, knowing which names are definitely bound (``definite``), maybe
    bound (``maybe``) and read later (``live``) at each statement; these decide each closure's
    parameters and results and each loop's carried state.
    """

    def __init__(self, counter):
        self.counter = counter

    def function(self, fn: ast.FunctionDef) -> None:
        a = fn.args
        params = {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}
        params |= {x.arg for x in (a.vararg, a.kwarg) if x is not None}
        fn.body = self.block(fn.body, set(params), set(params), set())

    def block(self, stmts: list[ast.stmt], definite: set, maybe: set, live_after: set) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        definite, maybe = set(definite), set(maybe)
        for i, s in enumerate(stmts):
            live = _loads(stmts[i + 1:]) | live_after
            assigned, after = set(_assigned([s])), _Flow().stmt(s, definite)
            out.extend(self.stmt(s, definite, maybe, live))
            maybe |= assigned
            definite = set(maybe) if after is None else after  # after a raise: unreachable
        return out

    # ------------------------------------------------------------------ statements
    def stmt(self, s: ast.stmt, definite: set, maybe: set, live: set) -> list[ast.stmt]:
        if isinstance(s, ast.If):
            return self.if_(s, definite, maybe, live)
        if isinstance(s, ast.While):
            return self.while_(s, definite, maybe, live)
        if isinstance(s, ast.For):
            return self.for_(s, definite, maybe, live)
        if isinstance(s, ast.Assert):
            msg = s.msg if s.msg is not None else ast.Constant(f"assertion failed: {ast.unparse(s.test)}")
            call = _ns_call("kiln_assert", self.cond(s.test), self.expr(msg))
            return [_located(ast.Expr(value=call), s)]
        if isinstance(s, ast.FunctionDef):
            _rewrite_def(s, self.counter)
            return [s]
        return [self.expr(s)]

    def expr(self, node: ast.AST) -> Any:
        return _Exprs(self).visit(node)

    def cond(self, test: ast.expr) -> ast.expr:
        """A condition: and/or/not and chained comparisons become tensor-aware helpers, and so do
        the reads that make it up (``bool(e)``, ``int(e)``, ``float(e)``, ``e.item()``: see
        :meth:`reads`)."""
        test = self.reads(test)
        if isinstance(test, ast.BoolOp):
            helper = "and_" if isinstance(test.op, ast.And) else "or_"
            acc = self.cond(test.values[-1])
            for v in reversed(test.values[:-1]):
                acc = _ns_call(helper, self.cond(v), _thunk(acc))
            return _located(acc, test)
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return _located(_ns_call("not_", self.cond(test.operand)), test)
        if isinstance(test, ast.Compare) and len(test.ops) > 1:
            parts = [ast.Compare(left=l, ops=[op], comparators=[r]) for l, op, r in
                     zip([test.left] + test.comparators[:-1], test.ops, test.comparators)]
            parts = [copy.deepcopy(p) if i else p for i, p in enumerate(parts)]
            return self.cond(_located(ast.BoolOp(op=ast.And(), values=parts), test))
        return self.expr(test)

    def reads(self, e: ast.expr) -> ast.expr:
        """``bool(x)``/``int(x)``/``float(x)``/``x.item()`` where they are the condition, or an operand
        of its comparisons, arithmetic and and/or/not, become calls of the namespace's
        ``bool_``/``int_``/``float_``/``item_``: a traced tensor then stays a tensor (the statement
        becomes an If/Loop), anything else gets the builtin. Arguments of other calls and
        subscripts are left as written: there the Python value is what the callee expects."""
        if isinstance(e, ast.Call) and not e.keywords and len(e.args) == 1 and not isinstance(e.args[0], ast.Starred) \
                and isinstance(e.func, ast.Name) and e.func.id in ("bool", "int", "float"):
            inner = self.cond(e.args[0]) if e.func.id == "bool" else self.reads(e.args[0])
            return _located(_ns_call(f"{e.func.id}_", _name(e.func.id), inner), e)
        if isinstance(e, ast.Call) and not e.args and not e.keywords and isinstance(e.func, ast.Attribute) \
                and e.func.attr == "item":
            return _located(_ns_call("item_", self.reads(e.func.value)), e)
        if isinstance(e, ast.Compare):
            e.left = self.reads(e.left)
            e.comparators = [self.reads(c) for c in e.comparators]
        elif isinstance(e, ast.BoolOp):
            e.values = [self.reads(v) for v in e.values]
        elif isinstance(e, ast.UnaryOp):
            e.operand = self.reads(e.operand)
        elif isinstance(e, ast.BinOp):
            e.left, e.right = self.reads(e.left), self.reads(e.right)
        return e

    def _inits(self, names: Iterable[str], definite: set, maybe: set, like: ast.AST) -> list[ast.stmt]:
        """Bind names that may be unbound to UNDEFINED, so they can be passed to closures."""
        out = []
        undefined = ast.Attribute(value=_name(_NS), attr="UNDEFINED", ctx=ast.Load())
        for n in names:
            if n in definite:
                continue
            assign = ast.Assign(targets=[_name(n, True)], value=copy.deepcopy(undefined))
            if n in maybe:  # bound on some paths only: keep the value where it is bound
                out.append(ast.Try(body=[ast.Expr(value=_name(n))], handlers=[ast.ExceptHandler(
                    type=_name("NameError"), name=None, body=[assign])], orelse=[], finalbody=[]))
            else:
                out.append(assign)
        return _located(out, like)

    def _def(self, name: str, params: Sequence[str], body: list[ast.stmt], like: ast.AST) -> ast.FunctionDef:
        args = ast.arguments(posonlyargs=[], args=[ast.arg(arg=p) for p in params], vararg=None, kwonlyargs=[],
                             kw_defaults=[], kwarg=None, defaults=[])
        return _located(_funcdef(name, args, body or [ast.Pass()]), like)

    def _bind(self, names: Sequence[str], call: ast.Call, like: ast.AST) -> ast.stmt:
        if not names:
            return _located(ast.Expr(value=call), like)
        return _located(ast.Assign(targets=[_tuple(names, store=True)], value=call), like)

    def if_(self, s: ast.If, definite: set, maybe: set, live: set) -> list[ast.stmt]:
        assigned = list(_assigned(s.body + s.orelse))
        outputs = [n for n in assigned if n in live]
        params = [n for n in assigned if n in maybe or n in live]
        inner_def, inner_maybe = definite | set(params), maybe | set(params)
        n = next(self.counter)
        then_name, else_name = f"__kiln_then_{n}", f"__kiln_else_{n}"
        result = _located(ast.Return(value=_tuple(outputs)), s)
        then_fn = self._def(then_name, params, self.block(s.body, inner_def, inner_maybe, live)
                            + [copy.deepcopy(result)], s)
        else_fn = self._def(else_name, params, self.block(s.orelse, inner_def, inner_maybe, live) + [result],
                            s.orelse[0] if s.orelse else s)
        call = _ns_call("kiln_if", self.cond(s.test),
                        _thunk(ast.Call(func=_name(then_name), args=[_name(p) for p in params], keywords=[])),
                        _thunk(ast.Call(func=_name(else_name), args=[_name(p) for p in params], keywords=[])))
        return self._inits(params, definite, maybe, s) + [then_fn, else_fn, self._bind(outputs, _located(call, s), s)]

    def _loop_state(self, body: list[ast.stmt], extra_reads: Sequence[ast.AST], bound: Sequence[str],
                    maybe: set, live: set) -> tuple[list[str], set[str]]:
        """The loop-carried names: assigned in the body and defined before the loop, read after
        it, or read in an iteration before the body binds them (from the previous iteration);
        and the names live at the end of the body (read by the next iteration or after the loop)."""
        assigned = list(dict.fromkeys(list(bound) + list(_assigned(body))))
        flow = _Flow()
        for e in extra_reads:
            flow.expr(e, set())
        flow.block(body, set(bound))
        live_end = flow.exposed | live
        return [n for n in assigned if n in maybe or n in live_end], live_end

    def while_(self, s: ast.While, definite: set, maybe: set, live: set) -> list[ast.stmt]:
        state, inner_live = self._loop_state(s.body, [s.test], [], maybe, live)
        inner_def, inner_maybe = definite | set(state), maybe | set(state)
        n = next(self.counter)
        cond_name, body_name = f"__kiln_cond_{n}", f"__kiln_body_{n}"
        cond_fn = self._def(cond_name, state, [_located(ast.Return(value=self.cond(s.test)), s.test)], s.test)
        body_fn = self._def(body_name, state, self.block(s.body, inner_def, inner_maybe, inner_live)
                            + [_located(ast.Return(value=_tuple(state)), s)], s)
        call = _ns_call("kiln_while", _name(cond_name), _name(body_name), _tuple(state))
        return self._inits(state, definite, maybe, s) + [cond_fn, body_fn, self._bind(state, _located(call, s), s)]

    def for_(self, s: ast.For, definite: set, maybe: set, live: set) -> list[ast.stmt]:
        bound = _target_names(s.target)
        state, inner_live = self._loop_state(s.body, [], bound, maybe, live)
        n = next(self.counter)
        item, body_name = f"__kiln_item_{n}", f"__kiln_body_{n}"
        inner_def = definite | set(state) | set(bound) | {item}
        inner_maybe = maybe | set(state) | set(bound) | {item}
        unpack = _located(ast.Assign(targets=[s.target], value=_name(item)), s.target)
        body_fn = self._def(body_name, [item] + state,
                            [unpack] + self.block(s.body, inner_def, inner_maybe, inner_live)
                            + [_located(ast.Return(value=_tuple(state)), s)], s)
        rng = self._range_args(s.iter, definite, maybe)
        if rng is not None:
            call = _ns_call("kiln_for_range", *[self.expr(self.reads(a)) for a in rng], _name(body_name),
                            _tuple(state))
        else:
            call = _ns_call("kiln_for_iter", self.expr(s.iter), _name(body_name), _tuple(state))
        return self._inits(state, definite, maybe, s) + [body_fn, self._bind(state, _located(call, s), s)]

    @staticmethod
    def _range_args(it: ast.expr, definite: set, maybe: set) -> Optional[list[ast.expr]]:
        if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
                and "range" not in maybe and not it.keywords and 1 <= len(it.args) <= 3
                and not any(isinstance(a, ast.Starred) for a in it.args)):
            return None
        args = list(it.args)
        if len(args) == 1:
            args = [ast.Constant(0)] + args
        if len(args) == 2:
            args = args + [ast.Constant(1)]
        return _located(args, it)


class _Exprs(ast.NodeTransformer):
    """Expression rewrites: ``a if c else b`` -> ``kiln_if(c, lambda: (a,), lambda: (b,))[0]``."""

    def __init__(self, conv: _Converter):
        self.conv = conv

    def visit_IfExp(self, node):
        self.generic_visit(node)
        one = lambda e: _thunk(ast.Tuple(elts=[e], ctx=ast.Load()))  # noqa: E731
        call = _ns_call("kiln_if", self.conv.cond(node.test), one(node.body), one(node.orelse))
        return _located(ast.Subscript(value=call, slice=ast.Constant(0), ctx=ast.Load()), node)


# ============================================================================ the whole pipeline
def _rewrite_def(fn: ast.FunctionDef, counter) -> None:
    """All passes, in order, on one function (nested defs get their own run from the converter)."""
    body = _inline_no_grad(fn.body)
    body = _lower_returns(body)
    fn.body = _lower_jumps(body, counter)
    _Converter(counter).function(fn)


def _class_of(fn: types.FunctionType) -> Optional[str]:
    parts = [p for p in fn.__qualname__.split(".") if p != "<locals>"]
    return parts[-2] if len(parts) >= 2 else None


class _Mangle(ast.NodeTransformer):
    """Private names (``self.__x``) were mangled with the class name when the class was
    compiled; the rewrite compiles the method outside its class, so mangle them here."""

    def __init__(self, cls: str):
        self.prefix = "_" + cls.lstrip("_")

    def fix(self, name: str) -> str:
        return self.prefix + name if name.startswith("__") and not name.endswith("__") else name

    def visit_Name(self, node):
        node.id = self.fix(node.id)
        return node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        node.attr = self.fix(node.attr)
        return node

    def visit_arg(self, node):
        node.arg = self.fix(node.arg)
        return node


def _explicit_super(tree: ast.FunctionDef) -> bool:
    """``super()`` -> ``super(__class__, self)``: the zero-argument form only works in a class body."""
    args = tree.args.posonlyargs + tree.args.args
    used = False
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
                and not node.args and not node.keywords and args):
            node.args = _located([_name("__class__"), _name(args[0].arg)], node)
            used = True
    return used


def _parse_and_rewrite(src: _Source) -> tuple[ast.Module, list[str]]:
    """The rewritten function wrapped in a factory ``def __kiln_make(<free vars>)`` (closures of
    the original become the factory's parameters); returns the module AST and the free vars."""
    tree = src.tree
    _Validator(src).visit(tree)
    cls = _class_of(src.fn)
    if cls is not None:
        _Mangle(cls).visit(tree)
    tree.decorator_list = []
    freevars = list(src.fn.__code__.co_freevars)
    if _explicit_super(tree) and "__class__" not in freevars:
        freevars.append("__class__")
    # Defaults and annotations were evaluated in the class body; the rewritten function gets the
    # original's values (see _Rewriter.function) instead of evaluating them again.
    a = tree.args
    a.defaults = [ast.Constant(None) for _ in a.defaults]
    a.kw_defaults = [None if d is None else ast.Constant(None) for d in a.kw_defaults]
    for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x is not None]:
        arg.annotation = None
    tree.returns = None
    _rewrite_def(tree, itertools.count(1))
    make = _funcdef("__kiln_make", ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=v) for v in freevars], vararg=None, kwonlyargs=[], kw_defaults=[],
        kwarg=None, defaults=[]), [tree, ast.Return(value=_name(tree.name))])
    module = ast.Module(body=[_located(make, tree)], type_ignores=[])
    ast.fix_missing_locations(module)
    return module, freevars


def _calls(tree: ast.FunctionDef, self_name: Optional[str]) -> tuple[list[str], list[str]]:
    """The non-local names ``tree`` calls, and the attributes it calls on ``self_name``."""
    local = set(_assigned(tree.body)) | {a.arg for a in ast.walk(tree.args) if isinstance(a, ast.arg)}
    names, attrs = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id not in local:
                names[f.id] = None
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == self_name:
                attrs[f.attr] = None
    return list(names), list(attrs)


def _is_module(x: Any) -> bool:
    import sys
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


class _Rewriter:
    """Rewrites functions and methods, sharing one globals dict per source module (so rewritten
    helpers call each other's rewritten versions) and rewriting each function once."""

    def __init__(self, ops: Any):
        self.ns = _namespace(ops)
        self.globals: dict[int, dict] = {}
        self.done: dict[types.FunctionType, types.FunctionType] = {}
        self.proxies: dict[int, tuple[Any, Any]] = {}  # id(submodule) -> (submodule, its scripted copy)

    def _globals_for(self, fn: types.FunctionType) -> dict:
        g = self.globals.get(id(fn.__globals__))
        if g is None:
            g = dict(fn.__globals__)
            g[_NS] = self.ns
            self.globals[id(fn.__globals__)] = g
        return g

    def function(self, fn: types.FunctionType, self_name: Optional[str] = None,
                 methods: Optional[dict] = None) -> types.FunctionType:
        fn = inspect.unwrap(fn)
        if fn in self.done:
            return self.done[fn]
        src = _Source.of(fn)
        calls = _calls(src.tree, self_name)  # before the rewrite changes the tree
        module, freevars = _parse_and_rewrite(src)
        g = self._globals_for(fn)
        code = compile(module, src.filename, "exec")
        scope: dict[str, Any] = {}
        exec(code, g, scope)
        cells = []
        for v in freevars:
            if v == "__class__" and v not in fn.__code__.co_freevars:
                cells.append(_defining_class(fn))
                continue
            try:
                cells.append(fn.__closure__[fn.__code__.co_freevars.index(v)].cell_contents)
            except ValueError:
                raise ScriptError(f"{src.filename}:{src.tree.lineno}: the closure variable '{v}' of "
                                  f"{fn.__qualname__} is not bound yet; bind it before scripting") from None
        new = scope["__kiln_make"](*cells)
        new.__defaults__, new.__kwdefaults__ = fn.__defaults__, fn.__kwdefaults__
        new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
        new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
        self.done[fn] = new
        # Same-module functions called by name and methods called on self are rewritten too.
        for name in calls[0]:
            target = fn.__globals__.get(name)
            if (isinstance(target, types.FunctionType) and target.__globals__ is fn.__globals__
                    and target.__name__ != "<lambda>" and g.get(name) is target):
                g[name] = self.function(target)
        if methods is not None:
            for attr in calls[1]:
                methods.setdefault(attr, None)
        return new

    def module(self, module: Any, forward: Optional[types.FunctionType] = None) -> Any:
        """A shallow copy of ``module`` (same parameters, buffers and hooks) whose ``forward`` (the
        function ``forward`` when given, else the class's) and the methods it calls on ``self``
        are rewritten, and whose submodules are scripted recursively (:meth:`submodule`)."""
        proxy = copy.copy(module)
        cls = type(module)
        methods: dict[str, Optional[types.FunctionType]] = {"forward": None}
        own = getattr(proxy.__dict__.get("forward"), "__func__", None)
        if hasattr(own, _ORIGINAL):  # marked instance: the copy runs the rewrite instead
            del proxy.__dict__["forward"]
            forward = forward or getattr(own, _ORIGINAL)
        if _is_builtin_module(module):
            methods["forward"] = False  # torch.nn's own code: nothing to rewrite, and it runs as is
        elif forward is not None:
            methods["forward"] = self.function(forward, _self_name(forward), methods)
        while any(v is None for v in methods.values()):
            for attr in [a for a, v in methods.items() if v is None]:
                raw = inspect.getattr_static(cls, attr, None)
                if (attr in proxy.__dict__ or attr in module._modules or not isinstance(raw, types.FunctionType)
                        or raw.__module__.split(".")[0] in ("torch", "kiln")):
                    methods[attr] = False  # a submodule, an instance attribute, a static/class method: as is
                    continue
                fn = inspect.unwrap(raw)
                methods[attr] = self.function(fn, _self_name(fn), methods)
        for attr, new in methods.items():
            if new:
                object.__setattr__(proxy, attr, types.MethodType(new, proxy))
        self._script_children(module, proxy)
        return proxy

    def submodule(self, module: Any) -> Any:
        """A submodule as the scripted model calls it: a user module is scripted (its forward is
        Python that may branch on tensors); a torch.nn module runs its own code, but when its
        children include user modules (an ``nn.Sequential`` of user blocks) it is copied with
        those children scripted. A module reached twice (shared) gives the same copy both times."""
        key = id(module)
        if key in self.proxies:
            return self.proxies[key][1]
        if self._needs_copy(module):
            proxy = self.module(module)
        else:
            proxy = module
        self.proxies[key] = (module, proxy)  # keeps the original alive so its id is not reused
        return proxy

    def _script_children(self, module: Any, proxy: Any) -> None:
        children = {n: (c if c is None else self.submodule(c)) for n, c in module._modules.items()}
        if any(children[n] is not c for n, c in module._modules.items()):
            object.__setattr__(proxy, "_modules", children)  # the copy's own dict: the original keeps its own

    @staticmethod
    def _needs_copy(module: Any) -> bool:
        """A user module, or a torch.nn module holding one somewhere below it."""
        return any(not _is_builtin_module(m) for m in module.modules())


def _is_builtin_module(module: Any) -> bool:
    """A module whose class torch (or kiln) defines: its forward is library code, never rewritten."""
    return type(module).__module__.split(".")[0] in ("torch", "kiln")


def _self_name(fn: types.FunctionType) -> Optional[str]:
    return next(iter(inspect.signature(fn).parameters), None)


def _defining_class(fn: types.FunctionType) -> type:
    """The class whose body defined ``fn`` (for the rewritten ``super(__class__, self)``)."""
    module = inspect.getmodule(fn)
    obj: Any = module
    for part in [p for p in fn.__qualname__.split(".") if p != "<locals>"][:-1]:
        obj = getattr(obj, part, None)
    if not isinstance(obj, type):
        raise ScriptError(f"cannot find the class of {fn.__qualname__} for its super() call; write "
                          "super(ClassName, self) explicitly")
    return obj
