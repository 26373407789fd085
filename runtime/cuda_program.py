"""``kiln.load(path, device="cuda")``: a Program that runs on an NVIDIA GPU through CuPy.

Same public interface as :class:`kiln.runtime.program.Program` (``inputs``, ``outputs``,
``metadata``, ``run(inputs, as_list=False)``), same execution plan (runtime/plan.py), with the
kernels of runtime/kernels/cuda. What differs, and why:

- **Loading.** Scaled dot-product attention (``MatMul -> [scale] -> [mask] -> Softmax ->
  MatMul``) becomes one ``kiln.FusedAttention`` node, run by one kernel that never stores the
  score matrix (runtime/kernels/cuda/attention.py). Elementwise chains are fused into
  ``kiln.FusedElementwise`` nodes next, so each
  chain is one generated kernel (runtime/kernels/cuda/codegen.py), then each Conv/Gemm/MatMul
  feeding such a group (or a single elementwise op) alone takes it as its epilogue
  (``kiln.FusedEpilogue``: cuDNN's fused graph, cublasLt's bias epilogue, or one generated
  kernel in place over the product; runtime/kernels/cuda/epilogue.py). ``epilogues`` says
  which strategy each fused node got. ``fuse=False`` keeps the graph as it is.
- **Placement.** Values live on the device, except the small integer tensors of shape
  arithmetic (``Shape``, ``Size`` and nodes whose inputs are all such host values or small
  constants, with a small static output): those run on the host with the CPU kernels, so a
  Reshape's computed target shape never costs a device round trip (and never blocks a CUDA-graph
  capture). Small constants stay host arrays; device kernels get them uploaded once at load.
- **Guards.** A ``kiln.Guard`` on a device value is a small kernel writing a record; the run's
  records are read once, with the outputs, and the first failed guard raises before anything is
  returned (runtime/kernels/cuda/guard.py). Captured graphs hold the guard kernels too.
- **Fallbacks.** A node with no native CUDA kernel runs its CPU kernel on host copies of its
  inputs and uploads the results. Each such node is counted in ``fallback_ops``, so "every op
  runs" holds and what is native is visible.
- **Memory.** Constants are uploaded once, at load, into the slot template; numpy inputs are
  copied in once per run; outputs are CuPy arrays (``output="numpy"`` copies them back).
  Kernels that prepare their own device layout of a constant (Conv's reshaped weights, a
  MatMul weight, Gemm's transposed B) list the input positions they never read in
  ``kernel.ignores``; a constant whose every reader ignores it (and that is no graph output)
  stays a host array in the template, so each weight is on the device once (ResNet-50 held
  its conv weights twice before this).
- **Settings, per program** (issue 17). ``CudaProgram(graph, options=CudaOptions(...))`` or the
  same fields as keywords (``tf32``, ``conv``, ``attention``, ``cudnn_workspace_mib``,
  ``cudnn_epilogue``, ``cuda_graphs``, ``fuse``, ``output``; runtime/cuda_options.py): fields
  left out come from the environment (``KILN_CUDA_CONV``, ``KILN_ATTENTION``,
  ``KILN_CUDNN_WORKSPACE_MIB``, ``KILN_CUDNN_EPILOGUE``), read once when the options are made.
  The kernels are bound with them at load and each run executes under them
  (``kernels.cuda.bound``), so two programs in one process, on one thread or several, never see
  each other's settings, eager or inside a CUDA graph (captured under the program's own).
  ``options`` holds them. Nothing process-wide is changed: not CuPy's compute type, not a live
  cuBLAS handle's math mode.
- **TF32.** Off by default: float32 matmuls/convolutions use full float32. ``tf32=True`` allows
  TF32 (about 3e-4 relative error) for kiln's cuBLAS (a TF32-math handle per stream beside the
  default one), cuBLASLt (the plan's compute type) and cuDNN (engines with tensor-core notes)
  calls. CuPy's own products (Einsum, rare ``cupy.matmul`` fallbacks) keep CuPy's process
  setting, which kiln leaves alone (strict unless ``CUPY_TF32=1``). ``set_tf32`` is deprecated:
  it only sets the default of programs made afterwards.
- **CUDA graphs** (``cuda_graphs=True``; the default ``"auto"`` uses them for plans of at least
  ``GRAPH_MIN_INSTRUCTIONS`` instructions). The first run for an input-shape signature
  runs eagerly on a private stream and memory pool, then the plan is captured into a CUDA graph
  (``Stream.begin_capture``/``end_capture``) over pre-allocated input buffers; later runs with
  that signature copy the inputs in and replay the graph: one launch for the whole model. Up to
  ``MAX_GRAPHS`` signatures are kept (least recently used first out). A plan that cannot be
  captured (it synchronizes with the host: a data-dependent shape, an index check, a fallback)
  runs eagerly for that signature, which ``graph_failures`` records.
"""
from __future__ import annotations

