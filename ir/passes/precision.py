"""Precision conversion: a float32 graph to float16 or bfloat16 (issue 18), and back.

``convert_precision(graph, "fp16")`` turns every float32 value of the graph into half:

- **Weights** (float32 initializers) are cast once, so the file stores them in half and is about half the
  size. Values beyond the half type's range are clamped to its largest finite value (a float32 mask
  constant of -3.4e38 becomes -65504 in fp16, still "minus infinity" for a softmax, where -inf could make
  a fully masked row NaN); how many were clamped is reported.
- **Activations** follow: each node is re-inferred from its (now half) inputs, in order, so its outputs
  take the dtype the op's own type rules give. ``Cast(to=float)`` becomes ``Cast(to=half)`` and a float32
  ``ConstantOfShape`` fill becomes half, so integer-to-float casts in a model (``mask.float()``) land in
  half too.
- **The op policy** (:data:`FP32_OPS`, overridable per op): ops listed as ``"float32"`` run in float32,
  with a Cast to float32 before each half input and a Cast back to half after each output. The default
  list is short, like torch.autocast's float32 list less what kiln's kernels already do safely: sums of
  products or squares, cumulative sums, ``Exp`` and ``Pow`` (their results leave the fp16 range for
  moderate inputs). Ops that need float32 *statistics* (LayerNorm, Softmax, the Reduce ops that average)
  stay in half in the graph: their kernels read half and accumulate in float32 (the CPU runtime computes
  a half file in float32 altogether, :func:`upcast_to_float32`). An op whose type rules refuse half
  inputs (``Range``, for one) runs in float32 the same way, found by its own inference.
- **The interface** stays float32 by default (``io="float32"``): a Cast after each float32 input and
  before each float32 output, so clients and servers send and receive what they did; ``io="half"`` makes
  the inputs and outputs half themselves (outputs keep their names either way).
- Subgraphs (If/Loop bodies) are converted in place, with their float32 inputs and outputs in half.

Linear in the graph: one pass over each graph's nodes, new Casts collected into a fresh node list.
Returns a :class:`PrecisionReport`. :func:`upcast_to_float32` is the inverse (half to float32, no
policy), which the CPU runtime applies when it loads a half file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional

import numpy as np

from kiln.errors import KilnError, ShapeInferenceError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.types import TensorType, dims_compatible, merge_dim

PRECISIONS = {"fp16": DType.FLOAT16, "float16": DType.FLOAT16, "half": DType.FLOAT16,
              "bf16": DType.BFLOAT16, "bfloat16": DType.BFLOAT16}

#: Ops run in float32 in a half graph (torch.autocast keeps these in float32 too): their results leave the
#: fp16 range for moderate inputs, or they sum many products. Everything else runs in half, its kernels
#: accumulating in float32 where they reduce (see the module docstring). Override per op with ``policy``.
FP32_OPS = frozenset({"ReduceSumSquare", "ReduceProd", "ReduceLogSumExp", "ReduceL1", "ReduceL2", "CumSum",
                      "Exp", "Pow", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"})

_POLICIES = ("half", "float32")
PRECISION_PROP = "kiln.precision"  # set on a converted graph's metadata
_SHORT = {DType.FLOAT16: "fp16", DType.BFLOAT16: "bf16", DType.FLOAT32: "fp32"}


@dataclass
class PrecisionReport:
    """What :func:`convert_precision` did."""

    precision: str
    weights: int = 0             # initializers cast
    weight_bytes_before: int = 0
    weight_bytes_after: int = 0
    clamped: int = 0             # weight elements clamped to the half range
    casts: int = 0               # Cast nodes inserted
    float32_nodes: List[str] = field(default_factory=list)  # nodes kept in float32 (policy or type rules)

    def summary(self) -> str:
        kept = len(self.float32_nodes)
        ops = sorted({n.split(":", 1)[0] for n in self.float32_nodes})
        return (f"{self.precision}: {self.weights} weights {self.weight_bytes_before / 1e6:.1f} -> "
                f"{self.weight_bytes_after / 1e6:.1f} MB"
                + (f" ({self.clamped} values clamped to the {self.precision} range)" if self.clamped else "")
                + f", {self.casts} casts inserted, {kept} node(s) in float32"
                + (f" ({', '.join(ops)})" if ops else ""))


def parse_policy(items: Iterable[str]) -> Dict[str, str]:
    """``["Softmax=float32", "Exp=half"]`` (the CLI's ``--op-precision``) as a policy dict."""
    policy = {}
    for item in items:
        op, sep, where = item.partition("=")
        if not sep or not op or where not in _POLICIES:
            raise KilnError(f"--op-precision takes OP=half or OP=float32, got {item!r}")
        policy[op] = where
    return policy


def convert_precision(graph: Graph, precision: str = "fp16", *, policy: Optional[Mapping[str, str]] = None,
                      io: str = "float32") -> PrecisionReport:
    """Convert ``graph`` (in place) from float32 to ``precision`` ("fp16" or "bf16"); see the module docstring.
    ``policy``: ``{op: "half" | "float32"}`` on top of :data:`FP32_OPS`. ``io``: "float32" (default) keeps the
    model's float32 inputs and outputs, "half" converts them too."""
    half = PRECISIONS.get(str(precision).lower())
    if half is None:
        raise KilnError(f"precision must be fp16 or bf16, got {precision!r}")
    if io not in ("float32", "half"):
        raise KilnError(f"io must be 'float32' or 'half', got {io!r}")
    done = graph.metadata.props.get(PRECISION_PROP)
    if done in ("fp16", "bf16"):
        raise KilnError(f"this model is already converted to {done}; convert the float32 model instead")
    fp32_ops = set(FP32_OPS)
    for op, where in (policy or {}).items():
        if where not in _POLICIES:
            raise KilnError(f"the precision policy of {op} must be 'half' or 'float32', got {where!r}")
        (fp32_ops.add if where == "float32" else fp32_ops.discard)(op)
    report = PrecisionReport("fp16" if half is DType.FLOAT16 else "bf16")
    _Converter(graph, DType.FLOAT32, half, fp32_ops, report).run(boundary=io == "float32")
    graph.metadata.props[PRECISION_PROP] = report.precision  # what upcast_to_float32 looks for
    return report


def upcast_to_float32(graph: Graph, *, force: bool = False) -> bool:
    """The inverse for the CPU runtime: every float16/bfloat16 value, weight and Cast target becomes float32
    (in place). Returns whether it changed the graph. numpy has no fast half arithmetic and no bfloat16 at
    all, so a half file runs on the CPU in float32 with its half-rounded weights; half inputs and outputs
    stay half at the interface.

    Only graphs that :func:`convert_precision` made (``metadata.props["kiln.precision"]``), unless
    ``force``: a model that itself computes in half (an ONNX file with ``Cast(to=FLOAT16)`` on purpose)
    keeps exactly what it asks for."""
    if not force and graph.metadata.props.get(PRECISION_PROP) not in ("fp16", "bf16"):
        return False
    if not _has_half(graph):
        return False
    report = PrecisionReport("float32")
    for src in (DType.FLOAT16, DType.BFLOAT16):
        _Converter(graph, src, DType.FLOAT32, set(), report).run(boundary=True)
    return True


def _has_half(graph: Graph) -> bool:
    halves = (DType.FLOAT16, DType.BFLOAT16)
    for g in graph.all_graphs():
        if any(v.dtype in halves for v in g.values()):
            return True
    return False


class _Converter:
    def __init__(self, graph: Graph, src: DType, dst: DType, fp32_ops: set, report: PrecisionReport):
        self.root, self.src, self.dst, self.fp32_ops, self.report = graph, src, dst, fp32_ops, report
        self.down = dst is not DType.FLOAT32  # float32 -> half (else half -> float32)
        self.up_of: Dict[Value, Value] = {}   # a src-dtype value -> its inserted Cast to dst, and back

    def run(self, boundary: bool) -> None:
        g = self.root
        was = {y: y.dtype for y in g.outputs}
        self._convert_graph(g, top=True, boundary=boundary)
        extra: List[Node] = []
        for i, y in enumerate(g.outputs):
            if boundary:
                want = was[y] if y.dtype is self.dst and was[y] is self.src else None
            else:
                want = self.dst if y.dtype is self.src else None
            if want is None:
                continue
            if y.producer is None and y.const is None:  # an input passed straight through
                if not boundary:
                    y.type = TensorType(self.dst, y.type.shape)
                continue
            cast = self._cast(g, y, want, hint=y.dtype)  # its output swaps names with y: it names the inner value
            extra.append(cast)
            out = cast.outputs[0]
            y.name, out.name = out.name, y.name  # the output keeps its name
            if y.const is not None and g.initializers.get(out.name) is y:  # a constant output: rekey it
                del g.initializers[out.name]
                g.initializers[y.name] = y
            g.outputs[i] = out
        g.nodes.extend(extra)

    # -- one graph ----------------------------------------------------------------------------------------
    def _convert_graph(self, g: Graph, top: bool, boundary: bool) -> None:
        for v in list(g.initializers.values()):
            if v.dtype is self.src:
                self._cast_weight(v)
        new_nodes: List[Node] = []
        for x in g.inputs:
            if x.dtype is not self.src:
                continue
            if top and boundary:
                cast = self._cast(g, x, self.dst)
                new_nodes.append(cast)
                _redirect(x, cast.outputs[0], skip=cast)
                self.up_of[cast.outputs[0]] = x
            else:
                x.type = TensorType(self.dst, x.type.shape)
        for node in list(g.nodes):
            for sg in node.subgraphs():
                self._convert_graph(sg, top=False, boundary=False)
            new_nodes.extend(self._convert_node(g, node))
        g.nodes = new_nodes

    # -- one node -----------------------------------------------------------------------------------------
    def _convert_node(self, g: Graph, node: Node) -> List[Node]:
        if node.op in self.fp32_ops and self.down:
            return self._keep_float32(g, node, "policy")
        if node.op == "Cast" and node.attrs.get("to") == self.src.value:
            node.attrs["to"] = self.dst.value
        elif node.op == "DequantizeLinear" and node.attrs.get("output_dtype") == self.src.value:
            node.attrs["output_dtype"] = self.dst.value  # a float32 output_dtype follows as Cast's `to` does
        elif node.op == "ConstantOfShape":
            fill = node.attrs.get("value")
            if fill is not None and np.asarray(fill).dtype == self.src.numpy:
                node.attrs["value"] = self._cast_array(np.asarray(fill))
        if self.down and not _takes(node, self.dst):
            return self._keep_float32(g, node, "types")
        old = [o.type for o in node.outputs]
        for o in node.outputs:
            o.type = None
        try:
            _infer(node)
        except ShapeInferenceError:
            for o, t in zip(node.outputs, old):
                o.type = t
            if not self.down:
                raise
            return self._keep_float32(g, node, "types")
        for o, t in zip(node.outputs, old):
            o.type = _merged(o.type, t)
        after = []
        if self.down:  # an output the op's type rules keep in float32 (an attribute-typed op): back to half
            for o, t in zip(node.outputs, old):
                if o.dtype is self.src and t is not None and t.dtype is self.src and o._uses:
                    after.append(self._down_after(g, o))
        return [node] + after

    def _keep_float32(self, g: Graph, node: Node, why: str) -> List[Node]:
        self.report.float32_nodes.append(f"{node.op}:{node.name}:{why}")
        before = []
        for i, v in enumerate(node.inputs):
            if v is not None and v.dtype is self.dst:
                src = self.up_of.get(v)
                if src is None:
                    cast = self._cast(g, v, self.src)
                    before.append(cast)
                    src = cast.outputs[0]
                    self.up_of[src] = v
                node.set_input(i, src)
        old = [o.type for o in node.outputs]
        for o in node.outputs:
            o.type = None
        _infer(node)
        for o, t in zip(node.outputs, old):
            o.type = _merged(o.type, t)
        after = [self._down_after(g, o) for o in node.outputs if o.dtype is self.src and (o._uses or _is_output(o))]
        return before + [node] + after

    def _down_after(self, g: Graph, o: Value) -> Node:
        """A Cast of ``o`` (src dtype) to dst that every reader of ``o`` reads instead."""
        cast = self._cast(g, o, self.dst)
        out = cast.outputs[0]
        _redirect(o, out, skip=cast)
        self.up_of[out] = o
        return cast

    # -- pieces -------------------------------------------------------------------------------------------
    def _cast(self, g: Graph, v: Value, to: DType, hint: Optional[DType] = None) -> Node:
        """A Cast of ``v`` to ``to``, named after ``v`` and the dtype ``hint`` (default ``to``)."""
        node = g.add_node("Cast", [v], {"to": to.value}, name=f"{v.name}_{_SHORT[hint or to]}",
                          output_types=[TensorType(to, v.type.shape if v.type is not None else None)])
        g.nodes.remove(node)  # add_node appended it: the caller places it in the new node list
        self.report.casts += 1
        return node

    def _cast_array(self, a: np.ndarray) -> np.ndarray:
        if self.down:
            top = float(np.finfo(self.dst.numpy).max) if self.dst is DType.FLOAT16 else None
            if top is not None:
                finite = np.isfinite(a)
                over = finite & (np.abs(a) > top)
                n = int(np.count_nonzero(over))
                if n:
                    self.report.clamped += n
                    a = np.where(over, np.sign(a) * top, a)
            return a.astype(self.dst.numpy, order="C")
        return a.astype(np.float32, order="C")

    def _cast_weight(self, v: Value) -> None:
        arr = v.const
        self.report.weights += 1
        self.report.weight_bytes_before += arr.nbytes
        new = self._cast_array(arr)
        self.report.weight_bytes_after += new.nbytes
        v.const = new
        v.type = TensorType(self.dst, v.type.shape if v.type is not None else new.shape)


def _takes(node: Node, half: DType) -> bool:
    """Whether the op's schema allows ``half`` at every input that now has it (the verifier's rule)."""
    schema = node.schema
    for i, v in enumerate(node.inputs):
        if v is None or v.dtype is not half:
            continue
        try:
            param = schema.input_param(i)
        except IndexError:
            continue
        if half not in param.types:
            return False
    return True


def _infer(node: Node) -> None:
    from kiln.ir.passes.shape_inference import infer_node
    infer_node(node)


def _merged(new: Optional[TensorType], old: Optional[TensorType]) -> Optional[TensorType]:
    """``new``'s dtype with the more precise of the two shapes (the frontend's declared dims survive)."""
    if new is None or old is None or old.shape is None:
        return new
    if new.shape is None:
        return TensorType(new.dtype, old.shape)
    if len(new.shape) != len(old.shape) or not all(dims_compatible(a, b) for a, b in zip(new.shape, old.shape)):
        return new
    return TensorType(new.dtype, [merge_dim(a, b) for a, b in zip(new.shape, old.shape)])


def _redirect(old: Value, new: Value, skip: Node) -> None:
    """Every reader of ``old`` but ``skip`` reads ``new``; graph outputs are left to the caller."""
    for node in old.users:
        if node is not skip:
            node.replace_input(old, new)


def _is_output(v: Value) -> bool:
    return any(v is o for o in v.graph.outputs)


# Weight-only int8 (issue 18): weights of at least this many elements are quantized (smaller ones cost more
# kernel launches than the bytes they would save).
WEIGHT_INT8_MIN_ELEMENTS = 4096


def quantize_gemm_weights(graph: Graph) -> str:
    """Weight-only int8 for GEMM-heavy models: every constant MatMul/Gemm weight of at least
    ``WEIGHT_INT8_MIN_ELEMENTS`` elements (float32 or a converted model's half type; also behind the
    Transpose a traced ``nn.Linear`` reads it through) becomes int8 with one scale per output channel in the
    weight's dtype, behind a ``DequantizeLinear`` (the mobile pack's format: ir/passes/quantize.py).
    Activations keep their precision; convolutions keep their weights (cuDNN reads them as they are).
    Returns a summary."""
    from kiln.ir.passes.quantize import FLOAT_WEIGHTS, quantize_weights
    done = quantize_weights(graph, ops=("MatMul", "Gemm"), dtypes=FLOAT_WEIGHTS, min_elements=WEIGHT_INT8_MIN_ELEMENTS,
                            transposed=True)
    before = sum(q.float_bytes for q in done)
    after = sum(q.quant_bytes for q in done)
    worst = max((q.max_abs_error for q in done), default=0.0)
    return (f"int8 weights: {len(done)} GEMM weights, {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
            f"(max |W - dequantized| {worst:.3g})")
