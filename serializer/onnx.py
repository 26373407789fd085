"""Export a kiln Graph to ONNX: ``to_onnx_model`` (in memory) and ``export_onnx`` (a file).

Why this is mostly a 1:1 mapping: every kiln op in the default domain *is* an ai.onnx op with
the semantics of opset 18 (``kiln.ir.versions.ONNX_OPSET_BASE``; Gelu: opset 20), kiln dtypes
are the ONNX ``TensorProto`` codes, attribute kinds are ONNX's, and If/Loop bodies follow the
ONNX conventions (If branches take no inputs, a Loop body takes ``(iteration_num, cond,
carried...)`` and returns ``(cond, carried..., scans...)``, bodies read outer values by name).
So each node becomes one NodeProto, each value keeps its name, each symbolic dim becomes a
``dim_param`` of the same name. What is *not* 1:1 lives here:

- **target opset**: 18 by default, 20 when the graph has a Gelu. Any opset from 18 to
  ``MAX_OPSET`` may be asked for; the ops kiln has changed only by gaining types, optional
  attributes with the old behaviour as default, or new modes between opset 18 and
  ``MAX_OPSET`` (checked against ``onnx.defs``), so the same node means the same thing there.
  Below 18 the meaning of several ops differs (Reduce* axes, Split, Pad), so it is refused.
- **expansions**: an op that the target opset lacks (Gelu before 20) or that lives in another
  domain (kiln's fused ops) is rewritten into ai.onnx nodes by a function registered
  with :func:`register_expansion`; an op with neither raises ``UnsupportedOpError``.
- **attributes newer than the opset** (Cast's ``saturate`` arrived in 19) are dropped when
  they hold kiln's default, which is the only behaviour the older op has.
- **graph outputs**: ONNX wants each output name once and each subgraph output produced in
  that subgraph, so a repeated output, or a body output that is an outer value, goes through
  an ``Identity``.
- **types**: symbolic dims become ``dim_param``, unknown dims empty Dimensions, an unknown
  rank no shape at all. onnxruntime accepts the last, but ``onnx.checker`` wants a shape on
  every *main-graph* input and output, so a graph whose inputs or outputs have unknown rank
  exports and runs but does not pass the checker (kiln does not invent a rank for it).
- **node metadata**: ``node.meta`` (the module ``scope`` and ``source`` line the tracer
  records) goes to the NodeProto's ``metadata_props`` (lossless, read back by importers) and a
  one-line ``doc_string`` (what viewers such as Netron show).
- **external data**: a serialized ModelProto must stay under 2 GB (``PROTOBUF_LIMIT``), so
  ``export_onnx`` moves initializers to ``<file name>.data`` next to the model when the model
  would not fit (or when asked), using ONNX's external data fields. Large tensors are aligned
  to 64 KiB in that file, so onnxruntime can memory-map them.

``onnx`` is an optional dependency of kiln (the ``onnx`` extra); only this module imports it.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import numpy as np

try:
    import onnx
    from onnx import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, TypeProto, ValueInfoProto
    from onnx import helper, numpy_helper
except ImportError as e:  # pragma: no cover - depends on the environment
    from kiln.errors import KilnError
    raise KilnError("ONNX export needs the 'onnx' package: pip install 'kiln[onnx]'") from e

from kiln.errors import KilnError, UnsupportedOpError
from kiln.ir.dtypes import DType
from kiln.ir.dtypes import dtype as as_dtype
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.registry import ONNX_DOMAIN, AttrKind
from kiln.ir.types import TensorType
from kiln.ir.versions import ONNX_OPSET_BASE
from kiln.version import __version__

__all__ = ["to_onnx_model", "export_onnx", "register_expansion", "Emitter", "default_opset",
           "MIN_OPSET", "MAX_OPSET", "GELU_OPSET", "PROTOBUF_LIMIT", "DATA_SUFFIX"]

MIN_OPSET = ONNX_OPSET_BASE  # kiln ops mean what ai.onnx opset 18 says
MAX_OPSET = 22               # newest opset checked to keep every kiln op's meaning (see module doc)
GELU_OPSET = 20              # the first ai.onnx opset with Gelu
PROTOBUF_LIMIT = 2**31 - 1   # protobuf cannot serialize a message of 2 GB or more
DATA_SUFFIX = ".data"        # external data goes to "<model file name>.data" (model.onnx.data)
ONNX_MAX_NESTING = 31        # If/Loop levels protobuf's parse depth (100 messages) lets a reader load

_SMALL_ALIGNMENT = 64        # external data alignment of tensors under _BIG_TENSOR bytes
_BIG_ALIGNMENT = 1 << 16     # of bigger ones: the mmap granularity of every OS onnxruntime runs on
_BIG_TENSOR = 1 << 20
_CHUNK = 64 << 20            # write big tensors in 64 MiB pieces


# --------------------------------------------------------------------------- expansions


Expansion = Callable[["Emitter", Node], None]


@dataclass(frozen=True)
class _Expansion:
    fn: Expansion
    native_since: Optional[int]


_EXPANSIONS: dict[tuple[str, str], _Expansion] = {}


def register_expansion(domain: str, op: str, *, native_since: Optional[int] = None) -> Callable[[Expansion], Expansion]:
    """Register ``fn(emitter, node)`` that writes ``domain.op`` nodes as ai.onnx nodes.

    The exporter calls it for every such node instead of emitting the node itself. ``fn`` must
    define each of the node's outputs (``emitter.outputs``) with ONNX nodes added through
    ``emitter.add`` (reading ``emitter.inputs``; ``emitter.constant`` makes a constant of a
    value's dtype). ``native_since`` is for ai.onnx ops that newer opsets have natively: the
    expansion is used only when the target opset is older than it (Gelu: ``native_since=20``).
    For a kiln-domain fused op leave it None: the expansion is always used::

        @register_expansion("kiln", "FusedMatMulAdd")
        def _(em, node):
            y = em.add("MatMul", [em.inputs[0], em.inputs[1]])
            em.add("Add", [y, em.inputs[2]], outputs=[em.outputs[0]])
    """

    def deco(fn: Expansion) -> Expansion:
        key = (domain, op)
        if key in _EXPANSIONS:
            raise ValueError(f"an ONNX expansion of {domain + '.' if domain else ''}{op} is already registered")
        _EXPANSIONS[key] = _Expansion(fn, native_since)
        return fn

    return deco


def _expansion_for(node: Node, opset: int) -> Optional[_Expansion]:
    e = _EXPANSIONS.get((node.domain, node.op))
    if e is None or (e.native_since is not None and opset >= e.native_since):
        return None
    return e


class Emitter:
    """What an expansion sees: the node's ONNX value names and a way to add ai.onnx nodes.

    ``inputs`` holds the ONNX name of each input ("" for an omitted optional one) and
    ``outputs`` the names the expansion must define. Added nodes are named
    ``<node name>/<op>_<k>`` and carry the node's metadata, so they still point at the module
    that produced them.
    """

    def __init__(self, builder: "_Builder", node: Node, out: list):
        self.node = node
        self.opset = builder.opset
        self.inputs = [builder.name_of(v) if v is not None else "" for v in node.inputs]
        self.outputs = [builder.name_of(v) for v in node.outputs]
        self._builder = builder
        self._out = out

    def input_type(self, i: int) -> Optional[TensorType]:
        v = self.node.inputs[i] if i < len(self.node.inputs) else None
        return None if v is None else v.type

    def add(self, op_type: str, inputs: Sequence[str], *, outputs: Optional[Sequence[str]] = None,
            num_outputs: int = 1, **attrs) -> Union[str, list]:
        """Add one ai.onnx node; returns its output name (a list when it has several)."""
        b = self._builder
        if outputs is None:
            outputs = [b.fresh_value(f"{self.node.name}/{op_type.lower()}") for _ in range(num_outputs)]
        proto = helper.make_node(op_type, list(inputs), list(outputs), name=b.fresh_node(f"{self.node.name}/{op_type}"),
                                 **attrs)
        b.annotate(proto, self.node)
        self._out.append(proto)
        return outputs[0] if len(outputs) == 1 else list(outputs)

    def constant(self, value: float, like: int = 0) -> str:
        """A scalar constant of the dtype of input ``like`` (through CastLike when that dtype is
        not known statically)."""
        t = self.input_type(like)
        if t is not None:
            return self.add("Constant", [], value=numpy_helper.from_array(np.array(value, t.dtype.numpy)))
        c = self.add("Constant", [], value=numpy_helper.from_array(np.array(value, np.float32)))
        return self.add("CastLike", [c, self.inputs[like]])


@register_expansion(ONNX_DOMAIN, "Gelu", native_since=GELU_OPSET)
def _expand_gelu(em: Emitter, node: Node) -> None:
    """Gelu as its opset-20 definition: x * 0.5 * (1 + erf(x / sqrt 2)), or with the tanh
    approximation x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))."""
    x = em.inputs[0]
    approximate = node.attrs.get("approximate", "none")
    if approximate == "tanh":
        cube = em.add("Mul", [em.add("Mul", [x, x]), x])
        inner = em.add("Add", [x, em.add("Mul", [cube, em.constant(0.044715)])])
        phi = em.add("Tanh", [em.add("Mul", [inner, em.constant(float(np.sqrt(2.0 / np.pi)))])])
    elif approximate == "none":
        phi = em.add("Erf", [em.add("Div", [x, em.constant(float(np.sqrt(2.0)))])])
    else:
        raise KilnError(f"{node.describe()}: unknown Gelu approximation {approximate!r}")
    one_plus = em.add("Add", [phi, em.constant(1.0)])
    em.add("Mul", [em.add("Mul", [x, one_plus]), em.constant(0.5)], outputs=[em.outputs[0]])


ISINF_HALF_OPSET = 20  # the first ai.onnx opset whose IsInf takes float16/bfloat16


@register_expansion(ONNX_DOMAIN, "IsInf", native_since=ISINF_HALF_OPSET)
def _expand_isinf(em: Emitter, node: Node) -> None:
    """IsInf before opset 20 takes float and double only: a 16-bit input is widened first (exact: every
    float16/bfloat16 value, infinities included, is a float32)."""
    x = em.inputs[0]
    t = em.input_type(0)
    if t is not None and t.dtype in (DType.FLOAT16, DType.BFLOAT16):
        x = em.add("Cast", [x], to=TensorProto.FLOAT)
    em.add("IsInf", [x], outputs=[em.outputs[0]], detect_negative=int(node.attrs.get("detect_negative", 1)),
           detect_positive=int(node.attrs.get("detect_positive", 1)))


@register_expansion(ONNX_DOMAIN, "Erf")
def _expand_erf(em: Emitter, node: Node) -> None:
    """kiln's Erf takes integer inputs as opset 9's did (the result truncated toward zero); since opset 13
    ONNX's takes floats only. An integer input is computed in double, as kiln's reference does, and cast
    back (Cast to an integer truncates toward zero)."""
    t = em.input_type(0)
    if t is None or t.dtype.is_float:
        em.add("Erf", [em.inputs[0]], outputs=[em.outputs[0]])
        return
    wide = em.add("Erf", [em.add("Cast", [em.inputs[0]], to=TensorProto.DOUBLE)])
    em.add("Cast", [wide], outputs=[em.outputs[0]], to=int(t.dtype.value))


@register_expansion(ONNX_DOMAIN, "Mod")
def _expand_mod(em: Emitter, node: Node) -> None:
    """kiln's Mod is Mod-28 (both fmod modes for every numeric type); Mod-13, which the export opsets write,
    takes fmod=0 for integers and fmod=1 for floats only. The other two are spelled with Mod-13's:
    float fmod=0 (the divisor's sign, Python's %) as fmod's remainder moved by one divisor where it is nonzero
    and its sign differs from the divisor's; integer fmod=1 (the dividend's sign) as a - (a / b) * b, ONNX's
    integer Div truncating toward zero as C's fmod does."""
    a, b = em.inputs
    t = em.input_type(0)
    fmod = int(node.attrs.get("fmod", 0))
    if t is None or t.dtype.is_float == bool(fmod):
        em.add("Mod", [a, b], outputs=[em.outputs[0]], fmod=fmod)
        return
    if fmod:
        em.add("Sub", [a, em.add("Mul", [em.add("Div", [a, b]), b])], outputs=[em.outputs[0]])
        return
    r = em.add("Mod", [a, b], fmod=1)
    zero = em.constant(0.0)
    moved = em.add("And", [em.add("Not", [em.add("Equal", [r, zero])]),
                           em.add("Xor", [em.add("Less", [r, zero]), em.add("Less", [b, zero])])])
    em.add("Where", [moved, em.add("Add", [r, b]), r], outputs=[em.outputs[0]])


