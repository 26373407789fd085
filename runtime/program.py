"""``kiln.load``: a .kiln file (or a Graph) turned into a Program whose ``run`` is one loop over a
flat instruction list. No torch, no onnx: numpy (and flatbuffers to read the file).

``load`` is also where the optional ONNX paths branch off: a ``.onnx`` file is imported into a Graph
first (needs the ``onnx`` package), and ``backend="onnxruntime"`` hands the model to ONNX Runtime
behind the same interface (runtime/onnxruntime_backend.py). Both are imported only when asked for."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from kiln.errors import ExecutionError, InputError, KilnError, ResourceError, VerifyError
from kiln.ir.graph import Graph, Node
from kiln.ir.types import TensorType
from kiln.runtime.allocator import tune_allocator
from kiln.runtime.control import if_kernel, loop_kernel
from kiln.runtime.kernels import cpu
from kiln.runtime.plan import MemoryEstimate, Plan, PlanBuilder, execute
from kiln.runtime.specialize import ShapeChanged, Specialized, Specializer, signature
from kiln.runtime.threads import ThreadPolicy

_CONTROL = {"If": if_kernel, "Loop": loop_kernel}


@dataclass(frozen=True)
class TensorSpec:
    """A program input or output: name, dtype and shape (symbols as names, unknown dims as None)."""

    name: str
    type: TensorType

    @property
    def dtype(self) -> str:
        return self.type.dtype.short

    @property
    def shape(self) -> Optional[tuple]:
        return self.type.shape


def _choose_cpu(node: Node, builder: PlanBuilder):
    if node.domain == "" and node.op in _CONTROL:
        return _CONTROL[node.op](node, builder)
    try:
        return cpu.choose(node, node.schema.fill_attrs(node.attrs))
    except KilnError:
        raise
    except Exception as e:  # noqa: BLE001 - a kernel factory refusing its constants: name the node
        # The verifier rejects the forms the schemas forbid (issue 16); this is the backstop,
        # so that a kernel factory's surprise is a kiln error naming the node, never a TypeError.
        raise VerifyError(f"{node.describe()}: its CPU kernel cannot be built from the node's "
                          f"constants and attributes: {type(e).__name__}: {e}") from e


def parse_bytes(value: Union[int, str, None], what: str = "memory_budget") -> Optional[int]:
    """A byte count from an int or a string such as ``"8GiB"``, ``"512MB"``, ``"1e9"``; None stays None."""
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        if value is not None and value <= 0:
            raise KilnError(f"{what} must be a positive number of bytes, not {value}")
        return value
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        units = (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("tib", 1 << 40), ("kb", 10**3),
                 ("mb", 10**6), ("gb", 10**9), ("tb", 10**12), ("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30),
                 ("t", 1 << 40), ("b", 1))
        scale = 1
        for suffix, mult in units:
            if text.endswith(suffix):
                text, scale = text[:-len(suffix)], mult
                break
        try:
            number = float(text)
        except ValueError:
            number = -1.0
        if number > 0 and number * scale < 2**63:
            return int(number * scale)
    raise KilnError(f"{what} must be a positive number of bytes (an int, or a string like '8GiB'), not {value!r}")


def default_memory_budget() -> Optional[int]:
    """The per-run memory budget a program gets when ``kiln.load`` is given none: the environment
    variable ``KILN_MEMORY_BUDGET`` (e.g. ``8GiB``), else no budget."""
    return parse_bytes(os.environ.get("KILN_MEMORY_BUDGET") or None, "KILN_MEMORY_BUDGET")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Program:
    """A loaded model. ``run`` is safe to call from several threads at once."""

    backend = "kiln"  # which engine runs it (OrtProgram says "onnxruntime")

    def __init__(self, graph: Graph, *, memory_budget: Union[int, str, None] = None, threads: Optional[int] = None):
        tune_allocator()  # large activations stay in the heap between runs (see runtime/allocator.py)
        self.graph = graph
        # BLAS threads per run: at most ``threads`` (default: the BLAS's own count), 1 while the host is busy.
        self.threads = ThreadPolicy(threads)
        builder = PlanBuilder(_choose_cpu)
        self.plan: Plan = builder.build(graph)
        self._template = builder.template
        # The per-run memory budget (issue 16): the plan's peak estimate, from the value types,
        # checked at load when every size is static and before each run's first kernel otherwise.
        self.memory_budget = parse_bytes(memory_budget)
        types = {s: v.type for v, s in builder.slots.items() if v.graph is graph}
        self.memory = MemoryEstimate(self.plan, self._template, types)
        self._symbols = [(i, j, d) for i, v in enumerate(graph.inputs) if v.type.shape is not None
                         for j, d in enumerate(v.type.shape) if isinstance(d, str)]
        self._peaks: dict = {}  # symbol values -> estimate (bounded like _accepted)
        if self.memory_budget is not None and self.memory.static is not None \
                and self.memory.static > self.memory_budget:
            raise ResourceError(f"model '{graph.name}': a run needs about {_gib(self.memory.static)} of buffers "
                                f"(the plan's peak, from its static shapes), more than the memory budget of "
                                f"{_gib(self.memory_budget)} (kiln.load(..., memory_budget=))")
        self.inputs = [TensorSpec(v.name, v.type) for v in graph.inputs]
        self.outputs = [TensorSpec(v.name, v.type) for v in graph.outputs]
        self._input_names = tuple(s.name for s in self.inputs)
        self._output_names = tuple(o.name for o in self.outputs)
        self._accepted: dict = {}  # input signatures that passed check_inputs (see _check_inputs)
        # Outputs that are a constant or a graph input are copied out: the caller must never get
        # (and then write into) the model's own weights or the array it passed in.
        self._copy_out = frozenset(s for s in self.plan.output_slots
                                   if self._template[s] is not None or s in self.plan.input_slots)
        self.metadata = program_metadata(graph)
        # Plans specialized per input signature: shape computations run once per signature (runtime/specialize.py).
        specializer = Specializer(self.plan, self._template)
        self._specializer = specializer if specializer.useful else None

    def run(self, inputs: Union[Mapping[str, Any], Sequence[Any]], *, as_list: bool = False):
        """Run on numpy arrays given by name (a dict) or in order; returns a dict by output name
        (or a list with ``as_list``). Inputs are checked before any kernel runs."""
        arrays, key = self._signature(inputs)
        if self.memory_budget is not None and self.memory.static is None:
            self._check_memory(arrays)
        plan, template = self.plan, self._template
        specializer = self._specializer
        special = specializer.lookup(key) if specializer is not None else None
        if special is not None and special is not True:
            plan, template = special.plan, special.template
        slots = template.copy()
        for s, a in zip(plan.input_slots, arrays):
            slots[s] = a
        self.threads.apply()
        try:
            if special is True:
                specializer.build(key, specializer.record(slots))
            else:
                execute(plan, slots)
        except KilnError:
            raise
        except ShapeChanged as e:  # a specialized plan's guard: this call starts over on the generic plan
            specializer.give_up(key, e)
            return self.run(inputs, as_list=as_list)
        except Exception as e:  # noqa: BLE001 - re-raised naming the node
            raise _execution_error(plan, slots, e) from e
        outs = []
        for s in plan.output_slots:
            a = slots[s]
            if s in self._copy_out:
                outs.append(np.array(a, copy=True))
            else:
                # The usual output, a fresh writeable ndarray, is returned as it is; the rest go
                # through _output.
                outs.append(a if type(a) is np.ndarray and a.flags.writeable else self._output(a))
        return outs if as_list else dict(zip(self._output_names, outs))

    __call__ = run

    def _specialized(self, arrays: list) -> Optional[Specialized]:
        """The plan specialized to these checked arrays' signature, if one was made (runtime/specialize.py)."""
        return None if self._specializer is None else self._specializer.specialized(signature(arrays))

    def _plan_for(self, arrays: list) -> tuple:
        """(plan, slot template) a run on these checked arrays takes (the profiler times what runs)."""
        special = self._specialized(arrays)
        return (self.plan, self._template) if special is None else (special.plan, special.template)

    def estimate_memory(self, inputs: Union[Mapping[str, Any], Sequence[Any], None] = None) -> int:
        """The plan's peak buffer bytes for these inputs (their shapes bind the symbolic dims; none
        needed for a static plan), the number the memory budget is checked against."""
        if self.memory.static is not None:
            return self.memory.static
        return self._peak(self._check_inputs(inputs if inputs is not None else {}))

    def _peak(self, arrays: list) -> int:
        key = tuple(arrays[i].shape[j] if j < arrays[i].ndim else None for i, j, _ in self._symbols)
        peak = self._peaks.get(key)
        if peak is None:
            bindings = {}
            for (i, j, d), size in zip(self._symbols, key):
                bindings.setdefault(d, size)
            peak = self.memory.peak(bindings)
            if len(self._peaks) >= self.ACCEPTED_MAX:
                self._peaks.clear()
            self._peaks[key] = peak
        return peak

    def _check_memory(self, arrays: list) -> None:
        peak = self._peak(arrays)
        if peak > self.memory_budget:
            bound = ", ".join(f"{d}={arrays[i].shape[j]}" for i, j, d in self._symbols)
            raise ResourceError(f"this request needs about {_gib(peak)} of buffers ({bound}), more than the "
                                f"model's memory budget of {_gib(self.memory_budget)}; send smaller inputs "
                                f"(the limit is kiln.load(..., memory_budget=))")

    @staticmethod
    def _output(a: Any) -> np.ndarray:
        a = np.asarray(a)
        # A constant output would be a read-only view into the model file: give the caller its own.
        return a if a.flags.writeable else a.copy()

    # At most this many accepted input signatures are remembered: a model run on ever new shapes
    # (a dynamic sequence length) starts over rather than growing without bound.
    ACCEPTED_MAX = 256

    def _check_inputs(self, inputs: Union[Mapping[str, Any], Sequence[Any]]) -> list:
        return self._signature(inputs)[0]

    def _signature(self, inputs: Union[Mapping[str, Any], Sequence[Any]]) -> tuple:
        """(arrays, signature): check_inputs, with its verdict remembered per input signature (issue 5: at batch 1 the
        symbolic shape matching was a visible part of a small model's run).

        The signature of exact ndarrays given as a dict holding just the model's input names, or as
        a list/tuple of the right length, is their (shape, dtype)s in input order: check_inputs
        depends on nothing else for them (np.asarray returns them unchanged), so a signature that
        passed once passes again, and the check is skipped. Anything else, and every signature
        not seen yet, takes the full check, which also raises exactly as before. The cache holds
        only immutable keys and is read and written with single dict operations, so concurrent
        runs share it safely. The signature is None for inputs given any other way."""
        names = self._input_names
        given = None
        if type(inputs) is dict:
            if len(inputs) == len(names):
                try:
                    given = [inputs[n] for n in names]
                except KeyError:
                    pass
        elif type(inputs) is list or type(inputs) is tuple:
            if len(inputs) == len(names):
                given = inputs
        if given is None:
            return check_inputs(self.inputs, inputs), None
        for a in given:
            if type(a) is not np.ndarray:
                return check_inputs(self.inputs, inputs), None
        key = signature(given)
        if key in self._accepted:
            return list(given), key
        arrays = check_inputs(self.inputs, inputs)
        if len(self._accepted) >= self.ACCEPTED_MAX:
            self._accepted.clear()
        self._accepted[key] = True
        return arrays, key


