"""``kiln mobile pack``: do every piece of work ahead of time, so the device runtime does none.

The stub runtime runs no passes, infers no shapes and allocates nothing per op, so the packed
file must already hold everything it needs:

1. **Static shapes.** Every symbolic dim of the graph inputs is fixed (``dims={"batch": 1}``;
   a symbol not given is 1), then shape inference runs again so every value has a concrete shape.
   A value whose shape stays unknown is an error naming it and the node that makes it, since no
   memory plan can be made without it.
2. **Optimization.** The level-2 pipeline (constant folding, which now also folds the shape
   arithmetic the fixed dims made constant; BatchNorm folding; simplify, CSE, DCE). Transposes of
   weights (which folding leaves as free views for the BLAS-backed runtime) are materialized here:
   in the stub a Transpose is a real copy on every run. Nodes stay in execution order.
3. **int8 weights** (``quantize="int8"``, see quantize.py): after optimization, so BatchNorm is
   already folded into the weights that get quantized.
4. **The op manifest** (``kiln.mobile.ops``): the sorted ``Op:dtype`` entries the graph uses, the
   dtype being that of the node's first input, which is what a kernel module's SUPPORTS lists.
5. **The static arena plan** (``kiln.mobile.arena``): one offset per intermediate value in a single
   buffer. Each value lives from the node that writes it to the last node that reads it (graph
   outputs to the end, since they are copied out after the last node); values whose lifetimes
   overlap get disjoint byte ranges. Placement is TFLite's greedy-by-size: the largest values
   first, each into the smallest gap between the already placed values it overlaps in time
   (best fit), else past their end; every offset is a multiple of 64 bytes (cache lines and
   SIMD loads). A node's outputs never share memory with its inputs (both are live at that node),
   so kernels can write ``out=`` without reading what they overwrite.
   Not planned: graph inputs and initializers (read in place), and the outputs of a
   DequantizeLinear over initializers, which the stub fuses into the weight its consumer reads
   (the kernel dequantizes; no float weight is ever materialized).

``pack_file`` also measures what packing cost: file size before and after, and the packed
model's output error against the fp32 model on random inputs (both run in the full runtime).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional, Union

import numpy as np

from kiln.errors import KilnError
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes import infer_shapes, optimize
from kiln.ir.types import TensorType
from kiln.mobile_stub.packed import MOBILE_VERSION, PROP_ARENA, PROP_OPS, PROP_VERSION, parse_arena

ALIGNMENT = 64
QUANTIZE_MODES = (None, "int8")


# ---------------------------------------------------------------------------- static shapes
def fix_dims(graph: Graph, dims: Optional[Mapping[str, int]] = None) -> dict[str, int]:
    """Give every symbolic dim of the graph inputs a size (``dims[symbol]``, default 1), in place;
    returns the sizes used. A name in ``dims`` that no input has is an error (a typo would
    otherwise silently pack batch 1)."""
    dims = dict(dims or {})
    symbols = {d for v in graph.inputs if v.type is not None and v.type.shape is not None
               for d in v.type.shape if isinstance(d, str)}
    unused = sorted(set(dims) - symbols)
    if unused:
        raise KilnError(f"--dim {', '.join(unused)}: the model's inputs have no such symbolic dim "
                        f"(they have: {', '.join(sorted(symbols)) or 'none'})")
    for name, size in dims.items():
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise KilnError(f"--dim {name}={size}: a size must be a positive integer")
    sizes = {s: int(dims.get(s, 1)) for s in symbols}
    for v in graph.inputs:
        if v.type is None or v.type.shape is None:
            raise KilnError(f"graph input '{v.name}' has no known shape: the mobile runtime needs static shapes")
        for i, d in enumerate(v.type.shape):
            if d is None:
                raise KilnError(f"graph input '{v.name}' has an unknown dim {i} (shape {list(v.type.shape)}): "
                                "give it a name or a size before packing")
    for g in graph.all_graphs():
        for v in list(g.values()) + list(g.outputs):
            if v.type is not None and v.type.shape is not None:
                v.type = TensorType(v.type.dtype, [sizes.get(d, d) if isinstance(d, str) else d
                                                   for d in v.type.shape])
    return sizes


def _is_static(v: Value) -> bool:
    return v.type is not None and v.type.shape is not None and all(isinstance(d, int) for d in v.type.shape)


def require_static(graph: Graph) -> None:
    """Every value of the top-level graph has a concrete shape, or a KilnError names the first that does not."""
    for v in graph.values():
        if not _is_static(v):
            where = f"output of {v.producer.describe()}" if v.producer is not None else "graph input"
            raise KilnError(f"value '{v.name}' ({where}) has shape {v.type} after fixing the symbolic dims: "
                            "the mobile runtime needs every shape known at pack time (a data-dependent "
                            "shape cannot be planned)")


def materialize_weight_transposes(graph: Graph) -> int:
    """Replace ``Transpose(W)`` of an initializer read by nothing else with the transposed constant:
    the stub would otherwise copy the weight on every run. Returns how many were replaced."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "Transpose" or node.domain != "" or not node.inputs or node.inputs[0] is None:
            continue
        w = node.inputs[0]
        if not w.is_initializer or len(w.users) != 1 or any(o is w for o in graph.outputs):
            continue
        out = node.outputs[0]
        if any(o is out for o in graph.outputs):
            continue
        perm = node.attrs.get("perm")
        arr = np.ascontiguousarray(np.transpose(w.const, perm))
        new = graph.add_constant(arr, f"{w.name}.T")
        graph.replace_all_uses_with(out, new)
        graph.remove_node(node)
        graph.remove_initializer(w)
        count += 1
    return count