@register_expansion(ONNX_DOMAIN, "Attention")
def _expand_attention(em: Emitter, node: Node) -> None:
    """Attention is an ai.onnx op from opset 23, past the newest opset kiln writes (MAX_OPSET): refused by name
    rather than written into a model no runtime of that opset accepts."""
    raise KilnError(f"{node.describe()}: ai.onnx Attention exists from opset 23 on, and kiln writes ONNX opsets "
                    f"{MIN_OPSET}..{MAX_OPSET}; save the model as .kiln (kiln.save), which keeps it")


@register_expansion(ONNX_DOMAIN, "BitShift")
def _expand_bitshift(em: Emitter, node: Node) -> None:
    """kiln's BitShift is BitShift-28 (signed types too); the opsets kiln writes have BitShift-11, unsigned only:
    a signed one is refused by name rather than written into a model its runtimes reject."""
    t = em.input_type(0)
    if t is not None and t.dtype is not DType.UINT8:
        raise KilnError(f"{node.describe()}: BitShift of {t.dtype} exists in ai.onnx from opset 28 on; kiln writes "
                        f"opsets {MIN_OPSET}..{MAX_OPSET}, whose BitShift takes unsigned integers only")
    em.add("BitShift", em.inputs, outputs=[em.outputs[0]], direction=str(node.attrs["direction"]))


