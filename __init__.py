"""kiln: compile eager PyTorch and ONNX models to static .kiln files and run them without PyTorch.

The public API is small: build or capture an IR ``Graph``, optimize it, save it, load and run it.
Only numpy is imported here; frontends, serializers and backends load lazily when used.
"""
from kiln.errors import (ExecutionError, FormatError, InputError, KilnError, ResourceError, ScriptError,
                         ShapeInferenceError, TraceCheckError, TraceWarning, UnknownOpError, UnsupportedOpError,
                         VerifyError)
from kiln.ir import (IR_VERSION, OPSET_VERSION, DType, Graph, Node, TensorType, Value, evaluate,
                     verify)
from kiln.runtime import Program, load
from kiln.serializer import LoadLimits, load_graph, load_graph_from_bytes, save
from kiln.version import __version__

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
    Imports onnx on first use; needs ``pip install kiln[onnx]``."""
    from kiln.runtime.onnxruntime_backend import optional_module
    return optional_module("kiln.serializer.onnx", "kiln.export_onnx").export_onnx(graph, path, **kwargs)


def import_onnx(model, **kwargs):
    """Read an ONNX model (a path, a ModelProto or its bytes) into a kiln Graph (see
    :func:`kiln.serializer.onnx_import.import_onnx`). Imports onnx on first use; needs ``pip install kiln[onnx]``."""
    from kiln.runtime.onnxruntime_backend import optional_module
    return optional_module("kiln.serializer.onnx_import", "kiln.import_onnx").import_onnx(model, **kwargs)
