"""kiln: compile eager PyTorch and ONNX models to static .kiln files and run them without PyTorch.

The public API is small: build or capture an IR ``Graph``, optimize it, save it, load and run it.
Only numpy is imported here; frontends, serializers and backends load lazily when used.
"""
from kiln.errors import (ExecutionError, FormatError, InputError, KilnError, ShapeInferenceError, TraceCheckError, TraceWarning,
                         UnknownOpError, UnsupportedOpError, VerifyError)
from kiln.ir import (IR_VERSION, OPSET_VERSION, DType, Graph, Node, TensorType, Value, evaluate,
                     verify)
from kiln.runtime import Program, load
from kiln.serializer import load_graph, load_graph_from_bytes, save
from kiln.version import __version__

__all__ = ["__version__", "IR_VERSION", "OPSET_VERSION", "DType", "Graph", "Node", "TensorType", "Value",
           "evaluate", "verify", "KilnError", "FormatError", "InputError", "ShapeInferenceError",
           "UnknownOpError", "VerifyError", "UnsupportedOpError", "TraceCheckError", "TraceWarning",
           "ExecutionError", "save", "load_graph", "load_graph_from_bytes", "trace", "load", "Program"]


def trace(model, example_inputs, **kwargs):
    """Trace an eager PyTorch model into a kiln Graph (see :func:`kiln.frontend.trace.trace`).
    Imports torch on first use, so ``import kiln`` stays light."""
    from kiln.frontend.trace import trace as _trace
    return _trace(model, example_inputs, **kwargs)
