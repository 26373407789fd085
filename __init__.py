"""kiln: compile eager PyTorch and ONNX models to static .kiln files and run them without PyTorch.

The public API is small: build or capture an IR ``Graph``, optimize it, save it, load and run it.
Only numpy is imported here; frontends, serializers and backends load lazily when used.
"""
import importlib
from typing import TYPE_CHECKING

from kiln.errors import (ExecutionError, FormatError, InputError, KilnError, ResourceError, ScriptError,
                         ShapeInferenceError, TraceCheckError, TraceWarning, UnknownOpError, UnsupportedOpError,
                         VerifyError)
from kiln.version import __version__

# The rest of the API loads on first use (PEP 562): ``import kiln`` or ``import kiln.ir`` does not import the
# serializer, the runtime and every CPU kernel (tests/test_layers.py checks what each import loads).
_LAZY = {
    "IR_VERSION": "kiln.ir", "OPSET_VERSION": "kiln.ir", "DType": "kiln.ir", "Graph": "kiln.ir", "Node": "kiln.ir",
    "TensorType": "kiln.ir", "Value": "kiln.ir", "evaluate": "kiln.ir", "verify": "kiln.ir",
    "Program": "kiln.runtime", "load": "kiln.runtime",
    "LoadLimits": "kiln.serializer", "load_graph": "kiln.serializer", "load_graph_from_bytes": "kiln.serializer",
    "save": "kiln.serializer",
}
_SUBPACKAGES = ("ir", "frontend", "serializer", "runtime", "server", "mobile_stub", "tools")

if TYPE_CHECKING:  # for type checkers and IDEs: the names as if imported eagerly
    from kiln.ir import IR_VERSION, OPSET_VERSION, DType, Graph, Node, TensorType, Value, evaluate, verify
    from kiln.runtime import Program, load
    from kiln.serializer import LoadLimits, load_graph, load_graph_from_bytes, save


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    if name in _SUBPACKAGES:  # ``import kiln; kiln.runtime.X`` as if the subpackage had been imported
        return importlib.import_module(f"kiln.{name}")
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["__version__", "IR_VERSION", "OPSET_VERSION", "DType", "Graph", "Node", "TensorType", "Value",
           "evaluate", "verify", "KilnError", "FormatError", "InputError", "ShapeInferenceError",
           "UnknownOpError", "VerifyError", "UnsupportedOpError", "TraceCheckError", "TraceWarning",
           "ExecutionError", "ResourceError", "ScriptError", "save", "load_graph", "load_graph_from_bytes",
           "LoadLimits", "trace", "script", "load", "Program", "export_onnx", "import_onnx"]


def trace(model, example_inputs, **kwargs):
    """Trace an eager PyTorch model into a kiln Graph (see :func:`kiln.frontend.trace.trace`).
    Imports torch on first use, so ``import kiln`` stays light."""
    from kiln.frontend.trace import trace as _trace
    return _trace(model, example_inputs, **kwargs)


def script(module_or_function, example_inputs=None, **kwargs):
    """Compile a model's Python source into a kiln Graph, keeping data-dependent ``if``/``for``/``while``
    as If/Loop nodes (see :func:`kiln.frontend.script.script`). Without example inputs, mark a module
    class, module or function instead (``@kiln.script``), so that kiln.trace keeps its control flow
    when it traces a model that calls it. Imports torch on first use."""
    from kiln.frontend.script import script as _script
    return _script(module_or_function, example_inputs, **kwargs)


def export_onnx(graph, path, **kwargs):
    """Write a kiln Graph as an ONNX file (see :func:`kiln.serializer.onnx.export_onnx`).
    Imports onnx on first use; needs ``pip install 'kiln-compiler[onnx]'``."""
    from kiln.errors import optional_module
    return optional_module("kiln.serializer.onnx", "kiln.export_onnx").export_onnx(graph, path, **kwargs)


def import_onnx(model, **kwargs):
    """Read an ONNX model (a path, a ModelProto or its bytes) into a kiln Graph (see
    :func:`kiln.serializer.onnx_import.import_onnx`). Imports onnx on first use; needs ``pip install 'kiln-compiler[onnx]'``."""
    from kiln.errors import optional_module
    return optional_module("kiln.serializer.onnx_import", "kiln.import_onnx").import_onnx(model, **kwargs)