POOL_DILATIONS_OPSET = 19  # the first ai.onnx opset whose AveragePool takes dilations


def _dilated(node: Node) -> bool:
    return any(d != 1 for d in node.attrs.get("dilations") or ())


@register_expansion(ONNX_DOMAIN, "AveragePool", native_since=POOL_DILATIONS_OPSET)
def _expand_average_pool(em: Emitter, node: Node) -> None:
    """Before opset 19 AveragePool has no dilations: without them (or all 1) it is written as itself, less the
    attribute; a dilated one is refused by name (default_opset picks 19 for it)."""
    if _dilated(node):
        raise KilnError(f"{node.describe()}: a dilated AveragePool needs ai.onnx opset {POOL_DILATIONS_OPSET} or "
                        f"later; this export writes opset {em.opset}")
    attrs = {k: v for k, v in node.attrs.items() if k != "dilations"}
    em.add("AveragePool", em.inputs, outputs=[em.outputs[0]], **attrs)


def _ints(em: Emitter, *values: int) -> str:
    """A 1-D int64 Constant (axes, starts, shapes)."""
    return em.add("Constant", [], value=numpy_helper.from_array(np.array(values, np.int64)))


_INT64_MAX = np.iinfo(np.int64).max


@register_expansion(ONNX_DOMAIN, "RMSNormalization")
def _expand_rms_normalization(em: Emitter, node: Node) -> None:
    """RMSNormalization (opset 23) as its ONNX function body in opset-18 ops, the way kiln computes it
    (kiln.ir.ops.normalization): X cast to stash_type, squared, the mean over axis..rank-1 (of a 16-bit stash
    taken in float32 and rounded back, as kiln's reference sums it), plus epsilon (a float32 cast to
    stash_type), Sqrt, X divided by it, cast back to X's type, times scale."""
    x, scale = em.inputs[:2]
    t = em.input_type(0)
    stash = DType(int(node.attrs.get("stash_type", 1)))
    axis = int(node.attrs.get("axis", -1))
    epsilon = float(node.attrs.get("epsilon", 1e-5))
    xu = x if t is not None and t.dtype is stash else em.add("Cast", [x], to=stash.value)
    if t is not None and t.shape is not None:
        rank = len(t.shape)
        start = axis + rank if axis < 0 else axis
        axes = _ints(em, *range(start, rank))
    else:  # the rank is known at run time only: Range(axis (+ rank), rank), as the function body does
        rank_v = em.add("Size", [em.add("Shape", [x])])
        start = _ints(em, axis) if axis >= 0 else em.add("Add", [rank_v, _ints(em, axis)])
        axes = em.add("Range", [em.add("Reshape", [start, _ints(em)]), rank_v,
                                em.add("Constant", [], value=numpy_helper.from_array(np.array(1, np.int64)))])
    squared = em.add("Mul", [xu, xu])
    if stash in (DType.FLOAT16, DType.BFLOAT16):
        mean = em.add("ReduceMean", [em.add("Cast", [squared], to=TensorProto.FLOAT), axes], keepdims=1)
        mean = em.add("Cast", [mean], to=stash.value)
    else:
        mean = em.add("ReduceMean", [squared, axes], keepdims=1)
    eps = em.add("Constant", [], value=numpy_helper.from_array(np.array(epsilon, np.float32)))
    if stash is not DType.FLOAT32:
        eps = em.add("Cast", [eps], to=stash.value)
    normalized = em.add("Div", [xu, em.add("Sqrt", [em.add("Add", [mean, eps])])])
    if t is None:
        normalized = em.add("CastLike", [normalized, x])
    elif t.dtype is not stash:
        normalized = em.add("Cast", [normalized], to=t.dtype.value)
    em.add("Mul", [normalized, scale], outputs=[em.outputs[0]])