def check_inputs(specs: Sequence[TensorSpec], inputs: Union[Mapping[str, Any], Sequence[Any]]) -> list:
    """``inputs`` (by name or in order) as arrays in the order of ``specs``, or an InputError naming the
    input, the expected type and the actual one. Shared by every backend, so all check alike."""
    if isinstance(inputs, Mapping):
        missing = [s.name for s in specs if s.name not in inputs]
        extra = sorted(set(inputs) - {s.name for s in specs})
        if missing or extra:
            raise InputError(f"the model takes inputs {[s.name for s in specs]}; missing {missing}"
                             + (f", unexpected {extra}" if extra else ""))
        given = [inputs[s.name] for s in specs]
    else:
        given = list(inputs)
        if len(given) != len(specs):
            raise InputError(f"the model takes {len(specs)} inputs ({', '.join(s.name for s in specs)}), "
                             f"got {len(given)}")
    arrays, bindings = [], {}
    for spec, x in zip(specs, given):
        a = np.asarray(x)
        earlier = dict(bindings)  # symbols bound by the inputs before this one
        if not spec.type.matches(a, bindings):
            raise InputError(_mismatch(spec, a, earlier))
        arrays.append(a)
    return arrays


def _mismatch(spec: TensorSpec, a: np.ndarray, bindings: dict) -> str:
    got = f"{a.dtype}{list(a.shape)}"
    msg = f"input '{spec.name}': expected {spec.type}, got {got}"
    symbols = [d for d in (spec.type.shape or ()) if isinstance(d, str) and d in bindings]
    if symbols:
        msg += " (" + ", ".join(f"{d}={bindings[d]} from an earlier input" for d in dict.fromkeys(symbols)) + ")"
    return msg