def prepare_graph(graph: Graph, dims: Optional[Mapping[str, int]] = None) -> Graph:
    """The graph the device will run, minus quantization: static shapes, fully optimized, weight
    transposes materialized. Edits ``graph`` in place and returns it. A graph already packed comes
    back unchanged in meaning (its shapes are static and its DequantizeLinear nodes do not fold)."""
    fix_dims(graph, dims)
    infer_shapes(graph)
    optimize(graph, level=2)
    if materialize_weight_transposes(graph):
        optimize(graph, level=2)
    require_static(graph)
    return graph


# ---------------------------------------------------------------------------- manifest
def op_manifest(graph: Graph) -> list[str]:
    """The sorted, distinct ``Op:dtype`` entries of every node (subgraphs included); the key is
    the one the declared op set uses (opset.node_key), so pack, check and bundle agree."""
    from kiln.mobile_stub.opset import node_key
    return sorted({node_key(n) for n in graph.walk()})


# ---------------------------------------------------------------------------- arena plan
@dataclass
class ArenaPlan:
    """Byte ranges in one arena: ``values[name] = (offset, nbytes)``; ``lifetimes[name] = (first, last)``
    node indices (kept for checking and reporting, not stored in the file)."""

    size: int
    alignment: int
    values: dict[str, tuple[int, int]]
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"size": self.size, "alignment": self.alignment,
                           "values": {k: [o, n] for k, (o, n) in self.values.items()}},
                          separators=(",", ":"))

    @property
    def naive_size(self) -> int:
        """What one buffer per value (no reuse) would take, aligned the same way."""
        return sum(_align(n, self.alignment) for _, n in self.values.values())


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def nbytes(v: Value) -> int:
    shape = v.type.shape
    return int(np.prod(shape, dtype=np.int64)) * v.type.dtype.itemsize


def is_weight_decoder(node: Node) -> bool:
    """A DequantizeLinear the stub fuses into its consumer's weight (no arena slot): the same rule as
    runtime.StubProgram._fuse_dequantize. Constant per-axis int8 data and 1-D scales, no nonzero zero point,
    its output read only as the weight (input 1) of Conv/Gemm/MatMul and not a graph output. Any other
    DequantizeLinear runs as a node with its output in the arena (one that is a graph output, say: packing
    had given it no slot, and the stub refused the file)."""
    if node.op != "DequantizeLinear" or node.domain != "" or \
            not all(v is None or v.is_initializer for v in node.inputs) or len(node.inputs) < 2:
        return False
    q, scale = node.inputs[0].const, node.inputs[1].const
    zero = node.inputs[2].const if len(node.inputs) > 2 and node.inputs[2] is not None else None
    out = node.outputs[0]
    if q.dtype != np.int8 or scale.ndim != 1 or (zero is not None and zero.any()):
        return False
    if any(out is o for o in node.graph.outputs) or not out.uses:
        return False
    from kiln.mobile_stub.runtime import QUANT_CONSUMERS
    return all(user.op in QUANT_CONSUMERS and user.domain == "" and pos == 1 for user, pos in out.uses)


def lifetimes(graph: Graph) -> dict[Value, tuple[int, int]]:
    """(first, last) node index during which each planned value must stay intact, in execution order.
    A reader inside an If/Loop body counts as its owning node; graph outputs live to the end."""
    owner: dict[int, int] = {}
    for i, node in enumerate(graph.nodes):
        owner[id(node)] = i
        for sg in node.subgraphs():
            for inner in sg.walk():
                owner[id(inner)] = i
    end = len(graph.nodes)
    outputs = {id(v) for v in graph.outputs}
    result = {}
    for i, node in enumerate(graph.nodes):
        if is_weight_decoder(node):
            continue
        for v in node.outputs:
            last = max((owner[id(n)] for n, _ in v.uses), default=i)
            result[v] = (i, end if id(v) in outputs else max(last, i))
    return result


