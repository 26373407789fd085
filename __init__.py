"""kiln: compile eager PyTorch and ONNX models to static .kiln files and run them without PyTorch.

The public API is small: build or capture an IR ``Graph``, optimize it, save it, load and run it.
Only numpy is imported here; frontends, serializers and backends load lazily when used.
"""
from __future__ import annotations  # the wrappers' annotations stay text: torch and onnx are not imported

import importlib
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from kiln import blas_env
from kiln.errors import (ExecutionError, FormatError, InputError, KilnError, ResourceError, ScriptError,
                         ShapeInferenceError, TraceCheckError, TraceWarning, UnknownOpError, UnsupportedOpError,
                         VerifyError)
from kiln.version import __version__

blas_env.choose()  # before anything loads numpy: OpenBLAS's AVX-512 kernels on CPUs it does not know (Zen 5)

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
    # what the wrappers' annotations below name (tests/test_public_api.py keeps them equal to the real ones)
    import os
    from pathlib import Path

    import torch

    from kiln.frontend.trace import Dynamic, Ranges
    from kiln.serializer.onnx_import import ModelLike


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


# The wrappers below import their frontend (torch, onnx) on first call. Their signatures are the real functions',
# written out (not ``**kwargs``), so help(kiln.trace), IDEs and inspect.signature show every option without
# importing torch; tests/test_public_api.py checks each one equals the real function's and forwards every argument.
def trace(model: Union[torch.nn.Module, Callable], example_inputs: Any, *, dynamic: Optional[Dynamic] = None,
          dynamic_batch: bool = False, check: bool = True, optimize: bool = True, name: Optional[str] = None,
          rtol: float = 1e-4, atol: float = 1e-5, guards: bool = True, ranges: Optional[Ranges] = None) -> Graph:
    """Trace an eager PyTorch model (or function) on ``example_inputs`` (a tensor, a tuple of tensors, or a dict
    by argument name) into a kiln Graph.

    ``dynamic`` names symbolic dims per input (``{"x": {0: "batch"}}``); ``dynamic_batch=True`` makes dim 0 of
    every input the symbol ``batch``. ``check`` compares the graph with the model on the examples and on fresh
    inputs (TraceCheckError if they differ beyond ``rtol``/``atol``; ``ranges`` gives an input's ``(low, high)``).
    ``optimize`` runs the pass pipeline; ``name`` names the graph (default: the model's class); ``guards`` makes
    the graph refuse inputs for which a value read from tensor data in Python would differ. The full story:
    :func:`kiln.frontend.trace.trace`. Imports torch on first use, so ``import kiln`` stays light.
    """
    from kiln.frontend.trace import trace as _trace
    return _trace(model, example_inputs, dynamic=dynamic, dynamic_batch=dynamic_batch, check=check,
                  optimize=optimize, name=name, rtol=rtol, atol=atol, guards=guards, ranges=ranges)


def script(module_or_function: Any, example_inputs: Any = None, *, dynamic=None, dynamic_batch: bool = False,
           check: bool = True, optimize: bool = True, name: Optional[str] = None, rtol: float = 1e-4,
           atol: float = 1e-5, guards: bool = True, ranges=None):
    """Compile a model's Python source into a kiln Graph, keeping data-dependent ``if``/``for``/``while``
    as If/Loop nodes; the options are :func:`kiln.trace`'s (see :func:`kiln.frontend.script.script`).

    Without example inputs, mark a module class, module or function instead (``@kiln.script``), so that
    kiln.trace keeps its control flow when it traces a model that calls it. Imports torch on first use.
    """
    from kiln.frontend.script import script as _script
    return _script(module_or_function, example_inputs, dynamic=dynamic, dynamic_batch=dynamic_batch, check=check,
                   optimize=optimize, name=name, rtol=rtol, atol=atol, guards=guards, ranges=ranges)


def export_onnx(graph: Graph, path: Union[str, os.PathLike], *, opset: Optional[int] = None,
                external_data: Optional[bool] = None, size_threshold: int = 1024) -> Path:
    """Write a kiln Graph as an ONNX file; returns its path (see :func:`kiln.serializer.onnx.export_onnx`).

    ``opset``: the ONNX opset (default 18, higher where an op of the graph needs it). ``external_data``: None stores
    initializers of ``size_threshold`` bytes or more in ``<file name>.data`` only when the model would pass
    protobuf's 2 GB limit; True always, False never. Imports onnx on first use; needs
    ``pip install 'kiln-compiler[onnx]'``.
    """
    from kiln.errors import optional_module
    return optional_module("kiln.serializer.onnx", "kiln.export_onnx").export_onnx(
        graph, path, opset=opset, external_data=external_data, size_threshold=size_threshold)


def import_onnx(model: ModelLike, *, base_dir: Optional[Union[str, os.PathLike]] = None,
                check: bool = True) -> Graph:
    """Read an ONNX model (a path, a ModelProto or its bytes) into a kiln Graph (see
    :func:`kiln.serializer.onnx_import.import_onnx`).

    ``base_dir``: the folder external tensor data is read from (default: the model file's folder). ``check``
    also runs ``kiln.verify`` on the result. Imports onnx on first use; needs ``pip install 'kiln-compiler[onnx]'``.
    """
    from kiln.errors import optional_module
    return optional_module("kiln.serializer.onnx_import", "kiln.import_onnx").import_onnx(
        model, base_dir=base_dir, check=check)