import math
import threading
import warnings
from collections import OrderedDict
from typing import Any, Mapping, Optional, Sequence, Union

import cupy as cp
import numpy as np

from kiln.errors import KilnError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, Value
from kiln.runtime.kernels import cpu, cuda
from kiln.runtime.cuda_options import CudaOptions, set_process_tf32
from kiln.runtime.kernels.cuda.codegen import EXPRESSIONS
from kiln.runtime.kernels.cuda.elementwise import host_fallback
from kiln.runtime.plan import Plan, PlanBuilder, execute, nested_executor
from kiln.runtime.program import TensorSpec, _execution_error, check_inputs

# Values of at most this many elements may live on the host (shape arithmetic, small constants).
SMALL = 64
# Ops that run bfloat16 (uint16 words on the device) correctly: generated elementwise kernels (every op
# codegen has an expression for, Cast included), the GEMMs and their epilogues, the row kernels, attention,
# and ops that only move 16-bit words (no value is read as a number). Checked at load: _check_bfloat16.
BF16_OPS = frozenset({"MatMul", "Gemm", "Conv", "DequantizeLinear", "FusedElementwise", "FusedEpilogue", "FusedAttention", "LayerNormalization",
                      "Softmax", "LogSoftmax", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity",
                      "Split", "Concat", "Slice", "Gather", "Expand", "Tile", "Shape", "Size"}) \
    | frozenset(EXPRESSIONS)
MAX_GRAPHS = 8
GRAPH_MIN_INSTRUCTIONS = 4  # cuda_graphs="auto" captures plans of at least this many instructions
OUTPUTS = ("cupy", "numpy")


def set_tf32(allowed: bool) -> None:
    """Deprecated (issue 17): the ``tf32`` default of programs made afterwards without one.
    Programs already loaded keep their own; nothing process-wide in CuPy or cuBLAS changes.
    Pass ``tf32=`` to ``CudaProgram``/``kiln.load`` (or a ``CudaOptions``) instead."""
    warnings.warn("kiln.runtime.cuda_program.set_tf32 is deprecated: TF32 is per program now "
                  "(CudaProgram(graph, tf32=...) / kiln.load(..., tf32=...))", DeprecationWarning, stacklevel=2)
    set_process_tf32(bool(allowed))


def _static_size(v: Value) -> Optional[int]:
    t = v.type
    if t is None or t.shape is None or not all(isinstance(d, int) for d in t.shape):
        return None
    return math.prod(t.shape)


def _small(v: Optional[Value]) -> bool:
    n = _static_size(v) if v is not None else 0
    return n is not None and n <= SMALL