def plan_arena(graph: Graph, alignment: int = ALIGNMENT) -> ArenaPlan:
    """Greedy-by-size best-fit placement of every planned value (see the module docstring)."""
    life = lifetimes(graph)
    for v in life:
        if not _is_static(v):
            raise KilnError(f"value '{v.name}' (output of {v.producer.describe()}) has shape {v.type}: "
                            "the arena needs static shapes")
    order = sorted(life, key=lambda v: (-nbytes(v), life[v][0], v.name))
    placed: list[tuple[int, int, int, int]] = []  # (offset, size, first, last)
    values: dict[str, tuple[int, int]] = {}
    size = 0
    for v in order:
        n = nbytes(v)
        first, last = life[v]
        busy = sorted((o, s) for o, s, f, e in placed if f <= last and first <= e and s > 0)
        best, best_gap, cursor = None, None, 0
        for o, s in busy:
            gap = o - cursor
            if gap >= n and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, _align(o + s, alignment))
        offset = cursor if best is None else best
        placed.append((offset, n, first, last))
        values[v.name] = (offset, n)
        size = max(size, _align(offset + n, alignment))
    # The stored dict follows execution order (readable in `kiln inspect`), not placement order.
    ordered = {v.name: values[v.name] for v in sorted(life, key=lambda v: life[v])}
    return ArenaPlan(size, alignment, ordered, {v.name: life[v] for v in life})


# ---------------------------------------------------------------------------- pack
@dataclass
class PackReport:
    src: str
    dst: str
    size_before: int
    size_after: int
    quantize: Optional[str]
    dims: dict
    manifest: list
    arena_size: int
    arena_naive_size: int
    quantized: list  # QuantizedWeight entries
    max_abs_error: float  # packed vs fp32 outputs over the random trials
    max_rel_error: float  # max |packed - fp32| / max |fp32|, per output, worst over outputs and trials
    top1_agreement: Optional[float]  # for a [N, classes] first output: fraction of rows with the same argmax
    trials: int

    @property
    def ratio(self) -> float:
        return self.size_after / self.size_before if self.size_before else float("nan")

    def __str__(self) -> str:
        lines = [f"packed {self.src} -> {self.dst}",
                 f"  file size: {self.size_before:,} -> {self.size_after:,} bytes ({self.ratio:.2f}x)",
                 f"  static dims: {', '.join(f'{k}={v}' for k, v in sorted(self.dims.items())) or 'none'}",
                 f"  arena: {self.arena_size:,} bytes (one buffer per value would take {self.arena_naive_size:,})",
                 f"  ops: {', '.join(self.manifest)}"]
        if self.quantize:
            lines.append(f"  {self.quantize} weights: {len(self.quantized)} quantized")
        top1 = "" if self.top1_agreement is None else f", top-1 agreement {self.top1_agreement:.1%}"
        lines.append(f"  output error vs fp32 on {self.trials} random input(s): max abs {self.max_abs_error:.3g}, "
                     f"max rel {self.max_rel_error:.3g}{top1}")
        return "\n".join(lines)


def _load(graph_or_path: Union[Graph, str, os.PathLike]) -> Graph:
    if isinstance(graph_or_path, Graph):
        return graph_or_path.copy()
    from kiln.serializer import load_graph
    return load_graph(os.fspath(graph_or_path))


def pack(graph_or_path: Union[Graph, str, os.PathLike], *, quantize: Optional[str] = None,
         dims: Optional[Mapping[str, int]] = None, report: Optional[list] = None) -> Graph:
    """The packed graph (a new one; a Graph argument is not changed). ``report``, when a list, receives
    the QuantizedWeight entries."""
    if quantize not in QUANTIZE_MODES:
        raise KilnError(f"unknown quantization {quantize!r}: choose int8 or none")
    graph = prepare_graph(_load(graph_or_path), dims)
    quantized = []
    if quantize == "int8":
        from kiln.ir.passes.quantize import quantize_weights
        quantized = quantize_weights(graph)
        infer_shapes(graph)
    if report is not None:
        report.extend(quantized)
    props = graph.metadata.props
    props[PROP_VERSION] = MOBILE_VERSION
    props[PROP_OPS] = json.dumps(op_manifest(graph))
    props[PROP_ARENA] = plan_arena(graph).to_json()
    return graph


