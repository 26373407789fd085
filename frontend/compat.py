"""What differs between the torch releases kiln supports, in one place.

The supported window is ``MIN_TORCH <= torch < NEXT_TORCH`` (docs/NOTES.md, "Torch versions"):
CI runs the frontend tests on the oldest and the newest release of it. Outside the window kiln
still tries, after one warning.

The tracer decomposes a Python function torch dispatches to it (``torch._assert``,
``F.multi_head_attention_forward``, a Tensor method written in Python) by running the function's
own body with the tracer still active. Such a function starts with a guard::

    if has_torch_function(args):
        return handle_torch_function(func, args, *args)

and while a TorchFunctionMode is active the guard is always true, so simply calling the function
again would come straight back to the tracer. :func:`redispatch` makes that guard false once:

- with torch's hook where torch has one (``torch.overrides.redispatch_function``, or the C hook
  ``torch._C._skip_one_hop_torch_function`` it wraps): the next ``has_torch_function`` check
  answers False once;
- on a torch without it (every release before the hook came), by calling a copy of the function
  whose names ``has_torch_function*`` (however the body reaches them: a module global, an
  attribute of ``torch.overrides`` or of ``torch``, or an import inside the body) answer False
  the first time they are asked, as the hook does. The copy reads and writes the function's real
  module globals (through an overlay that holds only the replaced names), so it sees the module
  as it is now. A function whose guard sits in a function it holds in its closure
  (``boolean_dispatch``'s ``fn`` around ``_max_pool2d``...) gets those copied too. A function
  whose guard cannot be found this way is refused by name (UnsupportedOpError), never run eagerly
  behind the tracer's back.
"""
from __future__ import annotations

import builtins
import re
import threading
import types
import warnings
from typing import Any, Callable, Optional

import torch
import torch.overrides

from kiln.errors import UnsupportedOpError

MIN_TORCH = (2, 4)   # oldest release CI tests (frontend tests)
NEXT_TORCH = (2, 15)  # first release not tested; CI's newest is the newest 2.14

_m = re.match(r"(\d+)\.(\d+)", torch.__version__)
TORCH_VERSION: tuple[int, int] = (int(_m.group(1)), int(_m.group(2))) if _m else (0, 0)
SUPPORTED = MIN_TORCH <= TORCH_VERSION < NEXT_TORCH

if not SUPPORTED:
    warnings.warn(f"kiln's tracer is tested with torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to "
                  f"{NEXT_TORCH[0]}.{NEXT_TORCH[1] - 1}; torch {torch.__version__} may trace differently",
                  stacklevel=2)

# ---------------------------------------------------------------------------- behaviour that changed
# scaled_dot_product_attention's math: a fully masked row (every key masked out) gives NaN up to
# torch 2.4 and zeros from 2.5 on, where the math backend's softmax became aten::_safe_softmax.
# kiln's graph follows the torch that traced it, so the trace check compares like with like.
SDPA_MASKED_ROWS_GIVE_ZEROS = hasattr(torch, "_safe_softmax")


# ---------------------------------------------------------------------------- redispatch
def redispatch_hook() -> Optional[Callable]:
    """torch's own skip-one-hop hook, or None where this torch has none."""
    hook = getattr(torch.overrides, "redispatch_function", None)
    if hook is None:
        c_hook = getattr(torch._C, "_skip_one_hop_torch_function", None)
        if c_hook is not None:
            def hook(func, types, args, kwargs):
                return c_hook(func, types, args, kwargs or {})
    return hook


def redispatch(func: Callable, types_: Any, args: tuple, kwargs: Optional[dict]) -> Any:
    """Run ``func(*args, **kwargs)`` with its own torch-function guard passed once, so its body
    runs under the TorchFunctionMode that is active (the caller re-enters it first).

    The hook is looked up at each call, so a test can take it away (monkeypatch) and run the
    route of a torch without it."""
    hook = redispatch_hook()
    if hook is not None:
        return hook(func, types_, args, kwargs or {})
    return call_past_guard(func, args, kwargs or {})


_HAS_NAMES = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_REAL = {n: getattr(torch.overrides, n) for n in _HAS_NAMES}
_local = threading.local()


class _OneShot:
    """The replaced ``has_torch_function*`` of one call: False the first time any is asked, then
    the real answer (a later guard in the same body dispatches as it would with the hook)."""

    def __init__(self) -> None:
        self.fired = False

    def make(self, name: str) -> Callable:
        real = _REAL[name]

        def check(*a: Any, **k: Any) -> bool:
            if not self.fired:
                self.fired = True
                return False
            return real(*a, **k)

        check.__name__ = name
        return check