class CudaProgram:
    """A loaded model on the GPU. ``run`` takes numpy or CuPy arrays."""

    backend = "kiln-cuda"

    def __init__(self, graph: Graph, *, options: Optional[CudaOptions] = None, output: Optional[str] = None,
                 tf32: Optional[bool] = None, cuda_graphs: Union[bool, str, None] = None,
                 fuse: Optional[bool] = None, conv: Optional[str] = None, attention: Optional[str] = None,
                 cudnn_workspace_mib: Union[float, str, None] = None, cudnn_epilogue: Optional[bool] = None,
                 wait: Optional[str] = None):
        # Keywords left None take the field of ``options`` (or its defaults: the environment).
        # A cuDNN workspace without a cap is cudnn_workspace_mib="none" here (None: not given).
        self.options = opts = CudaOptions.build(
            options, output=output, tf32=tf32, cuda_graphs=cuda_graphs, fuse=fuse, conv=conv,
            attention=attention, cudnn_workspace_mib=cudnn_workspace_mib, cudnn_epilogue=cudnn_epilogue, wait=wait)
        with cuda.bound(opts):
            self._load(graph)

    def _load(self, graph: Graph) -> None:
        opts = self.options
        self.output = opts.output
        self._wait = _wait if opts.wait == "poll" else _block
        self.tf32 = opts.tf32
        fuse, cuda_graphs = opts.fuse, opts.cuda_graphs
        self.fused_groups = 0
        self.fused_epilogues = 0
        self.fused_attention = 0
        self._has_bf16 = any(_is_bf16(v) for g in graph.all_graphs() for v in g.values())
        if fuse:
            from kiln.ir.passes.fuse import fuse_attention, fuse_elementwise, fuse_epilogues
            self.fused_attention = fuse_attention(graph)
            self.fused_groups = fuse_elementwise(graph)
            self.fused_epilogues = fuse_epilogues(graph)
        self.graph = graph
        self._host: set = set()          # values placed on the host
        self._host_nodes: list = []      # nodes run on the host by design (shape arithmetic)
        self._kernels: list = []         # (node, kernel) of every instruction, for fallback counts
        builder = PlanBuilder(self._choose)
        # A slot no value uses: each run's kiln.Guard records go there (see _guard_kernel).
        self._guard_slot = len(builder.template)
        builder.template.append(None)
        self.plan: Plan = builder.build(graph, inplace=False)
        self._check_bfloat16()
        self._check_storage_types()
        self._template = self._upload_constants(builder)
        self.inputs = [TensorSpec(v.name, v.type) for v in graph.inputs]
        self.outputs = [TensorSpec(v.name, v.type) for v in graph.outputs]
        from kiln.runtime.program import program_metadata
        self.metadata = program_metadata(graph)
        # "auto": graphs where launches are many; a plan of a few kernels gains nothing from a
        # graph and would pay its input and output copies (a fused 8192^2 chain: 0.14 ms eager,
        # 0.60 ms through a graph's copies on an H200).
        self.cuda_graphs = cuda_graphs if cuda_graphs != "auto" else \
            len(self.plan.instructions) >= GRAPH_MIN_INSTRUCTIONS
        self._graphs: OrderedDict = OrderedDict()
        self.graph_failures: dict = {}   # signature -> why capture failed
        self._lock = threading.Lock()
        self.last_d2h_seconds = 0.0  # device time of the last graph replay's device-to-host copies

    # ------------------------------------------------------------------ plan building

    def _choose(self, node: Node, builder: PlanBuilder):
        if node.domain == "" and node.op in ("If", "Loop"):
            k = _control_kernel(node, builder, self)
            self._kernels.append((node, k))
            return k
        attrs = node.schema.fill_attrs(node.attrs)
        if node.domain == "kiln" and node.op == "Guard":
            k = _guard_kernel(attrs, self._guard_slot)
            self._kernels.append((node, k))
            return k
        if self._on_host(node):
            for v in node.outputs:
                self._host.add(v)
            self._host_nodes.append(node)
            k = _host_kernel(cpu.choose(node, attrs))
            self._kernels.append((node, k))
            return k
        k = cuda.choose(node, attrs, self.options)
        if self._has_bf16 and _touches_bf16(node) and (k is None or node.op not in BF16_OPS):
            k = _via_float32(node, attrs, self.options) or k
        if k is None:
            k = host_fallback(cpu.choose(node, attrs))
        elif node.op in ("Shape", "Size") and node.domain == "":
            for v in node.outputs:
                self._host.add(v)
        k = self._adapt(node, k)
        self._kernels.append((node, k))
        return k

    def _check_storage_types(self) -> None:
        """float8, float4 and the sub-byte integers (issue 22) have no CuPy type: a model holding them runs on the
        CPU runtime only, refused here by name rather than failing in an upload."""
        for g in self.graph.all_graphs():
            for v in g.values():
                if v.type is not None and v.type.dtype.is_storage:
                    raise KilnError(f"value '{v.name}' is {v.type.dtype}, which the GPU runtime does not take yet "
                                    f"(CuPy has no {v.type.dtype} type): run this model on the CPU (device='cpu')")

    def _check_bfloat16(self) -> None:
        """bfloat16 lives on the device as uint16 words (CuPy has no bfloat16): only kernels written for it
        may touch it, or a CuPy op would compute on the words and answer wrong without a sound. Every node
        reading or writing bfloat16 must be one of ``BF16_OPS`` with a native kernel (a FusedEpilogue only
        around a MatMul/Gemm); anything else refuses the load, naming the ops (issue 18)."""
        if not self._has_bf16:
            return
        bad: dict = {}
        io = [v.name for v in list(self.graph.inputs) + list(self.graph.outputs) if _is_bf16(v)]
        if io:
            raise KilnError(f"bfloat16 at the model's interface ({', '.join(io)}) is not taken on the GPU yet: convert "
                            "without half_io (float32 inputs and outputs, bfloat16 inside)")
        host = set(map(id, self._host_nodes))
        for node, k in self._kernels:
            if not _touches_bf16(node):
                continue
            op = node.qualified_op
            why = None
            if id(node) in host or _is_fallback(k):
                why = "runs on the host"
            elif node.op not in BF16_OPS and op not in BF16_OPS and not _find_attr(k, "via_float32"):
                why = "has no bfloat16 kernel"
            elif op == "kiln.FusedEpilogue" and node.attrs["body"].nodes[0].op not in ("MatMul", "Gemm", "Conv"):
                why = f"has a {node.attrs['body'].nodes[0].op} anchor (only MatMul/Gemm/Conv epilogues take bfloat16)"
            if why:
                bad.setdefault(f"{op} ({why})", []).append(node.name)
        if bad:
            listed = "; ".join(f"{k}: {', '.join(v[:3])}{' ...' if len(v) > 3 else ''}" for k, v in sorted(bad.items()))
            raise KilnError(f"this bfloat16 model uses ops the GPU backend does not run in bfloat16 yet: {listed}. "
                            "Convert it with precision='fp16' for the GPU, or run it on the CPU")

    def _on_host(self, node: Node) -> bool:
        """Shape arithmetic: every input a host value or a small constant, every output small."""
        if node.domain != "" or node.schema.has_subgraphs or not node.inputs:
            return False
        for v in node.inputs:
            if v is None:
                continue
            if not (v in self._host or (v.const is not None and v.const.size <= SMALL)):
                return False
        return all(_small(v) for v in node.outputs)

    def _adapt(self, node: Node, k):
        """Give a device kernel device arrays where it reads data: small constants uploaded once,
        host values (shape arithmetic feeding data, Loop counters) uploaded per call."""
        host_pos = set(cuda.host_inputs(node))
        fixed, dynamic = {}, []
        for i, v in enumerate(node.inputs):
            if v is None or i in host_pos:
                continue
            if v.const is not None and v.const.size <= SMALL:
                fixed[i] = cuda.device_array(v.const)
            elif v in self._host or (v.producer is None and v.graph is not self.graph) or \
                    (v.producer is not None and v.producer.domain == "" and v.producer.op in ("If", "Loop")):
                dynamic.append(i)
        if not fixed and not dynamic:
            return k

        def run(*args):
            args = list(args)
            for i, d in fixed.items():
                args[i] = d
            for i in dynamic:
                if isinstance(args[i], np.ndarray):
                    args[i] = cp.asarray(args[i])
            return k(*args)
        run.fallback = getattr(k, "fallback", False)
        run.inner = k
        return run

    def _upload_constants(self, builder: PlanBuilder) -> list:
        """The slot template with large constants on the device (small ones stay host arrays,
        and so do those no kernel reads from their slot: see ``_constants_read``)."""
        template = list(builder.template)
        read = self._constants_read()
        skip = {s for v, s in builder.slots.items() if v.const is not None and v not in read}
        # Reporting: the large constants left on the host because kernels hold their own copies.
        self.constants_not_uploaded = [v.name for v, s in builder.slots.items()
                                       if s in skip and v.const.size > SMALL]
        for i, c in enumerate(template):
            if isinstance(c, np.ndarray) and c.size > SMALL and i not in skip:
                template[i] = cuda.device_array(c)
        return template

    def _constants_read(self) -> set:
        """Constant values some kernel reads from the slot template: every (node, position) of
        every instruction (subgraph bodies included) whose kernel does not list the position in
        ``ignores``, plus any constant that is an output of the graph or of a subgraph."""
        read: set = set(self.graph.outputs)
        for node, k in self._kernels:
            ignored = cuda.ignored_inputs(k)
            for i, v in enumerate(node.inputs):
                if v is not None and v.const is not None and i not in ignored:
                    read.add(v)
            for a in node.attrs.values():
                if isinstance(a, Graph):
                    read.update(a.outputs)
        return read

    # ------------------------------------------------------------------ reporting

    @property
    def fallback_ops(self) -> dict:
        """``{op: count}`` of instructions that ran (or will run) on the host for want of a
        native kernel (by design host-side shape arithmetic is not counted: see ``host_ops``)."""
        counts: dict = {}
        for node, k in self._kernels:
            if _is_fallback(k):
                counts[node.qualified_op] = counts.get(node.qualified_op, 0) + 1
        return counts

    @property
    def epilogues(self) -> dict:
        """``{strategy: count}`` of the FusedEpilogue nodes (how each anchor and epilogue run)."""
        counts: dict = {}
        for node, k in self._kernels:
            if node.domain == "kiln" and node.op == "FusedEpilogue":
                s = "host fallback" if _is_fallback(k) else _strategy(k)
                counts[s] = counts.get(s, 0) + 1
        return counts

    @property
    def conv_paths(self) -> dict:
        """``{"cudnn"|"im2col": count}`` of the (Conv node, input shape, epilogue) combinations
        this program's Conv kernels ran, by the path they took (the program's ``conv`` option and
        the shape decide; FusedEpilogue anchors included). Filled as shapes are run."""
        counts: dict = {}
        for _node, k in self._kernels:
            paths = _find_attr(k, "conv_paths")
            for p in (paths or {}).values():
                counts[p] = counts.get(p, 0) + 1
        return counts

    @property
    def attention_paths(self) -> dict:
        """``{"cudnn"|"kernel"|"ops": calls}`` of this program's FusedAttention kernels (eager calls and
        the calls that were captured; a graph replay runs no Python and counts nothing)."""
        counts = {"cudnn": 0, "kernel": 0, "ops": 0}
        for _node, k in self._kernels:
            paths = _find_attr(k, "attention_paths")
            for p, n in (paths or {}).items():
                counts[p] += n
        return counts

    @property
    def bf16_via_float32(self) -> dict:
        """``{op: nodes}`` of bfloat16 nodes run by their float32 kernel between conversions (no bfloat16
        kernel of their own yet): correct, slower than native."""
        counts: dict = {}
        for node, k in self._kernels:
            if _find_attr(k, "via_float32"):
                counts[node.qualified_op] = counts.get(node.qualified_op, 0) + 1
        return counts

    @property
    def host_ops(self) -> dict:
        counts: dict = {}
        for node in self._host_nodes:
            counts[node.qualified_op] = counts.get(node.qualified_op, 0) + 1
        return counts

    # ------------------------------------------------------------------ running

    def run(self, inputs: Union[Mapping[str, Any], Sequence[Any]], *, as_list: bool = False,
            out: Optional[Mapping[str, np.ndarray]] = None):
        """Run on numpy or CuPy arrays given by name (a dict) or in order; returns a dict by output
        name (or a list with ``as_list``) of CuPy arrays (numpy with ``output="numpy"``).

        ``out`` (with ``output="numpy"``): host arrays by output name to copy outputs into, used where the
        output's shape and dtype match (page-locked ones take a DMA straight from the device); the
        result then holds those very arrays. ``last_d2h_seconds`` is the device time of the last graph
        replay's device-to-host copies."""
        arrays = self._check_inputs(inputs)
        outs = None
        dests = None
        if out and self.output == "numpy":
            dests = [out.get(o.name) for o in self.outputs]
        if self.cuda_graphs:
            outs = self._run_graph(arrays, dests)
        if outs is None:
            outs = self._run_eager([a if isinstance(a, cp.ndarray) else cp.asarray(a) for a in arrays])
            outs = [self._output(o) for o in outs]
            if dests is not None:
                outs = [_fill(d, o) for d, o in zip(dests, outs)]
        return outs if as_list else dict(zip((o.name for o in self.outputs), outs))

    __call__ = run

    def _output(self, a: Any) -> Any:
        if self.output == "numpy":
            return a.get() if isinstance(a, cp.ndarray) else np.array(a)
        return a if isinstance(a, cp.ndarray) else cp.asarray(a)

    def _check_inputs(self, inputs) -> list:
        """The shared checks (runtime.program.check_inputs); CuPy arrays are checked through
        zero-byte numpy stand-ins of their shape and dtype, then used as they are."""
        mapping = isinstance(inputs, Mapping)
        given = list(inputs.values()) if mapping else list(inputs)
        if not any(isinstance(a, cp.ndarray) for a in given):
            return check_inputs(self.inputs, inputs)

        def proxy(a):
            if isinstance(a, cp.ndarray):
                return np.lib.stride_tricks.as_strided(np.zeros((), a.dtype), a.shape, (0,) * a.ndim)
            return a
        checked = check_inputs(self.inputs, {k: proxy(v) for k, v in inputs.items()} if mapping
                               else [proxy(a) for a in given])
        ordered = [inputs[s.name] for s in self.inputs] if mapping else given
        return [g if isinstance(g, cp.ndarray) else c for g, c in zip(ordered, checked)]

    def _run_eager(self, arrays: list) -> list:
        outs, records = self._execute(arrays)
        records.raise_first_failure()
        return outs

    def _execute(self, arrays: list, records: Optional["_GuardRecords"] = None, executor=execute) -> tuple:
        """(outputs, the run's _GuardRecords), unchecked. ``records`` where the guards write
        (the default: fresh device records, for an eager run). ``executor`` runs the plan over the
        slots: ``plan.execute``, or the profiler's timed loop (runtime/profile.py, ``kiln bench
        --device cuda --profile``), which so gets this run's inputs, guards, options and errors."""
        slots = list(self._template)
        for s, a in zip(self.plan.input_slots, arrays):
            slots[s] = a
        records = records or _GuardRecords(mapped=False)
        slots[self._guard_slot] = records
        token = cuda.bind(self.options)  # what kernels decide per call follows this program
        try:
            executor(self.plan, slots)
        except KilnError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised naming the node
            raise _execution_error(self.plan, slots, e) from e
        finally:
            cuda.unbind(token)
        return [slots[s] for s in self.plan.output_slots], records

    def _run_graph(self, arrays: list, dests: Optional[list] = None) -> Optional[list]:
        """The outputs (as ``run`` returns them) of a replay of the signature's graph, captured
        first if need be; None where this signature cannot be captured."""
        sig = tuple((a.shape, a.dtype.str) for a in arrays)
        if sig in self.graph_failures:
            return None
        with self._lock:
            entry = self._graphs.get(sig)
            if entry is None:
                entry = self._capture(arrays, sig)
                if entry is None:
                    return None
                self._graphs[sig] = entry
                while len(self._graphs) > MAX_GRAPHS:
                    self._graphs.popitem(last=False)
            else:
                self._graphs.move_to_end(sig)
            caller = cp.cuda.get_current_stream()
            stream, records = entry.stream, entry.records
            # The inputs are copied in on the graph's stream after the caller's pending work.
            stream.wait_event(caller.record())
            with stream:
                for buf, a in zip(entry.in_bufs, arrays):
                    if isinstance(a, cp.ndarray):
                        cp.copyto(buf, a)
                    else:
                        buf.set(np.ascontiguousarray(a), stream=stream)
                entry.graph.launch(stream)
                if self.output == "numpy":
                    # Outputs go to page-locked host buffers on the graph's stream: one wait for
                    # the whole run (a second wait cost 40-90 us on an H100 machine). A caller's
                    # ``out`` array of the right shape and dtype takes the copy instead.
                    host = list(entry.host_outputs())
                    if dests is not None:
                        host = [d if _fits(d, o) else h for d, o, h in zip(dests, entry.outs, host)]
                    d2h = (cp.cuda.Event(), cp.cuda.Event())
                    d2h[0].record(stream)
                    for o, h in zip(entry.outs, host):
                        if h is not None:
                            cp.cuda.runtime.memcpyAsync(h.ctypes.data, o.data.ptr, o.nbytes,
                                                        cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
                    d2h[1].record(stream)
            failure = None
            if self.output == "numpy":
                self._wait(stream.record())
                self.last_d2h_seconds = cp.cuda.get_elapsed_time(*d2h) / 1e3
                if records.entries:
                    failure = records.first_failure()
                # The buffers are rewritten by the next replay: the caller gets copies (or its own arrays).
                result = [(h if dests is not None and h is d else h.copy()) if h is not None
                          else _fill(d, o.get() if isinstance(o, cp.ndarray) else np.array(o))
                          for o, h, d in zip(entry.outs, host, dests or [None] * len(host))]
            else:
                caller.wait_event(stream.record())
                result = [o.copy() if isinstance(o, cp.ndarray) else cp.asarray(o) for o in entry.outs]
                if records.entries:
                    # The guards wrote their records straight into page-locked host memory, which
                    # the next replay rewrites: read them once this replay is done, before the
                    # lock goes. (A caller wanting the outputs on the device must wait here: a
                    # guard decides whether there are outputs at all.)
                    self._wait(caller.record())
                    failure = records.first_failure()
        if failure is not None:
            failure()
        return result

    def _capture(self, arrays: list, sig: tuple):
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                in_bufs = [cp.empty(a.shape, a.dtype) for a in arrays]
                for buf, a in zip(in_bufs, arrays):
                    if isinstance(a, cp.ndarray):
                        cp.copyto(buf, a)
                    else:
                        buf.set(np.ascontiguousarray(a), stream=stream)
                # Warm-up: compiles kernels, fills caches and the private pool with the blocks
                # the captured run will take (so nothing is cudaMalloc'd during the capture).
                # Its guards are not read: the replay that follows checks them.
                self._execute(in_bufs)
                stream.synchronize()
                records = _GuardRecords(mapped=True)
                stream.begin_capture(cp.cuda.runtime.streamCaptureModeRelaxed)
                try:
                    outs, _ = self._execute(in_bufs, records)
                finally:
                    graph = stream.end_capture()
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 - this signature then runs eagerly
            self.graph_failures[sig] = f"{type(e).__name__}: {e}"
            return None
        # The library workspaces the graph points at live as long as the graph.
        from kiln.runtime.kernels.cuda import cudnn
        return _Captured(graph, stream, in_bufs, outs, records, (pool, cudnn.pinned(stream)))

    def captured_graphs(self) -> int:
        return len(self._graphs)


def _fits(dest: Any, a: Any) -> bool:
    """Whether host array ``dest`` can take output ``a`` (same shape and dtype, C-contiguous, writable)."""
    return (isinstance(dest, np.ndarray) and hasattr(a, "shape") and dest.shape == tuple(a.shape)
            and dest.dtype == a.dtype and dest.flags.c_contiguous and dest.flags.writeable)


def _fill(dest: Any, a: np.ndarray) -> np.ndarray:
    """``a`` copied into ``dest`` (and ``dest`` returned) where it fits, else ``a``."""
    if dest is not None and _fits(dest, a):
        np.copyto(dest, a)
        return dest
    return a


def _find_attr(k, name: str):
    """``name`` of the kernel or of a kernel it wraps (through ``inner``), or None."""
    while k is not None:
        v = getattr(k, name, None)
        if v is not None:
            return v
        k = getattr(k, "inner", None)
    return None


def _strategy(k) -> str:
    while k is not None:
        s = getattr(k, "strategy", None)
        if s is not None:
            return s
        k = getattr(k, "inner", None)
    return "?"


def _is_bf16(v: Optional[Value]) -> bool:
    return v is not None and v.type is not None and v.type.dtype is DType.BFLOAT16


def _touches_bf16(node: Node) -> bool:
    return any(_is_bf16(v) for v in list(node.inputs) + list(node.outputs))


_BF16_KERNELS: dict = {}


def _bf16_converters():
    """CuPy kernels between bfloat16 words (uint16) and float32: a shift up; round to nearest even down."""
    if not _BF16_KERNELS:
        from kiln.runtime.kernels.cuda.codegen import HALF_CONVERSIONS
        _BF16_KERNELS["up"] = cp.ElementwiseKernel("uint16 h", "float32 f", "f = kiln_bf2f(h)", "kiln_bf16_to_f32",
                                                   preamble=HALF_CONVERSIONS)
        _BF16_KERNELS["down"] = cp.ElementwiseKernel("float32 f", "uint16 h", "h = kiln_f2bf(f)", "kiln_f32_to_bf16",
                                                     preamble=HALF_CONVERSIONS)
    return _BF16_KERNELS["up"], _BF16_KERNELS["down"]


def _via_float32(node: Node, attrs: dict, options) -> Optional[Any]:
    """A node that touches bfloat16 but has no bfloat16 kernel (a ReduceMax, a convolution, a pool): its
    float32 CUDA kernel, on inputs widened from bfloat16 and outputs rounded back to it (each exactly what a
    Cast gives). Correct, at the cost of two conversions; None when float32 has no CUDA kernel either. Chosen
    on a detached copy of the node whose bfloat16 values are float32 (constants converted, as attributes)."""
    f32 = DType.FLOAT32

    def widen(v):
        if v is None:
            return None
        t = v.type
        w = Value(v.name, t.with_dtype(f32) if t is not None and t.dtype is DType.BFLOAT16 else t, v.graph)
        if v.const is not None:
            w.const = v.const.astype(np.float32) if cuda.is_bf16(v.const.dtype) else v.const
        return w

    shadow = Node(node.graph, node.op, node.domain, node.name, node.attrs)
    shadow.meta = node.meta
    shadow._inputs = tuple(widen(v) for v in node.inputs)
    shadow.outputs = [widen(v) for v in node.outputs]
    attrs32 = {k: (a.astype(np.float32) if isinstance(a, np.ndarray) and cuda.is_bf16(a.dtype) else a)
               for k, a in attrs.items()}
    k = cuda.choose(shadow, attrs32, options)
    if k is None:
        return None
    host_pos = set(cuda.host_inputs(node))
    ins = [i for i, v in enumerate(node.inputs) if v is not None and i not in host_pos and v.type is not None
           and v.type.dtype is DType.BFLOAT16]
    outs = [i for i, v in enumerate(node.outputs) if v.type is not None and v.type.dtype is DType.BFLOAT16]
    up, down = _bf16_converters()
    single = len(node.outputs) == 1
    ignored = set(getattr(k, "ignores", ()) or ())
    ins = [i for i in ins if i not in ignored]  # the float32 kernel keeps its own copy of those constants
    # bfloat16 constants read from their slot: widened once, here (a capture may not copy from the host)
    fixed = {i: cp.asarray(node.inputs[i].const.astype(np.float32)) for i in ins if node.inputs[i].const is not None}

    def run(*args):
        args = list(args)
        for i in ins:
            a = args[i]
            if i in fixed:
                args[i] = fixed[i]
            elif isinstance(a, np.ndarray):  # a host value (not a constant): widened and uploaded
                args[i] = cp.asarray(a.astype(np.float32))
            elif a is not None:
                args[i] = up(a)
        res = k(*args)
        res = [res] if single else list(res)
        for i in outs:
            res[i] = down(res[i])
        return res[0] if single else tuple(res)
    run.via_float32 = True
    run.inner = k
    run.ignores = tuple(sorted(ignored | set(fixed)))
    return run


def _is_fallback(k) -> bool:
    while k is not None:
        if getattr(k, "fallback", False):
            return True
        k = getattr(k, "inner", None)
    return False


def _guard_kernel(attrs: dict, guard_slot: int):
    """A kiln.Guard: a host input is checked at once; a device input is checked by a kernel that
    writes a record where the run's _GuardRecords (in the guard slot) says."""
    from kiln.runtime.kernels.cuda.guard import DeviceGuard
    check = DeviceGuard(attrs)

    def run_guard(slots: list, x) -> tuple:
        check.launch(x, slots[guard_slot])
        return ()
    run_guard.with_slots = True
    return run_guard


def _wait(event) -> None:
    """Wait for ``event`` (the end of a replay) by polling it, as torch's default sync does."""
    while not event.done:
        pass


def _block(event) -> None:
    """Wait for ``event`` in ``cudaEventSynchronize``, which CuPy calls without the GIL."""
    event.synchronize()


class _Captured:
    """One signature's CUDA graph and what it reads and writes (see ``CudaProgram._capture``)."""

    def __init__(self, graph, stream, in_bufs: list, outs: list, records: "_GuardRecords", keep: tuple):
        self.graph, self.stream, self.in_bufs, self.outs, self.records = graph, stream, in_bufs, outs, records
        self._keep = keep  # library workspaces and the private pool the graph points into
        self._host: Optional[list] = None

    def host_outputs(self) -> list:
        """Page-locked host arrays, one per contiguous device output (None for the others)."""
        if self._host is None:
            self._host = []
            for o in self.outs:
                if isinstance(o, cp.ndarray) and o.flags.c_contiguous and o.nbytes:
                    mem = cp.cuda.alloc_pinned_memory(o.nbytes)
                    self._host.append(np.frombuffer(mem, o.dtype, o.size).reshape(o.shape))
                else:
                    self._host.append(None)
        return self._host


class _GuardRecords:
    """Where one run's device guards write their records (runtime/kernels/cuda/guard.py).

    Eager runs: device arrays, stacked and read once after the run. Captured graphs
    (``mapped``): page-locked host memory the guard kernels write directly (the device reaches
    it at the same address, unified addressing), so a replay needs no copy node and no copy
    call: only the wait for the replay, then a read."""

    def __init__(self, mapped: bool):
        self.mapped = mapped
        self.entries: list = []  # (DeviceGuard, device view of the record, host view or None)

    def new(self, check) -> "cp.ndarray":
        if not self.mapped:
            dev = cp.empty(3, np.float64)
            self.entries.append((check, dev, None))
            return dev
        mem = cp.cuda.alloc_pinned_memory(3 * 8)
        host = np.frombuffer(mem, np.float64, 3)
        ptr = cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(host.ctypes.data, 3 * 8, mem, cp.cuda.Device().id), 0)
        dev = cp.ndarray((3,), np.float64, ptr)
        self.entries.append((check, dev, host))
        return dev

    def _rows(self) -> list:
        if self.mapped:
            return [h.copy() for _, _, h in self.entries]
        return list(cp.stack([d for _, d, _ in self.entries]).get()) if self.entries else []

    def first_failure(self):
        """A function raising the first failed guard (graph order), or None; reads the records."""
        for (check, _, _), row in zip(self.entries, self._rows()):
            if row[0] != 0:
                return lambda check=check, row=row: check.raise_if_failed(row)
        return None

    def raise_first_failure(self) -> None:
        failure = self.first_failure()
        if failure is not None:
            failure()