@register_expansion(ONNX_DOMAIN, "RotaryEmbedding")
def _expand_rotary_embedding(em: Emitter, node: Node) -> None:
    """RotaryEmbedding (opset 23) in opset-18 ops, computing what kiln does (kiln.ir.ops.rotary), rounding
    included: the caches gathered by position_ids (Gather), 16-bit inputs widened to float32 (kiln's reference
    computes in float32 and rounds once), the rotated features sliced out (halves by Split, interleaved pairs
    by strided Slices), (cos x1 - sin x2, sin x1 + cos x2) with the caches unsqueezed over the heads, put
    back (interleaved: stacked on a new last axis and reshaped) and concatenated with the features that pass
    through. 3-D X is reshaped to [B, S, H, D] and back."""
    x, cos, sin = em.inputs[:3]
    pos = em.inputs[3] if len(em.inputs) > 3 else ""
    t = em.input_type(0)
    if t is None or t.shape is None or len(t.shape) not in (3, 4):
        raise KilnError(f"{node.describe()}: exporting RotaryEmbedding needs X's rank (3 or 4) to be known")
    rank = len(t.shape)
    interleaved = int(node.attrs.get("interleaved", 0))
    rd = int(node.attrs.get("rotary_embedding_dim", 0))
    heads = node.attrs.get("num_heads")
    if pos:
        cos = em.add("Gather", [cos, pos], axis=0)
        sin = em.add("Gather", [sin, pos], axis=0)
    if t.dtype is not DType.FLOAT32:
        x, cos, sin = (em.add("Cast", [v], to=TensorProto.FLOAT) for v in (x, cos, sin))
    if rank == 3:
        hidden = t.shape[2]
        head = hidden // int(heads) if isinstance(hidden, int) else -1
        x = em.add("Reshape", [x, _ints(em, 0, 0, int(heads), head)])
        head = head if head > 0 else None
    else:
        head = t.shape[3] if isinstance(t.shape[3], int) else None
    heads_axis = 2 if rank == 3 else 1  # the caches are [B, S, rd/2]: broadcast them over the heads
    cos = em.add("Unsqueeze", [cos, _ints(em, heads_axis)])
    sin = em.add("Unsqueeze", [sin, _ints(em, heads_axis)])
    rest = None
    if rd and rd != head:
        rot = em.add("Slice", [x, _ints(em, 0), _ints(em, rd), _ints(em, -1)])
        rest = em.add("Slice", [x, _ints(em, rd), _ints(em, _INT64_MAX), _ints(em, -1)])
    else:
        rot = x
    if interleaved:
        x1 = em.add("Slice", [rot, _ints(em, 0), _ints(em, _INT64_MAX), _ints(em, -1), _ints(em, 2)])
        x2 = em.add("Slice", [rot, _ints(em, 1), _ints(em, _INT64_MAX), _ints(em, -1), _ints(em, 2)])
    else:  # the two halves (Split would need its sizes or num_outputs, a name Emitter.add keeps for itself)
        width = rd or head
        mid = _ints(em, width // 2) if width else em.add("Div", [em.add("Shape", [rot], start=-1), _ints(em, 2)])
        x1 = em.add("Slice", [rot, _ints(em, 0), mid, _ints(em, -1)])
        x2 = em.add("Slice", [rot, mid, _ints(em, _INT64_MAX), _ints(em, -1)])
    real = em.add("Sub", [em.add("Mul", [cos, x1]), em.add("Mul", [sin, x2])])
    imag = em.add("Add", [em.add("Mul", [sin, x1]), em.add("Mul", [cos, x2])])
    if interleaved:
        last = _ints(em, -1)
        pairs = em.add("Concat", [em.add("Unsqueeze", [real, last]), em.add("Unsqueeze", [imag, last])], axis=-1)
        width = rd or head or -1
        rotated = em.add("Reshape", [pairs, _ints(em, 0, 0, 0, width)])
    else:
        rotated = em.add("Concat", [real, imag], axis=-1)
    steps = []  # what is left to do, the last writing the node's output
    if rest is not None:
        steps.append(("Concat", [rest], {"axis": -1}))
    if rank == 3:
        hidden = t.shape[2]
        steps.append(("Reshape", [_ints(em, 0, 0, hidden if isinstance(hidden, int) else -1)], {}))
    if t.dtype is not DType.FLOAT32:
        steps.append(("Cast", [], {"to": t.dtype.value}))
    y = rotated
    for k, (op_type, more, attrs) in enumerate(steps):
        last = k == len(steps) - 1
        y = em.add(op_type, [y, *more], outputs=[em.outputs[0]] if last else None, **attrs)
    if not steps:
        em.add("Identity", [y], outputs=[em.outputs[0]])


@register_expansion(ONNX_DOMAIN, "MeanVarianceNormalization")
def _expand_mean_variance_normalization(em: Emitter, node: Node) -> None:
    """MeanVarianceNormalization as itself, its axes always written: the op's ONNX function body reads the
    attribute (Constant<value_ints = @axes>), and onnx's checker (full check) rejects a node that leaves it to the
    schema default [0, 2, 3] (the body's Constant gets no value)."""
    axes = [int(a) for a in node.attrs.get("axes", node.schema.attrs["axes"].default)]
    em.add("MeanVarianceNormalization", [em.inputs[0]], outputs=[em.outputs[0]], axes=axes)


GRID_SAMPLE_20_OPSET = 20  # GridSample-20: any rank, modes linear/nearest/cubic (16: 4-D, bilinear/bicubic)


@register_expansion(ONNX_DOMAIN, "GridSample")
def _expand_grid_sample(em: Emitter, node: Node) -> None:
    """GridSample as itself, its mode spelled as the target opset's version names it; before opset 20 only the 4-D
    form exists, so another rank is refused by name."""
    mode = str(node.attrs.get("mode", "linear"))
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    t = em.input_type(0)
    if em.opset < GRID_SAMPLE_20_OPSET:
        if t is None or t.shape is None or len(t.shape) != 4:
            raise KilnError(f"{node.describe()}: GridSample on other than 4-D input needs ai.onnx opset "
                            f"{GRID_SAMPLE_20_OPSET}; this export writes opset {em.opset}")
        mode = {"linear": "bilinear", "cubic": "bicubic"}.get(mode, mode)
    attrs = {k: v for k, v in node.attrs.items() if k != "mode"}
    em.add("GridSample", em.inputs, outputs=[em.outputs[0]], mode=mode, **attrs)


@register_expansion(ONNX_DOMAIN, "CumProd")
def _expand_cumprod(em: Emitter, node: Node) -> None:
    """CumProd is an ai.onnx op from opset 26, past the opsets kiln writes: written in opset-18 ops, loop-free
    and without Log/Exp, as a Hillis-Steele scan along the axis of static length n: ceil(log2 n) steps of
    y = y * (y moved k = 1, 2, 4... places along the axis, the first k places 1) (Slice, Pad with 1, Mul);
    exclusive moves the inclusive result one more place, reverse flips the axis before and after (Slice, step
    -1). 16-bit floats multiply in float32 and round once, as kiln's reference does. The products are kiln's
    grouped as a tree rather than left to right: integers (wrapping) agree exactly, floats up to the rounding of
    a reordered product. A run-time axis or axis length is refused by name (the step count depends on it)."""
    t = em.input_type(0)
    axis_v = node.inputs[1].const if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if t is None or t.shape is None or axis_v is None:
        raise KilnError(f"{node.describe()}: CumProd exists in ai.onnx from opset 26 on, and kiln writes opsets "
                        f"{MIN_OPSET}..{MAX_OPSET}: its opset-18 form needs a constant axis and an input of known "
                        f"rank; save the model as .kiln (kiln.save), which keeps it")
    rank = len(t.shape)
    axis = int(np.asarray(axis_v).reshape(-1)[0])
    axis = axis + rank if axis < 0 else axis
    n = t.shape[axis]
    if not isinstance(n, int):
        raise KilnError(f"{node.describe()}: CumProd exists in ai.onnx from opset 26 on, and kiln writes opsets "
                        f"{MIN_OPSET}..{MAX_OPSET}: its opset-18 form needs the length of axis {axis} (here "
                        f"{n!r}) at export; save the model as .kiln (kiln.save), which keeps it")
    half = t.dtype in (DType.FLOAT16, DType.BFLOAT16)
    work = DType.FLOAT32 if half else t.dtype
    axes = _ints(em, axis)
    one = em.add("Constant", [], value=numpy_helper.from_array(np.array(1, work.numpy)))

    def moved(v: str, k: int) -> str:  # v moved k < n places along the axis, the first k places 1
        head = em.add("Slice", [v, _ints(em, 0), _ints(em, n - k), axes])
        return em.add("Pad", [head, _ints(em, k, 0), one, axes], mode="constant")

    def flipped(v: str) -> str:
        return em.add("Slice", [v, _ints(em, -1), _ints(em, np.iinfo(np.int64).min), axes, _ints(em, -1)])

    y = em.add("Cast", [em.inputs[0]], to=TensorProto.FLOAT) if half else em.inputs[0]
    reverse = int(node.attrs.get("reverse", 0))
    if reverse:
        y = flipped(y)
    k = 1
    while k < n:
        y = em.add("Mul", [y, moved(y, k)])
        k *= 2
    if int(node.attrs.get("exclusive", 0)) and n:
        y = moved(y, 1)
    if reverse:
        y = flipped(y)
    if half:
        em.add("Cast", [y], outputs=[em.outputs[0]], to=t.dtype.value)
    else:
        em.add("Identity", [y], outputs=[em.outputs[0]])


@register_expansion(ONNX_DOMAIN, "Einsum")
def _expand_einsum(em: Emitter, node: Node) -> None:
    """Einsum as itself, but where the ellipses of the inputs stand for different numbers of dims (kiln,
    like numpy, broadcasts them from the right; ONNX's shape inference refuses it), the shorter ones get
    leading size-1 dims at the ellipsis first (Unsqueeze): the same broadcast, spelled the way ONNX takes."""
    equation = str(node.attrs["equation"]).replace(" ", "")
    lhs = equation.split("->")[0].split(",")
    inputs = list(em.inputs)
    widths = {}
    for i, term in enumerate(lhs):
        t = em.input_type(i)
        if "..." in term and t is not None and t.shape is not None:
            widths[i] = len(t.shape) - len(term.replace("...", ""))
    if len(set(widths.values())) > 1:
        full = max(widths.values())
        for i, w in widths.items():
            if w < full:
                start = lhs[i].index("...")
                axes = em.add("Constant", [], value=numpy_helper.from_array(
                    np.arange(start, start + full - w, dtype=np.int64)))
                inputs[i] = em.add("Unsqueeze", [inputs[i], axes])
    em.add("Einsum", inputs, outputs=[em.outputs[0]], equation=equation)


# --------------------------------------------------------------------------- types and tensors


def _type_proto(t: TensorType) -> TypeProto:
    """Symbolic dims become dim_param, unknown dims an empty Dimension, an unknown rank no shape."""
    tp = TypeProto()
    tt = tp.tensor_type
    tt.elem_type = t.dtype.value
    if t.shape is not None:
        tt.shape.SetInParent()  # a rank-0 shape is an empty but present shape
        for d in t.shape:
            dim = tt.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
    return tp


def _value_info(name: str, t: Optional[TensorType]) -> ValueInfoProto:
    vi = ValueInfoProto()
    vi.name = name
    if t is not None:
        vi.type.CopyFrom(_type_proto(t))
    return vi


def _tensor_header(arr: np.ndarray, name: str, t: TensorProto) -> None:
    """Give ``t`` a name, dtype and dims, but no data yet."""
    t.name = name
    t.data_type = as_dtype(arr.dtype).value
    t.dims.extend(int(d) for d in arr.shape)


def _raw_view(arr: np.ndarray) -> memoryview:
    """The bytes ONNX's raw_data holds: C order, little endian (bool as one byte, float16 and
    bfloat16 as their 16-bit patterns). A view, without a copy, for a little-endian array."""
    a = np.ascontiguousarray(arr)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))