class _ModuleView:
    """A stand-in for ``torch`` or ``torch.overrides`` that answers ``has_torch_function*`` (and
    ``.overrides``) with the one-shot replacements and everything else from the real module."""

    def __init__(self, module: types.ModuleType, replaced: dict[str, Any]) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_replaced", replaced)

    def __getattr__(self, name: str) -> Any:
        replaced = object.__getattribute__(self, "_replaced")
        if name in replaced:
            return replaced[name]
        return getattr(object.__getattribute__(self, "_module"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_module"), name, value)


class _Globals(dict):
    """A function's globals with a few names replaced; every other name is read live from the
    module (LOAD_GLOBAL takes ``__missing__`` for a dict subclass). Writes stay in the overlay,
    which torch's guarded functions never do."""

    def __init__(self, real: dict, replaced: dict[str, Any]) -> None:
        super().__init__(replaced)
        self._real = real

    def __missing__(self, key: str) -> Any:
        return self._real[key]


class _Names:
    """The replacements of one call: the check functions and the module views that lead to them."""

    def __init__(self) -> None:
        shot = _OneShot()
        self.checks = {n: shot.make(n) for n in _HAS_NAMES}
        self.shot = shot
        self.overrides = _ModuleView(torch.overrides, self.checks)
        self.torch = _ModuleView(torch, {"overrides": self.overrides})
        self.builtins = dict(vars(builtins))
        self.builtins["__import__"] = self._import

    def view(self, obj: Any) -> Any:
        if obj is torch.overrides:
            return self.overrides
        if obj is torch:
            return self.torch
        return obj

    def _import(self, name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        # ``from .overrides import has_torch_function`` inside the body (torch 2.4's _assert).
        # A relative import reads __package__ with dict.get, which skips the overlay's __missing__.
        if isinstance(globals, _Globals):
            globals = globals._real
        return self.view(builtins.__import__(name, globals, locals, fromlist, level))


def _mentions_guard(code: types.CodeType) -> bool:
    return any(n in code.co_names for n in _HAS_NAMES)


def _copy(func: types.FunctionType, names: _Names, depth: int = 0) -> tuple[types.FunctionType, bool]:
    """A copy of ``func`` running on the replaced names, and whether a guard was found in it (or
    in a function of its closure, two levels deep)."""
    code = func.__code__
    found = _mentions_guard(code)
    closure = func.__closure__
    if closure and depth < 2:
        cells = []
        for cell in closure:
            try:
                inner = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            if isinstance(inner, types.FunctionType):
                inner_copy, inner_found = _copy(inner, names, depth + 1)
                if inner_found:
                    found = True
                    cells.append(types.CellType(inner_copy))
                    continue
            cells.append(cell)
        closure = tuple(cells)
    replaced: dict[str, Any] = {}
    real_globals = func.__globals__
    if _mentions_guard(code):
        replaced["__builtins__"] = names.builtins  # its __import__ hands out the module views
        for n in code.co_names:
            if n in names.checks:
                replaced[n] = names.checks[n]
            elif n in real_globals and (real_globals[n] is torch or real_globals[n] is torch.overrides):
                replaced[n] = names.view(real_globals[n])
    copy = types.FunctionType(code, _Globals(real_globals, replaced), func.__name__, func.__defaults__, closure)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__dict__.update(func.__dict__)
    copy.__qualname__ = func.__qualname__
    copy.__module__ = func.__module__
    return copy, found


def call_past_guard(func: Callable, args: tuple, kwargs: dict) -> Any:
    """The hook-less route: call a copy of ``func`` whose first ``has_torch_function*`` check
    answers False (see the module docstring)."""
    from kiln.frontend.tracer import op_name

    target, bound = func, ()
    if isinstance(target, types.MethodType):
        target, bound = target.__func__, (target.__self__,)
    if not isinstance(target, types.FunctionType):
        raise UnsupportedOpError(f"cannot trace through '{op_name(func)}' on torch {torch.__version__}: "
                                 "it is not a plain Python function")
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    # Back here for the same function before its guard was passed: the guard is somewhere the
    # copy does not reach. Refuse instead of recursing forever.
    for f, names in stack:
        if f is target and not names.shot.fired:
            raise UnsupportedOpError(_refusal(func))
    names = _Names()
    copy, found = _copy(target, names)
    if not found:
        raise UnsupportedOpError(_refusal(func))
    stack.append((target, names))
    try:
        return copy(*bound, *args, **kwargs)
    finally:
        stack.pop()


def _refusal(func: Callable) -> str:
    from kiln.frontend.tracer import op_name

    return (f"cannot trace through the Python function '{op_name(func)}' on torch {torch.__version__}: "
            "this torch has no redispatch hook and kiln found no has_torch_function guard to pass in "
            "its body; add a mapping for it to kiln/frontend/torch_ops/")