def _describe(x: Any) -> str:
    """dtype[shape] of a slot's value: numpy or CuPy arrays, or Python scalars."""
    if x is None:
        return "None"
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    return f"{x.dtype}{list(x.shape)}"


def _execution_error(plan: Plan, slots: list, e: Exception) -> ExecutionError:
    """An ExecutionError naming the failing instruction (the first whose outputs were not
    written), its node and its inputs' types. Shared by the CPU and CUDA programs."""
    for ins in plan.instructions:
        if any(slots[s] is None for s in ins.outputs):
            shapes = ", ".join("None" if s < 0 else _describe(slots[s]) for s in ins.inputs)
            return ExecutionError(f"while running {ins.node.describe()} on inputs ({shapes}): "
                                  f"{type(e).__name__}: {e}")
    return ExecutionError(f"{type(e).__name__}: {e}")


BACKENDS = ("kiln", "onnxruntime")


def load(model: Union[str, os.PathLike, Graph], device: str = "cpu", *, optimize: bool = True,
         backend: str = "kiln", threads: Optional[int] = None, limits=None,
         memory_budget: Union[int, str, None] = None, precision: Optional[str] = None,
         weights: Optional[str] = None, **cuda_options):
    """Load a .kiln or .onnx file (or take a Graph) and make it runnable.

    ``backend="kiln"`` (default): kiln's CPU runtime builds an execution plan; a .onnx file is imported
    first (``kiln.import_onnx``), and ``optimize`` runs the pass pipeline (a no-op on a file exported
    optimized). ``backend="onnxruntime"``: an ``OrtProgram`` with the same interface, running in ONNX
    Runtime (a .kiln file or Graph is exported to ONNX in memory); ``optimize`` is then ORT's own graph
    optimization, ``device`` 'cpu', 'cuda[:N]' or 'auto' picks its execution provider, and ``threads`` its
    intra-op thread count (default: ORT's). Both need ``pip install 'kiln-compiler[onnx]'``.

    ``threads`` (kiln's CPU runtime): the most BLAS threads a run uses (default: numpy's BLAS's own count, i.e.
    the cores, or ``OPENBLAS_NUM_THREADS``). A run drops to one thread while every core this process may use
    is taken by other runnable tasks (a busy host): a BLAS team on an oversubscribed host waits at its barrier
    for preempted members, which made a small MLP 450x slower (``kiln.runtime.threads``).

    ``device="auto"``: the GPU where CuPy sees one, else the CPU (as for the onnxruntime backend).
    ``device="cuda"`` (kiln backend): a ``CudaProgram`` on the current CUDA device through CuPy
    (``pip install 'kiln-compiler[gpu]'``); ``cuda_options`` go to it (``output="cupy"|"numpy"``,
    ``tf32=False``, ``cuda_graphs=True|False|"auto"``, ``fuse=True``, ``conv="auto"|"cudnn"|"im2col"``,
    ``attention="auto"|"kernel"|"ops"``, ``cudnn_workspace_mib=32`` (``"none"``: no cap),
    ``cudnn_epilogue=True``, ``wait="poll"|"block"`` (how a run with host outputs waits for its GPU work:
    polling, or in cudaEventSynchronize without the GIL), or a whole
    ``options=kiln.runtime.cuda_options.CudaOptions(...)``):
    settings of that program alone, never of the process (issue 17).

    Untrusted files (issue 16): ``limits`` (a ``kiln.LoadLimits``) bounds what reading a .kiln file
    may cost -- nodes, values, nesting, graph bytes, memory, seconds -- refusing a file past one
    with FormatError (default ``LoadLimits()``). ``memory_budget`` (bytes, or a string such as
    ``"8GiB"``; default the environment variable ``KILN_MEMORY_BUDGET``, else none) bounds the
    buffers one run may allocate, estimated from the plan: a model whose static plan needs more
    is refused at load, and a request whose input shapes make it need more is refused before any
    kernel runs, both with ``kiln.ResourceError`` (CPU runtime).

    Half precision (issue 18): ``precision="fp16"|"bf16"`` converts a float32 model at load
    (``kiln.ir.passes.precision.convert_precision``: weights cast once, activations in half, the op
    policy's float32 ops kept in float32, the model's float32 inputs and outputs unchanged); a file already
    converted (``kiln convert --precision``, ``kiln export --precision``) needs nothing. The CPU runtime runs
    a half model in float32 (numpy has no fast half arithmetic and no bfloat16): its half weights are
    widened at load, so it answers as the GPU's half run would up to the half rounding of activations.

    Weight-only int8: ``weights="int8"`` stores the MatMul/Gemm weights as int8 with one scale per output
    channel (``kiln.ir.passes.precision.quantize_gemm_weights``; after ``precision``'s conversion, so the
    scales are half in a half model): about half the GEMM weights' device memory of fp16, dequantized per
    call (the GPU dequantizes each weight in one kernel before its GEMM)."""
    if backend != "onnxruntime":
        from kiln.serializer.reader import collector_paused
        # Reading, optimizing and planning make a few objects per node: the cyclic collector's
        # walks over them were a third of a node-heavy model's load (see serializer/reader.py).
        with collector_paused():
            return _load(model, device, optimize=optimize, backend=backend, threads=threads, limits=limits,
                         memory_budget=memory_budget, precision=precision, weights=weights, **cuda_options)
    if precision is not None or weights is not None:
        raise KilnError("precision= and weights= are kiln's own conversions (backend='kiln'); for ONNX Runtime, convert the file "
                        "first: kiln convert IN OUT --precision fp16")
    return _load(model, device, optimize=optimize, backend=backend, threads=threads, limits=limits,
                 memory_budget=memory_budget, **cuda_options)