def _tensor(arr: np.ndarray, name: str = "") -> TensorProto:
    arr = np.asarray(arr)
    as_dtype(arr.dtype)  # a clear error for a dtype kiln does not support
    return numpy_helper.from_array(arr, name)


# --------------------------------------------------------------------------- the builder


_OPSET_RULES: dict[tuple[str, str], Callable[[Node], int]] = {}


def register_opset_rule(domain: str, op: str, fn: Callable[[Node], int]) -> None:
    """``fn(node)``: the oldest ai.onnx opset that writes ``node`` as itself (``default_opset``
    takes the largest over the graph; Resize with half_pixel_symmetric asks for 19)."""
    _OPSET_RULES[(domain, op)] = fn


register_opset_rule(ONNX_DOMAIN, "AveragePool", lambda n: POOL_DILATIONS_OPSET if _dilated(n) else 0)


def default_opset(graph: Graph) -> int:
    """18, or 20 when the graph (or a body) has a Gelu, so Gelu is written as itself, or what a
    registered opset rule asks for."""
    opset = GELU_OPSET if any(n.op == "Gelu" and n.domain == ONNX_DOMAIN for n in graph.walk()) else MIN_OPSET
    for n in graph.walk():
        rule = _OPSET_RULES.get((n.domain, n.op))
        if rule is not None:
            opset = max(opset, rule(n))
    return opset