def read_arena(graph: Graph) -> ArenaPlan:
    """The arena plan stored in a packed graph's metadata."""
    if PROP_ARENA not in graph.metadata.props:
        raise KilnError("not a packed mobile model: no kiln.mobile.arena metadata")
    size, alignment, values = parse_arena(graph.metadata.props[PROP_ARENA], max_bytes=None)
    return ArenaPlan(size, alignment, values)


# ---------------------------------------------------------------------------- measuring
def random_feeds(graph: Graph, rng: np.random.Generator, int_high: int = 2) -> list[np.ndarray]:
    """Random inputs at the graph's static shapes: floats standard normal, ints in [0, int_high)
    (token ids must stay inside every vocabulary), bools uniform."""
    feeds = []
    for v in graph.inputs:
        dt = v.type.dtype.numpy
        shape = tuple(v.type.shape)
        if dt.kind == "f":
            feeds.append(rng.standard_normal(shape).astype(dt))
        elif dt.kind == "b":
            feeds.append(rng.random(shape) < 0.5)
        else:
            feeds.append(rng.integers(0, int_high, shape).astype(dt))
    return feeds


@dataclass(frozen=True)
class OutputError:
    max_abs: float
    max_rel: float
    top1_agreement: Optional[float]


def top1_agreement(reference: np.ndarray, other: np.ndarray) -> float:
    """Fraction of rows of [N, classes] logits whose argmax agrees."""
    reference, other = np.asarray(reference), np.asarray(other)
    if reference.shape != other.shape or reference.ndim != 2:
        raise KilnError(f"top-1 agreement needs two [N, classes] arrays, got {reference.shape} and {other.shape}")
    return float(np.mean(reference.argmax(axis=1) == other.argmax(axis=1)))


def _run_check_failures() -> tuple:
    from kiln.checks import GuardFailed
    from kiln.ir.ops.assertion import AssertionFailed
    return GuardFailed, AssertionFailed


RUN_CHECK_FAILURES = _run_check_failures()


def compare_outputs(reference: Graph, packed: Graph, *, trials: int = 10, seed: int = 0,
                    int_high: int = 2) -> OutputError:
    """Run both graphs (the full runtime) on the same random inputs at the packed graph's shapes.
    Relative error is per output against its largest magnitude (elementwise relative error means
    nothing next to zero); top-1 agreement is reported when the first output is [N, classes]."""
    from kiln.runtime import load

    ref_prog, packed_prog = load(reference), load(packed)
    rng = np.random.default_rng(seed)
    max_abs = max_rel = 0.0
    agree: list[float] = []
    for _ in range(trials):
        feeds = random_feeds(packed, rng, int_high)
        try:
            want = ref_prog.run(feeds, as_list=True)
        except RUN_CHECK_FAILURES:
            # The model refuses these inputs (a kiln.Guard or kiln.Assert): the packed one must too.
            try:
                packed_prog.run(feeds, as_list=True)
            except RUN_CHECK_FAILURES:
                continue
            max_abs = max_rel = float("inf")
            continue
        got = packed_prog.run(feeds, as_list=True)
        for w, g in zip(want, got):
            if w.dtype.kind != "f":
                if not np.array_equal(w, g):
                    max_abs = max_rel = float("inf")
                continue
            err = float(np.max(np.abs(g.astype(np.float64) - w))) if w.size else 0.0
            scale = float(np.max(np.abs(w))) if w.size else 0.0
            max_abs = max(max_abs, err)
            max_rel = max(max_rel, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
        first = want[0]
        if first.ndim == 2 and first.shape[1] > 1 and first.dtype.kind == "f":
            agree.append(top1_agreement(first, got[0]))
    return OutputError(max_abs, max_rel, float(np.mean(agree)) if agree else None)


def pack_file(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], *, quantize: Optional[str] = None,
              dims: Optional[Mapping[str, int]] = None, trials: int = 10, seed: int = 0) -> PackReport:
    """Pack ``src`` into ``dst`` and measure the result (file sizes, output error vs fp32)."""
    from kiln.serializer import load_graph, save

    src, dst = os.fspath(src), os.fspath(dst)
    original = load_graph(src)
    quantized: list = []
    packed = pack(original, quantize=quantize, dims=dims, report=quantized)
    save(packed, dst)
    # The fp32 reference: the original model at the same static dims (so the comparison sees the
    # same input shapes), without quantization.
    reference = original.copy()
    sizes = fix_dims(reference, dims)
    infer_shapes(reference)
    err = compare_outputs(reference, load_graph(dst), trials=trials, seed=seed)
    arena = read_arena(packed)
    return PackReport(src, dst, os.path.getsize(src), os.path.getsize(dst), quantize, sizes,
                      json.loads(packed.metadata.props[PROP_OPS]), arena.size, arena.naive_size, quantized,
                      err.max_abs, err.max_rel, err.top1_agreement, trials)