def program_metadata(graph: Graph) -> dict:
    """What a loaded program reports as ``metadata``, for every backend alike: producer, version, doc string
    and the graph's props, less the optimizer's own bookkeeping (``kiln.optimized``, which a load may add)."""
    from kiln.ir.passes.pipeline import OPTIMIZED_PROP
    md = graph.metadata
    return {"producer_name": md.producer_name, "producer_version": md.producer_version,
            "doc_string": md.doc_string, **{k: v for k, v in md.props.items() if k != OPTIMIZED_PROP}}


def cuda_usable() -> bool:
    """Whether ``device='auto'`` means the GPU: the CUDA runtime imports and sees at least one device."""
    try:
        from kiln.runtime.cuda_program import device_count
        return device_count() > 0
    except Exception:  # noqa: BLE001 - no CuPy, a broken CUDA install: the CPU
        return False


def _load(model, device: str, *, optimize: bool, backend: str, threads: Optional[int], limits,
          memory_budget: Union[int, str, None], precision: Optional[str] = None, weights: Optional[str] = None,
          **cuda_options):
    if backend == "onnxruntime":
        from kiln.runtime.onnxruntime_backend import OrtProgram
        return OrtProgram(model, device=device, optimize=optimize, threads=threads)
    if backend != "kiln":
        raise KilnError(f"unknown backend {backend!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    if device not in ("cpu", "auto", "cuda"):
        raise KilnError(f"unknown device '{device}': kiln runs on 'cpu', 'cuda' or 'auto' (the GPU where CuPy "
                        "sees one, else the CPU)")
    auto = device == "auto"
    if auto:  # as the onnxruntime backend's 'auto': the GPU when there is one
        device = "cuda" if cuda_usable() else "cpu"
    cuda = device == "cuda"
    if cuda_options and not cuda:
        raise KilnError(f"options {sorted(cuda_options)} are for device='cuda'"
                        + (" (device='auto' found no usable GPU here)" if auto else ""))
    if cuda_options:  # named wrong: said before any loading (runtime/cuda_options.py has the fields)
        from kiln.runtime.cuda_options import FIELDS
        unknown = sorted(set(cuda_options) - set(FIELDS) - {"options"})
        if unknown:
            raise KilnError(f"unknown CUDA option(s) {unknown}; known: options, {', '.join(FIELDS)}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise KilnError(f"threads= must be a positive int (the most BLAS threads a run uses), not {threads!r}")
    if threads is not None and device == "cuda":
        raise KilnError("threads= caps the CPU runtime's BLAS threads; device='cuda' does not take it")
    if isinstance(model, Graph):
        from kiln.ir.verifier import verify
        # A graph built in memory has had no reader's checks: verify it as a file would be (op types, arities,
        # dtypes against each op's type constraints), so a Neg of uint32 is refused here, not answered by numpy.
        verify(model)
        graph = model.copy()
    elif is_onnx_path(model):
        if not os.path.isfile(model):
            raise KilnError(f"no such file: {os.fspath(model)}")
        from kiln.errors import optional_module
        graph = optional_module("kiln.serializer.onnx_import", "loading .onnx files").import_onnx(model)
    else:
        from kiln.serializer.reader import load_graph
        graph = load_graph(model, limits=limits)
    if precision is not None:
        from kiln.ir.passes.precision import convert_precision
        convert_precision(graph, precision)
    if weights is not None:
        if weights != "int8":
            raise KilnError(f"weights= takes 'int8' (weight-only int8 for MatMul/Gemm), not {weights!r}")
        from kiln.ir.passes.precision import quantize_gemm_weights
        quantize_gemm_weights(graph)
    if not cuda and graph.metadata.props.get("kiln.precision") in ("fp16", "bf16"):  # precision.PRECISION_PROP
        from kiln.ir.passes.precision import upcast_to_float32
        upcast_to_float32(graph)  # a half model computes in float32 on the CPU (see load's docstring)
    if optimize:
        from kiln.ir.passes import optimize as run_optimize
        run_optimize(graph)
    if cuda:
        try:
            from kiln.runtime.cuda_program import CudaProgram, device_count
            usable = device_count() > 0
        except ImportError as e:
            usable, why = False, f"CuPy is not importable ({e})"
        else:
            why = "CuPy sees no CUDA device"
        if not usable:
            raise KilnError(f"device 'cuda' is not available yet in this environment: {why}; it needs CuPy "
                            "and an NVIDIA GPU (pip install 'kiln-compiler[gpu]')")
        if memory_budget is not None:
            raise KilnError("memory_budget= is checked by the CPU runtime; device='cuda' does not take it yet")
        return CudaProgram(graph, **cuda_options)
    from kiln.runtime.kernels.cpu import native
    if native.available():  # a Conv and its activation in one native call (runtime/kernels/cpu/native.py)
        from kiln.ir.passes.fuse import fuse_elementwise, fuse_epilogues
        fuse_epilogues(graph, anchors=("Conv", "MatMul", "Gemm"), accept=native.fusable)
        # chains of the ops the extension runs in one pass (native.CHAIN_OPS)
        fuse_elementwise(graph, ops=native.CHAIN_OPS)
    return Program(graph, memory_budget=memory_budget if memory_budget is not None else default_memory_budget(),
                   threads=threads)


def is_onnx_path(model: Union[str, os.PathLike]) -> bool:
    """Whether a model path names an ONNX file (by its suffix, as ``kiln convert`` decides)."""
    return os.fspath(model).lower().endswith(".onnx")