def _check_opset(opset: int) -> int:
    if not isinstance(opset, (int, np.integer)) or isinstance(opset, bool):
        raise KilnError(f"opset must be an int, not {opset!r}")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise KilnError(f"kiln exports ai.onnx opsets {MIN_OPSET} to {MAX_OPSET}, not {opset}: kiln ops have "
                        f"opset-{MIN_OPSET} semantics, which older opsets cannot express")
    return int(opset)


class _Builder:
    """Builds the ModelProto of one graph. Tensors of ``defer_bytes`` bytes or more that are
    initializers are left without data and listed in ``deferred``: the caller decides whether
    they go inline or to an external data file once the size of everything else is known."""

    def __init__(self, graph: Graph, opset: int, defer_bytes: Optional[int] = None):
        self.graph = graph
        self.opset = opset
        self.defer_bytes = defer_bytes
        self.deferred: list[tuple[TensorProto, np.ndarray]] = []
        self._names: dict[int, str] = {}
        self._used_values: set[str] = set()
        self._used_nodes: set[str] = set()
        self._counters: dict[str, int] = {}
        for g in graph.all_graphs():
            for v in g.values():
                if v.name:
                    self._used_values.add(v.name)
            self._used_nodes.update(n.name for n in g.nodes if n.name)

    # ---- names: kiln names are unique and non-empty already, ONNX accepts any such string
    def name_of(self, v: Value) -> str:
        name = self._names.get(id(v))
        if name is None:
            name = v.name if v.name else self.fresh_value("value")
            self._names[id(v)] = name
        return name

    def _fresh(self, hint: str, used: set) -> str:
        if hint and hint not in used:
            used.add(hint)
            return hint
        base = hint or "v"
        while True:
            k = self._counters.get(base, 0) + 1
            self._counters[base] = k
            name = f"{base}_{k}"
            if name not in used:
                used.add(name)
                return name

    def fresh_value(self, hint: str) -> str:
        return self._fresh(hint, self._used_values)

    def fresh_node(self, hint: str) -> str:
        return self._fresh(hint, self._used_nodes)

    # ---- model
    def model(self) -> ModelProto:
        g = self.graph
        for name, value in (("inputs", g.inputs), ("outputs", g.outputs)):
            for v in value:
                if v.type is None:
                    raise KilnError(f"graph {name[:-1]} '{v.name}' has no type; run kiln.ir.passes.infer_shapes(graph) "
                                    "before exporting to ONNX")
        opset_ids = [helper.make_opsetid(ONNX_DOMAIN, self.opset)]
        model = ModelProto()
        # The oldest IR version that can carry this opset, so older runtimes load the file.
        model.ir_version = helper.find_min_ir_version_for(opset_ids)
        model.opset_import.extend(opset_ids)
        model.producer_name = "kiln"
        model.producer_version = __version__
        meta = g.metadata
        if meta.doc_string:
            model.doc_string = meta.doc_string
        props = {str(k): str(v) for k, v in meta.props.items()}
        if (meta.producer_name, meta.producer_version) != ("kiln", __version__) and meta.producer_name:
            props.setdefault("kiln.source_producer", f"{meta.producer_name} {meta.producer_version}".strip())
        for k in sorted(props):
            p = model.metadata_props.add()
            p.key, p.value = k, props[k]
        self.graph_proto(g, model.graph)
        return model

    def graph_proto(self, g: Graph, gp: GraphProto) -> None:
        """Fill ``gp`` (in place: protobuf copies on assignment, and weights should not be copied)."""
        gp.name = g.name or ("main" if g.parent is None else self.fresh_node("body"))
        top = g.parent is None
        nodes: list[NodeProto] = []
        for n in g.nodes:
            self.emit(n, nodes)
        for v in g.initializers.values():
            self.initializer(v, gp.initializer.add())
        gp.input.extend(_value_info(self.name_of(v), v.type) for v in g.inputs)
        seen: set[str] = set()
        outputs = []
        for v in g.outputs:
            name = self.name_of(v)
            # A repeated output, or a body output defined outside the body, goes through an
            # Identity: ONNX wants output names unique and body outputs computed in the body.
            if name in seen or (not top and v.graph is not g):
                copy = self.fresh_value(f"{name}_out")
                node = helper.make_node("Identity", [name], [copy], name=self.fresh_node(f"{name}_out"))
                nodes.append(node)
                name = copy
            seen.add(name)
            outputs.append(_value_info(name, v.type))
        gp.node.extend(nodes)
        gp.output.extend(outputs)
        out_names = {vi.name for vi in outputs}
        for n in g.nodes:
            for v in n.outputs:
                name = self.name_of(v)
                if v.type is not None and name not in out_names:
                    gp.value_info.append(_value_info(name, v.type))

    def initializer(self, v: Value, t: TensorProto) -> None:
        arr = v.const
        if self.defer_bytes is not None and arr.nbytes >= self.defer_bytes:
            _tensor_header(arr, self.name_of(v), t)
            self.deferred.append((t, arr))
        else:
            t.CopyFrom(_tensor(arr, self.name_of(v)))

    # ---- nodes
    def emit(self, node: Node, out: list) -> None:
        expansion = _expansion_for(node, self.opset)
        if expansion is not None:
            expansion.fn(Emitter(self, node, out), node)
            return
        if node.domain != ONNX_DOMAIN:
            raise UnsupportedOpError(
                f"{node.describe()}: op '{node.qualified_op}' has no ONNX form; register one with "
                f"kiln.serializer.onnx.register_expansion({node.domain!r}, {node.op!r})")
        try:
            schema = onnx.defs.get_schema(node.op, self.opset, ONNX_DOMAIN)
        except onnx.defs.SchemaError:
            raise UnsupportedOpError(f"{node.describe()}: ai.onnx opset {self.opset} has no op '{node.op}'") from None
        proto = NodeProto()
        proto.op_type = node.op
        proto.name = node.name
        inputs = [self.name_of(v) if v is not None else "" for v in node.inputs]
        while inputs and inputs[-1] == "":
            inputs.pop()
        proto.input.extend(inputs)
        proto.output.extend(self.name_of(v) for v in node.outputs)
        kiln_schema = node.schema
        for k in sorted(node.attrs):
            value = node.attrs[k]
            spec = kiln_schema.attrs[k]
            if k not in schema.attributes:
                if not spec.required and _same(value, spec.default):
                    continue  # an attribute newer than the opset, holding the only behaviour the opset has
                raise UnsupportedOpError(f"{node.describe()}: attribute {k}={value!r} needs a newer opset than "
                                         f"{self.opset} (ai.onnx {node.op}-{schema.since_version} lacks it)")
            self.attribute(k, spec.kind, value, proto.attribute.add())
        self.annotate(proto, node)
        out.append(proto)

    def annotate(self, proto: NodeProto, node: Node) -> None:
        if not node.meta:
            return
        for k in sorted(node.meta):
            p = proto.metadata_props.add()
            p.key, p.value = str(k), str(node.meta[k])
        scope, source = node.meta.get("scope"), node.meta.get("source")
        doc = " ".join(s for s in (scope, f"[{source}]" if source else "") if s)
        if doc:
            proto.doc_string = doc

    def attribute(self, name: str, kind: AttrKind, value, a: AttributeProto) -> None:
        a.name = name
        if kind is AttrKind.INT:
            a.type, a.i = AttributeProto.INT, int(value)
        elif kind is AttrKind.FLOAT:
            a.type, a.f = AttributeProto.FLOAT, float(value)
        elif kind is AttrKind.STRING:
            a.type, a.s = AttributeProto.STRING, value.encode("utf-8")
        elif kind is AttrKind.INTS:
            a.type = AttributeProto.INTS
            a.ints.extend(int(x) for x in value)
        elif kind is AttrKind.FLOATS:
            a.type = AttributeProto.FLOATS
            a.floats.extend(float(x) for x in value)
        elif kind is AttrKind.STRINGS:
            a.type = AttributeProto.STRINGS
            a.strings.extend(s.encode("utf-8") for s in value)
        elif kind is AttrKind.TENSOR:
            a.type = AttributeProto.TENSOR
            a.t.CopyFrom(_tensor(value))
        elif kind is AttrKind.GRAPH:
            a.type = AttributeProto.GRAPH
            self.graph_proto(value, a.g)
        else:  # pragma: no cover - AttrKind is closed
            raise KilnError(f"attribute kind {kind} has no ONNX form")