def _host_kernel(k):
    """A CPU kernel for host-placed shape arithmetic (its inputs are host values already;
    a device array reaching it is copied back)."""
    def run(*args):
        return k(*[a.get() if isinstance(a, cp.ndarray) else a for a in args])
    return run


def _control_kernel(node: Node, builder: PlanBuilder, program: CudaProgram):
    """If and Loop with device bodies: the condition and trip count are read on the host."""
    from kiln.runtime.control import _empty_scan
    if node.op == "If":
        then_plan = builder.build(node.attrs["then_branch"], liveness=False, inplace=False)
        else_plan = builder.build(node.attrs["else_branch"], liveness=False, inplace=False)

        def run_if(slots: list, cond) -> Any:
            plan = then_plan if bool(cuda.host(cond).reshape(-1)[0]) else else_plan
            nested_executor()(plan, slots)  # execute, or the profiler's timed loop (plan.NESTED_EXECUTOR)
            outs = tuple(slots[s] for s in plan.output_slots)
            return outs[0] if len(outs) == 1 else outs
        run_if.with_slots = True
        return run_if

    body = node.attrs["body"]
    for v in body.inputs[:2]:
        program._host.add(v)
    plan = builder.build(body, liveness=False, inplace=False)
    n_carried = len(body.inputs) - 2
    scan_types = [v.type for v in body.outputs[1 + n_carried:]]

    def run_loop(slots: list, m=None, cond=None, *carried) -> Any:
        if m is None and cond is None:
            raise ValueError("a Loop with neither a trip count M nor a cond input never ends")
        trips = None if m is None else int(cuda.host(m).reshape(-1)[0])
        go = True if cond is None else bool(cuda.host(cond).reshape(-1)[0])
        values = list(carried)
        scans: list = [[] for _ in scan_types]
        run_body = nested_executor()  # execute, or the profiler's timed loop (plan.NESTED_EXECUTOR)
        i = 0
        while go and (trips is None or i < trips):
            for s, a in zip(plan.input_slots, [np.array(i, np.int64), np.array(go), *values]):
                slots[s] = a
            run_body(plan, slots)
            outs = [slots[s] for s in plan.output_slots]
            if cond is not None:
                go = bool(cuda.host(outs[0]).reshape(-1)[0])
            values = outs[1:1 + n_carried]
            for k, v in enumerate(outs[1 + n_carried:]):
                scans[k].append(v if isinstance(v, cp.ndarray) else cp.asarray(v))
            i += 1
        stacked = [cp.stack(s) if s else cp.asarray(_empty_scan(t)) for s, t in zip(scans, scan_types)]
        results = (*values, *stacked)
        return results[0] if len(results) == 1 else results
    run_loop.with_slots = True
    return run_loop


def device_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        return 0


__all__ = ["CudaProgram", "CudaOptions", "set_tf32", "device_count", "SMALL", "MAX_GRAPHS"]
