"""ONNX Runtime as an execution backend: ``kiln.load(model, backend="onnxruntime")``.

Why: a user can run the same model through kiln's runtime and through ONNX Runtime behind one
interface, to compare results and speed, or to fall back per model (an op kiln's CPU runtime is slow
at, a GPU through ORT's CUDA provider). ``OrtProgram`` therefore mirrors ``runtime.program.Program``:
``inputs`` / ``outputs`` (TensorSpec), ``metadata``, ``run(inputs, as_list=False)`` with the very same
input checks and InputError messages (``program.check_inputs``), ``backend``; failures inside ORT
become ``kiln.ExecutionError``. ``run`` is thread-safe because ``InferenceSession.run`` is.

Where the model comes from decides what ORT gets:
- a ``.onnx`` file is handed over by path, so ORT resolves external data next to it itself; the input
  and output specs come from the session (ORT is the authority on what it accepts), the metadata from
  the file's header fields (read without its external data);
- a ``.kiln`` file or an in-memory Graph is exported to ONNX in memory (``serializer.onnx.to_onnx_model``)
  and handed over as bytes; specs and metadata come from the kiln graph, so they are exactly those of
  ``Program``. A model over protobuf's 2 GB limit goes through a temporary folder with external data.
kiln's optimization passes are not run for ORT: ``optimize`` selects ORT's own graph optimizations.

onnx and onnxruntime are optional (the ``onnx`` extra): this module imports them only inside
functions, so importing it costs nothing and a missing package is a KilnError saying what to install.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from kiln.errors import ExecutionError, KilnError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph
from kiln.ir.types import TensorType
from kiln.runtime.program import TensorSpec, check_inputs, is_onnx_path

INSTALL_HINT = "pip install 'kiln-compiler[onnx]'"
from kiln.errors import optional_module  # noqa: E402  (re-exported: callers of this module use it)
# Weights above this go to ORT through a file with external data: a serialized ModelProto must stay under
# 2 GB, and the margin leaves room for the graph itself and constants held in node attributes.
_INLINE_LIMIT = 2 ** 31 - 2 ** 26

# ORT's NodeArg.type strings for the element types kiln has.
_ORT_TYPES = {"tensor(float)": DType.FLOAT32, "tensor(uint8)": DType.UINT8, "tensor(int8)": DType.INT8,
              "tensor(int16)": DType.INT16, "tensor(uint16)": DType.UINT16,
              "tensor(uint32)": DType.UINT32, "tensor(uint64)": DType.UINT64, "tensor(int32)": DType.INT32, "tensor(int64)": DType.INT64,
              "tensor(bool)": DType.BOOL, "tensor(float16)": DType.FLOAT16, "tensor(double)": DType.FLOAT64,
              "tensor(bfloat16)": DType.BFLOAT16}


def choose_providers(device: str, available: Sequence[str]) -> list[str]:
    """ORT execution providers for ``device``: 'cpu'; 'cuda' or 'cuda:N' (the CUDA provider, required);
    'auto' (CUDA when onnxruntime-gpu offers it, else CPU). The CPU provider always comes last, for
    the ops a GPU provider does not take."""
    kind, _, index = device.partition(":")
    if kind not in ("cpu", "cuda", "auto") or (index and (kind != "cuda" or not index.isdigit())):
        raise KilnError(f"unknown device {device!r} for the onnxruntime backend: choose 'cpu', 'cuda', 'cuda:N' "
                        "or 'auto'")
    cuda = "CUDAExecutionProvider" in available
    if kind == "cuda" and not cuda:
        raise KilnError(f"device {device!r}: this onnxruntime has no CUDAExecutionProvider (it offers "
                        f"{', '.join(available) or 'none'}); install onnxruntime-gpu instead of onnxruntime")
    if kind == "cpu" or not cuda:
        return ["CPUExecutionProvider"]
    return ["CUDAExecutionProvider", "CPUExecutionProvider"]


class OrtProgram:
    """A model running in ONNX Runtime, with the interface of ``kiln.Program``.

    ``model``: a .onnx or .kiln path, or a Graph. ``graph`` is the kiln Graph when there is one (None
    for a .onnx file); ``session`` the ``onnxruntime.InferenceSession``; ``providers`` what it uses."""

    backend = "onnxruntime"

    def __init__(self, model: Union[str, os.PathLike, Graph], *, device: str = "cpu", optimize: bool = True,
                 threads: Optional[int] = None):
        ort = optional_module("onnxruntime", "the onnxruntime backend")
        providers = choose_providers(device, ort.get_available_providers())
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: ORT's warnings (unused initializers, ...) are noise here
        options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                             else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        if threads is not None:
            if threads < 1:
                raise KilnError(f"threads must be at least 1, got {threads}")
            options.intra_op_num_threads = threads
        provider_options = [{"device_id": int(device.partition(":")[2] or 0)} if p == "CUDAExecutionProvider"
                            else {} for p in providers]
        self._tmp: Optional[tempfile.TemporaryDirectory] = None  # holds >2 GB exports while the session lives
        self.graph: Optional[Graph] = None
        if isinstance(model, Graph) or not is_onnx_path(model):
            if not isinstance(model, Graph):
                from kiln.serializer.reader import load_graph
                model = load_graph(model)
            self.graph = model
            source: Union[str, bytes] = self._export(model)
        else:
            if not os.path.isfile(model):
                raise KilnError(f"no such file: {os.fspath(model)}")
            source = os.fspath(model)
        try:
            self.session = ort.InferenceSession(source, sess_options=options, providers=providers,
                                                provider_options=provider_options)
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            what = source if isinstance(source, str) else "the model (exported from kiln)"
            raise KilnError(f"onnxruntime cannot load {what}: {type(e).__name__}: {e}") from e
        self.providers = self.session.get_providers()
        if device.startswith("cuda") and "CUDAExecutionProvider" not in self.providers:
            raise KilnError(f"device {device!r}: onnxruntime could not start its CUDA provider (no usable GPU or "
                            "CUDA libraries?); use device='cpu' or 'auto'")
        self._ort_inputs = [a.name for a in self.session.get_inputs()]
        self._ort_outputs = [a.name for a in self.session.get_outputs()]
        if self.graph is not None:
            self.inputs = [TensorSpec(v.name, v.type) for v in self.graph.inputs]
            self.outputs = [TensorSpec(v.name, v.type) for v in self.graph.outputs]
            self.metadata = _graph_metadata(self.graph)
            if (len(self.inputs), len(self.outputs)) != (len(self._ort_inputs), len(self._ort_outputs)):
                raise KilnError(f"the exported ONNX model has {len(self._ort_inputs)} inputs and "
                                f"{len(self._ort_outputs)} outputs, the kiln graph {len(self.inputs)} and "
                                f"{len(self.outputs)}")
        else:
            self.inputs = [_spec(a, "input") for a in self.session.get_inputs()]
            self.outputs = [_spec(a, "output") for a in self.session.get_outputs()]
            self.metadata = _onnx_metadata(source)

    def _export(self, graph: Graph) -> Union[str, bytes]:
        """The graph as ONNX for ORT: serialized bytes, or, when its weights would take a protobuf message
        past 2 GB, the path of a temporary file with external data (kept until this program goes)."""
        onnx_export = optional_module("kiln.serializer.onnx", "running a kiln model in onnxruntime")
        weights = sum(v.const.nbytes for g in graph.all_graphs() for v in g.initializers.values())
        if weights < _INLINE_LIMIT:
            return onnx_export.to_onnx_model(graph).SerializeToString()
        self._tmp = tempfile.TemporaryDirectory(prefix="kiln-ort-")
        path = Path(self._tmp.name) / "model.onnx"
        onnx_export.export_onnx(graph, path, external_data=True)
        return str(path)

    def run(self, inputs: Union[Mapping[str, Any], Sequence[Any]], *, as_list: bool = False):
        """Run on numpy arrays given by name (a dict) or in order; returns a dict by output name (or a
        list with ``as_list``). Inputs are checked as ``Program.run`` checks them, before ORT sees them."""
        arrays = check_inputs(self.inputs, inputs)
        # ORT reads C-contiguous buffers; 0-d arrays are contiguous already (ascontiguousarray would make them 1-d).
        feed = {n: a if a.flags.c_contiguous else np.ascontiguousarray(a) for n, a in zip(self._ort_inputs, arrays)}
        try:
            outs = self.session.run(self._ort_outputs, feed)
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise ExecutionError(f"onnxruntime failed: {type(e).__name__}: {e}") from e
        outs = [np.asarray(o) for o in outs]
        return outs if as_list else dict(zip((o.name for o in self.outputs), outs))

    __call__ = run

    def __repr__(self) -> str:
        return (f"OrtProgram(inputs={[s.name for s in self.inputs]}, outputs={[s.name for s in self.outputs]}, "
                f"providers={self.providers})")


def _spec(arg: Any, what: str) -> TensorSpec:
    """A TensorSpec from an ORT NodeArg: dim_params stay symbols, unknown dims None."""
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise KilnError(f"{what} '{arg.name}' has type {arg.type}, which kiln's Program interface cannot describe "
                        f"(kiln has {', '.join(d.short for d in DType)})")
    shape = arg.shape
    dims = None if shape is None else tuple(d if isinstance(d, (int, str)) and d != "" else None for d in shape)
    return TensorSpec(arg.name, TensorType(dtype, dims))


def _graph_metadata(graph: Graph) -> dict:
    from kiln.runtime.program import program_metadata
    return program_metadata(graph)


def _onnx_metadata(path: str) -> dict:
    """The .onnx file's producer, doc string and metadata_props, in Program.metadata's keys (read without
    its external data; ORT's ModelMetadata lacks producer_version)."""
    proto = optional_module("onnx", "reading .onnx metadata").load_model(path, load_external_data=False)
    return {"producer_name": proto.producer_name, "producer_version": proto.producer_version,
            "doc_string": proto.doc_string, **{p.key: p.value for p in proto.metadata_props}}