def _same(a, b) -> bool:
    try:
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- public API


def _check_nesting(graph: Graph) -> None:
    """Refuse subgraphs nested deeper than ONNX_MAX_NESTING: protobuf parsers (onnx.load,
    onnxruntime) stop at a message depth of 100, three messages per If/Loop level, so the file
    would be written and then be unreadable everywhere."""
    stack = [(graph, 0)]
    while stack:
        g, depth = stack.pop()
        for n in g.nodes:
            for sg in n.subgraphs():
                if depth + 1 > ONNX_MAX_NESTING:
                    raise UnsupportedOpError(
                        f"{n.describe()}: subgraphs nested {depth + 1} levels deep; an ONNX file holds at most "
                        f"{ONNX_MAX_NESTING} (protobuf's parse depth), so the model cannot be exported")
                stack.append((sg, depth + 1))


def to_onnx_model(graph: Graph, *, opset: Optional[int] = None) -> ModelProto:
    """The ONNX model of ``graph``, in memory, with every tensor inline.

    ``opset`` is the ai.onnx opset to write (default: :func:`default_opset`). Every value
    of the graph's inputs and outputs must have a type (run ``infer_shapes`` first). A model
    with 2 GB of weights or more cannot be serialized inline: use :func:`export_onnx`, which
    moves them to an external data file."""
    opset = default_opset(graph) if opset is None else _check_opset(opset)
    _check_nesting(graph)
    return _Builder(graph, opset).model()


def export_onnx(graph: Graph, path: Union[str, os.PathLike], *, opset: Optional[int] = None,
                external_data: Optional[bool] = None, size_threshold: int = 1024) -> Path:
    """Write ``graph`` to ``path`` as an ONNX model; returns the path.

    ``external_data``: None (default) stores initializers in ``<file name>.data`` next to the
    model only when the model would otherwise reach protobuf's 2 GB limit (``PROTOBUF_LIMIT``);
    True always does, False never does (and fails for a model that big). Only initializers of
    ``size_threshold`` bytes or more go to the data file. Written atomically: the files are
    written under temporary names in the target folder and renamed into place (data first), so a
    reader never sees half a model.
    """
    path = Path(path)
    opset = default_opset(graph) if opset is None else _check_opset(opset)
    if size_threshold < 0:
        raise KilnError(f"size_threshold must be >= 0, not {size_threshold}")
    _check_nesting(graph)
    builder = _Builder(graph, opset, defer_bytes=None if external_data is False else size_threshold)
    model = builder.model()
    skeleton = model.ByteSize()
    # Inline, each deferred tensor adds its bytes plus a raw_data field header (tag + length).
    inline = skeleton + sum(arr.nbytes + 16 for _, arr in builder.deferred)
    external = bool(external_data) if external_data is not None else inline > PROTOBUF_LIMIT
    data_path = path.with_name(path.name + DATA_SUFFIX)
    if not external:
        for t, arr in builder.deferred:
            t.raw_data = _raw_view(arr).tobytes()
        if inline > PROTOBUF_LIMIT:
            raise KilnError(f"the ONNX model of '{graph.name}' is {inline / 2**30:.2f} GiB, over protobuf's 2 GB "
                            "limit: export it with external_data=True (or None)")
    elif skeleton > PROTOBUF_LIMIT:
        raise KilnError(f"the ONNX model of '{graph.name}' is over protobuf's 2 GB limit even without its "
                        f"initializers ({skeleton / 2**30:.2f} GiB)")
    folder = path.parent if str(path.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder))
    try:
        mode = 0o644 & ~_umask()
        if external:
            _write_external(tmp / "data", builder.deferred, data_path.name)
            os.chmod(tmp / "data", mode)
        with open(tmp / "model", "wb") as f:
            f.write(model.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp / "model", mode)
        if external:
            os.replace(tmp / "data", data_path)
        os.replace(tmp / "model", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _write_external(file: Path, tensors: list, location: str) -> None:
    """Write the deferred tensors' bytes to ``file`` and point their protos at it."""
    pos = 0
    with open(file, "wb") as f:
        for t, arr in tensors:
            raw = _raw_view(arr)
            align = _BIG_ALIGNMENT if raw.nbytes >= _BIG_TENSOR else _SMALL_ALIGNMENT
            offset = -(-pos // align) * align
            f.write(b"\0" * (offset - pos))
            for start in range(0, raw.nbytes, _CHUNK):
                f.write(raw[start:start + _CHUNK])
            pos = offset + raw.nbytes
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(raw.nbytes))):
                e = t.external_data.add()
                e.key, e.value = k, v
        f.flush()
        os.fsync(f.fileno())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------- kiln.FusedElementwise, kiln.FusedEpilogue, kiln.FusedAttention


@register_expansion("kiln", "FusedAttention")
@register_expansion("kiln", "FusedEpilogue")
@register_expansion("kiln", "FusedElementwise")
def _expand_fused_elementwise(em: Emitter, node: Node) -> None:
    """The body's nodes inlined: body inputs take the node's input names, body outputs the node's
    output names, body initializers become Constant nodes. Each body node is emitted like a
    top-level one (so a Gelu in the body is expanded below opset 20 too). A body output that is
    not computed by a body node, or is repeated, goes through an Identity (ONNX is SSA).
    A FusedEpilogue body is closed the same way (its anchor, a Conv/Gemm/MatMul, is one more
    body node), and so is a FusedAttention body (MatMul, scale, mask Add, Softmax, MatMul), so
    the three ops expand alike."""
    body: Graph = node.attrs["body"]
    b = em._builder
    for v, name in zip(body.inputs, em.inputs):
        b._names[id(v)] = name
    for v in body.initializers.values():
        em.add("Constant", [], outputs=[b.name_of(v)], value=_tensor(v.const))
    late = []
    for v, name in zip(body.outputs, em.outputs):
        if v.producer is not None and v.producer.graph is body and id(v) not in b._names:
            b._names[id(v)] = name
        else:
            late.append((v, name))
    for inner in body.nodes:
        b.emit(inner, em._out)
    for v, name in late:
        em.add("Identity", [b.name_of(v)], outputs=[name])


# --------------------------------------------------------------------------- kiln.Assert
import logging  # noqa: E402  (only this expansion logs)

_log = logging.getLogger(__name__)


@register_expansion("kiln", "Assert")
def _drop_assert(em: Emitter, node: Node) -> None:
    """ONNX has no assertion op and no way to fail a run on purpose, so a run-time check
    (kiln/ir/ops/assertion.py) is dropped: the exported model computes the same outputs but no
    longer checks the condition. A warning names each dropped check. The ops computing the
    condition stay (unused outputs are valid ONNX; onnxruntime's optimizer removes them)."""
    message = node.attrs.get("message") or "assertion"
    where = node.attrs.get("location")
    _log.warning("ONNX export: dropping the run-time check %s (%r%s): ONNX cannot express an assertion",
                 node.describe(), message, f" at {where}" if where else "")


@register_expansion("kiln", "Guard")
def _drop_guard(em: Emitter, node: Node) -> None:
    """A kiln.Guard (kiln/ir/ops/guard.py) is dropped like an Assert, for the same reason: ONNX
    cannot fail a run. The exported model answers as the trace did, for every input, including
    those the .kiln file would refuse; the warning names each dropped guard and its line."""
    where = node.attrs.get("location") or "an unknown line"
    _log.warning("ONNX export: dropping the guard %s (%s at %s): ONNX cannot fail a run, so the exported "
                 "model answers as the trace did even for inputs the .kiln file refuses",
                 node.describe(), node.attrs.get("what", "a value"), where)


from kiln.serializer import onnx_resize  # noqa: E402  (Resize-18/19 and the opset it needs)

onnx_resize.register_export()
