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
    raise KilnError("ONNX export needs the 'onnx' package: pip install 'kiln-compiler[onnx]'") from e

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
    if t is not None and t.dtype.is_signed:
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


GROUP_NORM_21_OPSET = 21  # GroupNormalization-21: scale and bias per channel (GroupNormalization-18: per group)


@register_expansion(ONNX_DOMAIN, "GroupNormalization", native_since=GROUP_NORM_21_OPSET)
def _expand_group_normalization(em: Emitter, node: Node) -> None:
    """GroupNormalization-21 before opset 21 (whose GroupNormalization-18 takes scale and bias per group, not per
    channel) in opset-18 ops, computing what kiln does (kiln.ir.ops.normalization): X cast to stash_type (and a
    16-bit stash widened to float32), reshaped to [N, num_groups, -1]; the group mean and the mean of the squared
    deviations; (X - mean) / sqrt(var + epsilon) (epsilon a float32 cast to stash_type) rounded to stash_type,
    cast to X's type and reshaped back; then times scale plus bias per channel (in float32 for 16-bit X: one
    rounding). Needs X's rank."""
    x, scale, bias = em.inputs[:3]
    t = em.input_type(0)
    if t is None or t.shape is None:
        raise KilnError(f"{node.describe()}: GroupNormalization before ai.onnx opset {GROUP_NORM_21_OPSET} is "
                        f"written as its definition, which needs X's rank (unknown here); export at opset "
                        f"{GROUP_NORM_21_OPSET} or later")
    narrow = (DType.FLOAT16, DType.BFLOAT16)
    stash = DType(int(node.attrs.get("stash_type", 1)))
    wide = DType.FLOAT32 if stash in narrow else stash
    acc = DType.FLOAT32 if t.dtype in narrow else t.dtype

    def cast(v: str, frm: DType, to: DType) -> str:
        return v if frm is to else em.add("Cast", [v], to=to.value)

    groups = int(node.attrs["num_groups"])
    xg = em.add("Reshape", [cast(cast(x, t.dtype, stash), stash, wide), _ints(em, 0, groups, -1)])
    centered = em.add("Sub", [xg, em.add("ReduceMean", [xg, _ints(em, 2)], keepdims=1)])
    var = em.add("ReduceMean", [em.add("Mul", [centered, centered]), _ints(em, 2)], keepdims=1)
    epsilon = np.array(float(node.attrs.get("epsilon", 1e-5)), np.float32)
    eps = cast(cast(em.add("Constant", [], value=numpy_helper.from_array(epsilon)), DType.FLOAT32, stash), stash, wide)
    normalized = em.add("Div", [centered, em.add("Sqrt", [em.add("Add", [var, eps])])])
    normalized = em.add("Reshape", [cast(cast(normalized, wide, stash), stash, t.dtype), em.add("Shape", [x])])
    per_channel = _ints(em, -1, *([1] * (len(t.shape) - 2)))
    scale = cast(em.add("Reshape", [scale, per_channel]), t.dtype, acc)
    bias = cast(em.add("Reshape", [bias, per_channel]), t.dtype, acc)
    shifted = [em.add("Mul", [cast(normalized, t.dtype, acc), scale]), bias]
    if acc is t.dtype:
        em.add("Add", shifted, outputs=[em.outputs[0]])
    else:
        em.add("Cast", [em.add("Add", shifted)], to=t.dtype.value, outputs=[em.outputs[0]])


def _through_float32(em: Emitter, node: Node, op: str, cast_outputs: int = 1, **attrs) -> None:
    """``op`` on input 0 cast to float32 (every float16/bfloat16 value is exact there), its first
    ``cast_outputs`` outputs cast back to input 0's type, the others written as they are."""
    t = em.input_type(0)
    x = em.add("Cast", [em.inputs[0]], to=TensorProto.FLOAT)
    wide = [em._builder.fresh_value(f"{o}_float32") for o in em.outputs[:cast_outputs]]
    em.add(op, [x, *em.inputs[1:]], outputs=wide + em.outputs[cast_outputs:], **attrs)
    for w, o in zip(wide, em.outputs):
        em.add("Cast", [w], to=t.dtype.value, outputs=[o])


def _is_narrow(em: Emitter, bf16_only: bool = False) -> bool:
    t = em.input_type(0)
    return t is not None and (t.dtype is DType.BFLOAT16 or (t.dtype is DType.FLOAT16 and not bf16_only))


@register_expansion(ONNX_DOMAIN, "Det")
def _expand_det(em: Emitter, node: Node) -> None:
    """Det as itself; of float16/bfloat16 (the latter only in Det-22) as kiln computes it: in float32, rounded once."""
    if _is_narrow(em):
        _through_float32(em, node, "Det")
    else:
        em.add("Det", em.inputs, outputs=em.outputs)


@register_expansion(ONNX_DOMAIN, "Unique")
def _expand_unique(em: Emitter, node: Node) -> None:
    """Unique as itself; of float16/bfloat16 (the latter only in Unique-28, past the opsets kiln writes) through
    float32, where kiln compares them: Y cast back, the int64 outputs as they are."""
    attrs = {k: int(v) for k, v in node.attrs.items() if v is not None}
    if _is_narrow(em):
        _through_float32(em, node, "Unique", **attrs)
    else:
        em.add("Unique", em.inputs, outputs=em.outputs, **attrs)


@register_expansion(ONNX_DOMAIN, "ReverseSequence")
def _expand_reverse_sequence(em: Emitter, node: Node) -> None:
    """ReverseSequence as itself; of bfloat16 (only in ReverseSequence-28, past the opsets kiln writes) through
    float32, which holds every bfloat16 value."""
    attrs = {k: int(v) for k, v in node.attrs.items()}
    if _is_narrow(em, bf16_only=True):
        _through_float32(em, node, "ReverseSequence", **attrs)
    else:
        em.add("ReverseSequence", em.inputs, outputs=em.outputs, **attrs)


BF16_POOL_OPSET = 22  # GlobalLpPool-22 and MaxRoiPool-22 add bfloat16 (GlobalLpPool-2 and MaxRoiPool-1 lack it)


def _expand_bf16_pool(em: Emitter, node: Node) -> None:
    """GlobalLpPool and MaxRoiPool as themselves; of bfloat16 before opset 22 through float32, exactly as kiln
    computes them (kiln.ir.ops.pool): GlobalLpPool in float32 rounded once, MaxRoiPool's RoI coordinates in
    float32 and a max that any float type holds; every bfloat16 value is exact in float32."""
    attrs = {"p": int, "pooled_shape": lambda v: [int(i) for i in v], "spatial_scale": float}
    attrs = {k: attrs[k](v) for k, v in node.attrs.items() if v is not None}
    if not _is_narrow(em, bf16_only=True):
        em.add(node.op, em.inputs, outputs=em.outputs, **attrs)
        return
    wide = em.add(node.op, [em.add("Cast", [i], to=TensorProto.FLOAT) for i in em.inputs], **attrs)
    em.add("Cast", [wide], to=TensorProto.BFLOAT16, outputs=[em.outputs[0]])


register_expansion(ONNX_DOMAIN, "GlobalLpPool", native_since=BF16_POOL_OPSET)(_expand_bf16_pool)
register_expansion(ONNX_DOMAIN, "MaxRoiPool", native_since=BF16_POOL_OPSET)(_expand_bf16_pool)


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


def _swish_gate(em: Emitter, node: Node, value: Optional[str]) -> None:
    """Swish_alpha(X) = X * Sigmoid(alpha * X), times ``value`` for SwiGLU, into the node's output. alpha is the
    float attribute cast to X's type (the function body's CastLike); 16-bit floats are widened to float32 and the
    result rounded once, as kiln's reference computes (kiln.ir.ops.activation). Of an unknown type, X's own type
    computes, as the function body does."""
    t = em.input_type(0)
    half = t is not None and t.dtype in (DType.FLOAT16, DType.BFLOAT16)
    x = em.inputs[0]
    if half:
        x = em.add("Cast", [x], to=TensorProto.FLOAT)
        value = em.add("Cast", [value], to=TensorProto.FLOAT) if value else value
    alpha = np.float32(node.attrs.get("alpha", 1.0))
    if t is not None:
        alpha = np.asarray(alpha).astype(t.dtype.numpy).astype(DType.FLOAT32.numpy if half else t.dtype.numpy)
        scaled = x if alpha == 1 else em.add("Mul", [x, em.add("Constant", [], value=numpy_helper.from_array(alpha))])
    else:
        alpha_t = em.add("CastLike", [em.add("Constant", [], value=numpy_helper.from_array(np.asarray(alpha))), x])
        scaled = em.add("Mul", [x, alpha_t])
    last = [em.outputs[0]] if not half else None
    y = em.add("Mul", [x, em.add("Sigmoid", [scaled])], outputs=None if value else last)
    if value:
        y = em.add("Mul", [y, value], outputs=last)
    if half:
        em.add("Cast", [y], outputs=[em.outputs[0]], to=t.dtype.value)


@register_expansion(ONNX_DOMAIN, "Swish")
def _expand_swish(em: Emitter, node: Node) -> None:
    """Swish is an ai.onnx op from opset 24, past the opsets kiln writes: its function body in opset-18 ops."""
    _swish_gate(em, node, None)


@register_expansion(ONNX_DOMAIN, "SwiGLU")
def _expand_swiglu(em: Emitter, node: Node) -> None:
    """SwiGLU is an ai.onnx op from opset 28, past the opsets kiln writes: its function body, Swish_alpha(A) * B,
    in opset-18 ops (A and B have one shape: the Mul broadcasts nothing)."""
    _swish_gate(em, node, em.inputs[1])


@register_expansion(ONNX_DOMAIN, "CausalConvWithState")
def _expand_causal_conv_with_state(em: Emitter, node: Node) -> None:
    """CausalConvWithState is an ai.onnx op from opset 27, past the opsets kiln writes: written in opset-18 ops as
    its function body computes it and kiln does (kiln.ir.ops.causal_conv): the input prefixed with past_state
    (Concat) or with k - 1 zeros (Pad), a depthwise Conv (group = channels) with the bias, X * Sigmoid(X) for
    activation silu/swish, and present_state the prefixed sequence from position L (the input's length) on. 16-bit
    floats convolve in float32 and round once, as kiln's reference does. Conv's group must be known at export: a
    channel count known only at run time is refused by name."""
    x, w = em.inputs[0], em.inputs[1]
    bias = em.inputs[2] if len(em.inputs) > 2 else ""
    past = em.inputs[3] if len(em.inputs) > 3 else ""
    tx, tw, tb = em.input_type(0), em.input_type(1), em.input_type(2) if bias else None
    known = [t.shape[i] for t, i in ((tw, 0), (tx, 1), (tb, 0)) if t is not None and t.shape is not None]
    channels = next((d for d in known if isinstance(d, int)), None)
    if channels is None:
        raise KilnError(f"{node.describe()}: CausalConvWithState exists in ai.onnx from opset 27 on, and kiln writes "
                        f"opsets {MIN_OPSET}..{MAX_OPSET}: its opset-18 form is a Conv whose group is the channel "
                        f"count, unknown here at export; save the model as .kiln (kiln.save), which keeps it")
    if past:
        padded = em.add("Concat", [past, x], axis=2)
    else:
        k = tw.shape[2] if tw is not None and tw.shape is not None else None
        if isinstance(k, int):
            pads = _ints(em, 0, 0, k - 1, 0, 0, 0)
        else:
            km1 = em.add("Sub", [em.add("Shape", [w], start=2, end=3), _ints(em, 1)])
            pads = em.add("Concat", [_ints(em, 0, 0), km1, _ints(em, 0, 0, 0)], axis=0)
        padded = em.add("Pad", [x, pads], mode="constant")
    if len(em.outputs) > 1 and em.outputs[1]:
        length = em.add("Shape", [x], start=2, end=3)
        em.add("Slice", [padded, length, _ints(em, _INT64_MAX), _ints(em, 2)], outputs=[em.outputs[1]])
    half = tx is not None and tx.dtype in (DType.FLOAT16, DType.BFLOAT16)
    operands = [padded, w] + ([bias] if bias else [])
    if half:
        operands = [em.add("Cast", [v], to=TensorProto.FLOAT) for v in operands]
    silu = node.attrs.get("activation", "none") in ("silu", "swish")
    last = None if half or silu else [em.outputs[0]]
    y = em.add("Conv", operands, outputs=last, group=int(channels))
    if silu:
        y = em.add("Mul", [y, em.add("Sigmoid", [y])], outputs=None if half else [em.outputs[0]])
    if half:
        em.add("Cast", [y], outputs=[em.outputs[0]], to=tx.dtype.value)


class _Subgraph:
    """Nodes of a subgraph (a Scan body, an If branch) written for an expansion, with names unique in the whole
    model; ``graph`` makes its GraphProto of float32 inputs and outputs."""

    def __init__(self, em: Emitter, hint: str):
        self._b, self._base, self.nodes = em._builder, f"{em.node.name or em.node.op.lower()}/{hint}", []

    def name(self, hint: str) -> str:
        return self._b.fresh_value(f"{self._base}/{hint}")

    def add(self, op_type: str, inputs: Sequence[str], num_outputs: int = 1, **attrs) -> Union[str, list]:
        outs = [self.name(op_type.lower()) for _ in range(num_outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=self._b.fresh_node(f"{self._base}/{op_type}"), **attrs))
        return outs[0] if num_outputs == 1 else outs

    def ints(self, *values: int) -> str:
        return self.add("Constant", [], value=numpy_helper.from_array(np.array(values, np.int64)))

    def graph(self, inputs: Sequence[str], outputs: Sequence[str]) -> GraphProto:
        def info(n):
            return helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
        return helper.make_graph(self.nodes, self._b.fresh_node(self._base), [info(n) for n in inputs],
                                 [info(n) for n in outputs])


def _linear_attention_step(em: Emitter, shapes: dict, gated: bool, delta: bool) -> GraphProto:
    """The Scan body of one LinearAttention token, in float32: (state [B, Hkv, dk, dv], q_t [B, Hq*dk],
    k_t [B, Hkv*dk], v_t [B, Hkv*dv][, decay_t [B, Hkv | Hkv*dk]][, beta_t [B, Hkv | 1]]) -> (the new state,
    the unscaled read qᵀS [B, Hq*dv]). The per-head shapes are outer-scope values (``shapes``), without -1, so that
    an empty batch reshapes too."""
    sg = _Subgraph(em, "step")
    names = ["state", "q_t", "k_t", "v_t"] + (["decay_t"] if gated else []) + (["beta_t"] if delta else [])
    inputs = {n: sg.name(n) for n in names}
    k4 = sg.add("Reshape", [inputs["k_t"], shapes["k"]])                                 # [B, Hkv, dk]
    state = inputs["state"]
    if gated:  # exp(g) per head or per key dim, over dv: [B, Hkv, 1 | dk, 1]
        state = sg.add("Mul", [state, sg.add("Exp", [sg.add("Reshape", [inputs["decay_t"], shapes["decay"]])])])
    row = sg.add("Unsqueeze", [sg.add("Reshape", [inputs["v_t"], shapes["v"]]), sg.ints(-2)])  # [B, Hkv, 1, dv]
    if delta:  # beta (v - Sᵀk)
        retrieved = sg.add("MatMul", [sg.add("Unsqueeze", [k4, sg.ints(-2)]), state])   # [B, Hkv, 1, dv]
        row = sg.add("Mul", [sg.add("Reshape", [inputs["beta_t"], shapes["beta"]]), sg.add("Sub", [row, retrieved])])
    new_state = sg.add("Add", [state, sg.add("Mul", [sg.add("Unsqueeze", [k4, sg.ints(-1)]), row])])
    read = sg.add("MatMul", [sg.add("Reshape", [inputs["q_t"], shapes["q"]]), new_state])  # [B, Hkv, group, dv]
    read = sg.add("Reshape", [read, shapes["out"]])
    return sg.graph([inputs[n] for n in names], [new_state, read])


@register_expansion(ONNX_DOMAIN, "LinearAttention")
def _expand_linear_attention(em: Emitter, node: Node) -> None:
    """LinearAttention is an ai.onnx op from opset 27, past the opsets kiln writes: written in opset-18 ops as its
    function body does, a Scan over the tokens (axis 1 of the packed [B, T, H*d] inputs) carrying the float32
    state, and computing what kiln does (kiln.ir.ops.linear_attention), rounding included: every input widened to
    float32, the state zeros (ConstantOfShape) or past_state, per step the decay (Exp), the delta correction
    (MatMul of k with the state, beta times the difference), the outer-product write and the grouped read
    (q reshaped to [B, Hkv, group, dk] times the state); after the Scan the scale (the default 1/sqrt(dk) in
    float64, as ONNX's reference evaluator multiplies, an explicit one in float32) and the casts back to the
    output's and the state's types. Sums are MatMul's: floats agree up to the rounding of a reordered sum.
    onnxruntime's Scan fails on a sequence of length 0 (a floating-point exception where it scans axis 1): an
    empty sequence is written without the Scan, and one whose length is known at run time only goes through an If
    whose then-branch gives the state as it was and an empty output."""
    from kiln.ir.ops.linear_attention import UPDATE_RULES
    tq = em.input_type(0)
    if tq is None or tq.shape is None or node.outputs[1].type is None:
        raise KilnError(f"{node.describe()}: exporting LinearAttention needs the types of query and present_state")
    gated, delta = UPDATE_RULES[str(node.attrs.get("update_rule", "gated_delta"))]
    hq, hkv = int(node.attrs["q_num_heads"]), int(node.attrs["kv_num_heads"])
    f32, f64 = TensorProto.FLOAT, TensorProto.DOUBLE

    def wide(i: int) -> str:
        t = em.input_type(i)
        return em.inputs[i] if t is not None and t.dtype is DType.FLOAT32 else em.add("Cast", [em.inputs[i]], to=f32)

    def dim(i: int, axis: int, heads: int = 1) -> Union[int, str]:
        """Input i's dim ``axis`` / heads: an int where known at export, else a 1-D int64 value."""
        t = em.input_type(i)
        d = t.shape[axis] if t is not None and t.shape is not None else None
        if isinstance(d, int):
            return d // heads
        d = em.add("Shape", [em.inputs[i]], start=axis, end=axis + 1)
        return d if heads == 1 else em.add("Div", [d, _ints(em, heads)])

    def shape(*parts: Union[int, str]) -> str:
        if all(isinstance(p, int) for p in parts):
            return _ints(em, *parts)
        return em.add("Concat", [_ints(em, p) if isinstance(p, int) else p for p in parts], axis=0)

    dk, dv = dim(0, 2, hq), dim(2, 2, hkv)
    width = hq * dv if isinstance(dv, int) else em.add("Mul", [dv, _ints(em, hq)])
    shapes = {"k": shape(0, hkv, dk), "v": shape(0, hkv, dv), "q": shape(0, hkv, hq // hkv, dk),
              "out": shape(0, width)}
    if gated:
        shapes["decay"] = shape(0, hkv, dim(4, 2, hkv), 1)
    if delta:
        shapes["beta"] = shape(0, dim(5, 2), 1, 1)
    batch = em.add("Shape", [em.inputs[0]], start=0, end=1)
    past = em.inputs[3] if len(em.inputs) > 3 else ""
    zero = numpy_helper.from_array(np.zeros(1, np.float32))
    if past:
        state = wide(3)
    else:
        state = em.add("ConstantOfShape", [em.add("Concat", [batch, shape(hkv, dk, dv)], axis=0)], value=zero)
    steps = tq.shape[1]
    if steps == 0:
        final = state
        reads = em.add("ConstantOfShape", [em.add("Concat", [batch, _ints(em, 0), shape(width)], axis=0)], value=zero)
    else:
        # The tokens moved to axis 0 (Transpose) and scanned there: onnxruntime's Scan along another axis fails
        # on any empty input (a floating-point exception), an empty batch included.
        tokens_first = [1, 0, 2]
        scans = [em.add("Transpose", [wide(i)], perm=tokens_first)
                 for i in [0, 1, 2] + ([4] if gated else []) + ([5] if delta else [])]
        scan = dict(body=_linear_attention_step(em, shapes, gated, delta), num_scan_inputs=len(scans))
        if isinstance(steps, int):
            final, reads = em.add("Scan", [state, *scans], num_outputs=2, **scan)
        else:
            empty = _Subgraph(em, "no_tokens")
            kept = empty.add("Identity", [state])
            no_reads = empty.add("ConstantOfShape", [empty.add("Concat", [empty.ints(0), batch, shape(width)],
                                                               axis=0)], value=zero)
            tokens = _Subgraph(em, "tokens")
            scanned = tokens.add("Scan", [state, *scans], num_outputs=2, **scan)
            length = em.add("Shape", [em.inputs[0]], start=1, end=2)
            none = em.add("Squeeze", [em.add("Equal", [length, _ints(em, 0)]), _ints(em, 0)])
            final, reads = em.add("If", [none], num_outputs=2, then_branch=empty.graph([], [kept, no_reads]),
                                  else_branch=tokens.graph([], scanned))
        reads = em.add("Transpose", [reads], perm=tokens_first)
    scale = float(node.attrs.get("scale", 0.0))
    if scale != 0.0:
        y = em.add("Mul", [reads, em.add("Constant", [], value=numpy_helper.from_array(np.array(scale, np.float32)))])
    else:
        if isinstance(dk, int):
            with np.errstate(divide="ignore"):
                factor = em.add("Constant", [], value=numpy_helper.from_array(np.array(1.0 / np.sqrt(np.float64(dk)))))
        else:
            factor = em.add("Reciprocal", [em.add("Sqrt", [em.add("Cast", [dk], to=f64)])])
        y = em.add("Cast", [em.add("Mul", [em.add("Cast", [reads], to=f64), factor])], to=f32)
    for value, out, t in ((y, em.outputs[0], tq.dtype), (final, em.outputs[1], node.outputs[1].type.dtype)):
        if t is DType.FLOAT32:
            em.add("Identity", [value], outputs=[out])
        else:
            em.add("Cast", [value], outputs=[out], to=t.value)


@register_expansion(ONNX_DOMAIN, "TensorScatter")
def _expand_tensor_scatter(em: Emitter, node: Node) -> None:
    """TensorScatter is an ai.onnx op from opset 24, past the opsets kiln writes: written in opset-18 ops as a
    ScatterElements along its axis whose indices are, for batch entry b and update position s, write_indices[b]
    + s (Range, broadcast to the update's shape by Expand), modulo the axis length in circular mode. The rank of
    past_cache must be known at export."""
    t = em.input_type(0)
    if t is None or t.shape is None:
        raise KilnError(f"{node.describe()}: exporting TensorScatter needs the rank of past_cache")
    rank = len(t.shape)
    axis = int(node.attrs.get("axis", -2))
    axis = axis + rank if axis < 0 else axis
    past, update = em.inputs[0], em.inputs[1]
    writes = em.inputs[2] if len(em.inputs) > 2 else ""

    def scalar(v: int) -> str:
        return em.add("Constant", [], value=numpy_helper.from_array(np.array(v, np.int64)))

    steps = em.add("Squeeze", [em.add("Shape", [update], start=axis, end=axis + 1)])
    pos = em.add("Reshape", [em.add("Range", [scalar(0), steps, scalar(1)]),
                             _ints(em, *(-1 if d == axis else 1 for d in range(rank)))])
    if writes:
        pos = em.add("Add", [em.add("Reshape", [writes, _ints(em, -1, *(1,) * (rank - 1))]), pos])
    if str(node.attrs.get("mode", "linear")) == "circular":
        pos = em.add("Mod", [pos, em.add("Shape", [past], start=axis, end=axis + 1)])
    indices = em.add("Expand", [pos, em.add("Shape", [update])])
    em.add("ScatterElements", [past, indices, update], outputs=[em.outputs[0]], axis=axis)


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


DFT_AXIS_INPUT_OPSET = 20  # DFT-20: axis an optional input (default -2); DFT-17: an attribute (default 1)


def _dft_axis(node: Node) -> Optional[int]:
    """The axis of a DFT node (kiln's DFT-20): -2 when omitted, None when it is a run-time value."""
    v = node.inputs[2] if len(node.inputs) > 2 else None
    if v is None:
        return -2
    return None if v.const is None else int(np.asarray(v.const).reshape(-1)[0])


@register_expansion(ONNX_DOMAIN, "DFT", native_since=DFT_AXIS_INPUT_OPSET)
def _expand_dft(em: Emitter, node: Node) -> None:
    """kiln's DFT is DFT-20, written as itself from opset 20; opsets 18 and 19 have DFT-17, whose axis is an attribute:
    a constant axis goes there (made non-negative where the rank is known), a run-time one is refused by name
    (default_opset picks 20 for it)."""
    axis = _dft_axis(node)
    if axis is None:
        raise UnsupportedOpError(f"{node.describe()}: a DFT axis computed at run time needs ai.onnx opset "
                                 f"{DFT_AXIS_INPUT_OPSET} (DFT-20); this export writes opset {em.opset}, whose DFT-17 "
                                 f"takes the axis as an attribute")
    t = em.input_type(0)
    if axis < 0 and t is not None and t.shape is not None:
        axis += len(t.shape)
    inputs = em.inputs[:2]
    while inputs and not inputs[-1]:
        inputs.pop()
    em.add("DFT", inputs, outputs=[em.outputs[0]], axis=axis, **{k: int(v) for k, v in node.attrs.items()})


@register_expansion(ONNX_DOMAIN, "STFT")
def _expand_stft(em: Emitter, node: Node) -> None:
    """STFT as itself with ``onesided`` always written: onnx's shape inference (onnx 1.23, what onnx.checker's full
    check runs) takes an absent onesided as 0 where the schema, the reference evaluator and onnxruntime take 1."""
    inputs = list(em.inputs)
    while inputs and not inputs[-1]:
        inputs.pop()
    em.add("STFT", inputs, outputs=[em.outputs[0]], onesided=int(node.attrs.get("onesided", 1)))


# ------------------------------------------- newer forms of opset-18 ops (kiln.ir.ops.layout, reduce, tensor)


def _present(inputs: Sequence[str]) -> list:
    """The input names less trailing omitted ones."""
    inputs = list(inputs)
    while inputs and not inputs[-1]:
        inputs.pop()
    return inputs


PAD_WRAP_OPSET = 19  # the first ai.onnx opset whose Pad has mode 'wrap'


def _pad_wraps(node: Node) -> bool:
    return node.attrs.get("mode", "constant") == "wrap"


@register_expansion(ONNX_DOMAIN, "Pad", native_since=PAD_WRAP_OPSET)
def _expand_pad(em: Emitter, node: Node) -> None:
    """Before opset 19 Pad has no mode 'wrap': the other modes are written as themselves, a wrapping Pad is
    refused by name (default_opset picks 19 for it)."""
    if _pad_wraps(node):
        raise KilnError(f"{node.describe()}: Pad with mode 'wrap' needs ai.onnx opset {PAD_WRAP_OPSET} or later; "
                        f"this export writes opset {em.opset}")
    em.add("Pad", _present(em.inputs), outputs=[em.outputs[0]], mode=str(node.attrs.get("mode", "constant")))


REDUCE_BOOL_OPSET = 20  # the first ai.onnx opset whose ReduceMax/ReduceMin take bool


def _expand_reduce_extreme(em: Emitter, node: Node) -> None:
    """ReduceMax/ReduceMin of bool before opset 20 (whose versions take no bool): in uint8 and cast back, exact
    (False < True as 0 < 1; over no elements 0 and 255 cast to False and True, the identities); other types as
    themselves."""
    inputs = _present(em.inputs)
    attrs = {k: int(v) for k, v in node.attrs.items()}
    t = em.input_type(0)
    if t is None or t.dtype is not DType.BOOL:
        em.add(node.op, inputs, outputs=[em.outputs[0]], **attrs)
        return
    wide = em.add(node.op, [em.add("Cast", [inputs[0]], to=TensorProto.UINT8), *inputs[1:]], **attrs)
    em.add("Cast", [wide], outputs=[em.outputs[0]], to=TensorProto.BOOL)


register_expansion(ONNX_DOMAIN, "ReduceMax", native_since=REDUCE_BOOL_OPSET)(_expand_reduce_extreme)
register_expansion(ONNX_DOMAIN, "ReduceMin", native_since=REDUCE_BOOL_OPSET)(_expand_reduce_extreme)


@register_expansion(ONNX_DOMAIN, "SpaceToDepth")
def _expand_space_to_depth(em: Emitter, node: Node) -> None:
    """SpaceToDepth-28's ``mode`` (past the opsets kiln writes): DCR, SpaceToDepth-13's only order, as itself; CRD
    as its definition: X reshaped to [N, C, H/b, b, W/b, b], transposed to [N, C, b, b, H/b, W/b] and reshaped to
    [N, C*b*b, H/b, W/b], the dims read from Shape(X) at run time."""
    x, b = em.inputs[0], int(node.attrs["blocksize"])
    if node.attrs.get("mode", "DCR") == "DCR":
        em.add("SpaceToDepth", [x], outputs=[em.outputs[0]], blocksize=b)
        return
    shape = em.add("Shape", [x])

    def dim(i: int) -> str:
        return em.add("Slice", [shape, _ints(em, i), _ints(em, i + 1)])

    n, c = dim(0), dim(1)
    h, w = (em.add("Div", [dim(i), _ints(em, b)]) for i in (2, 3))
    blocks = em.add("Reshape", [x, em.add("Concat", [n, c, h, _ints(em, b), w, _ints(em, b)], axis=0)])
    moved = em.add("Transpose", [blocks], perm=[0, 1, 3, 5, 2, 4])
    target = em.add("Concat", [n, em.add("Mul", [c, _ints(em, b * b)]), h, w], axis=0)
    em.add("Reshape", [moved, target], outputs=[em.outputs[0]])


@register_expansion(ONNX_DOMAIN, "Range")
def _expand_range(em: Emitter, node: Node) -> None:
    """Range-27 (past the opsets kiln writes) as Range-11: other types as themselves (stash_type has no effect on
    them); float16/bfloat16, which Range-11 lacks, as Range-27 defines them: start, limit and delta cast to
    stash_type, the range computed there, the result cast back."""
    t = em.input_type(0)
    if t is None or t.dtype not in (DType.FLOAT16, DType.BFLOAT16):
        em.add("Range", em.inputs, outputs=[em.outputs[0]])
        return
    stash = int(node.attrs.get("stash_type", TensorProto.FLOAT))
    wide = em.add("Range", [em.add("Cast", [v], to=stash) for v in em.inputs])
    em.add("Cast", [wide], outputs=[em.outputs[0]], to=t.dtype.value)


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
    bfloat16 as their 16-bit patterns, the 4- and 2-bit types packed, first value in the low bits).
    A view, without a copy, for a little-endian array of a type of 8 bits or more."""
    bits = as_dtype(arr.dtype).bits
    if bits < 8:
        per = 8 // bits
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8) & np.uint8((1 << bits) - 1)
        flat = np.concatenate([flat, np.zeros(-flat.size % per, np.uint8)]).reshape(-1, per)
        packed = np.zeros(flat.shape[0], np.uint8)
        for k in range(per):
            packed |= flat[:, k] << np.uint8(k * bits)
        return memoryview(packed)
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
register_opset_rule(ONNX_DOMAIN, "Pad", lambda n: PAD_WRAP_OPSET if _pad_wraps(n) else 0)
register_opset_rule(ONNX_DOMAIN, "DFT", lambda n: DFT_AXIS_INPUT_OPSET if _dft_axis(n) is None else 0)
register_opset_rule(ONNX_DOMAIN, "GroupNormalization", lambda n: GROUP_NORM_21_OPSET)  # written as itself from 21

DEFORM_CONV_OPSET = 19  # the first ai.onnx opset with DeformConv (an export at 18 is refused: opset 18 lacks it)
BF16_DETECTION_OPSET = 22  # DeformConv-22 and RoiAlign-22 add bfloat16 (DeformConv-19, RoiAlign-16 lack it)


def _detection_opset(n: Node, since: int) -> int:
    x = n.inputs[0] if n.inputs else None
    return BF16_DETECTION_OPSET if x is not None and x.type is not None and x.type.dtype is DType.BFLOAT16 else since


register_opset_rule(ONNX_DOMAIN, "DeformConv", lambda n: _detection_opset(n, DEFORM_CONV_OPSET))
register_opset_rule(ONNX_DOMAIN, "RoiAlign", lambda n: _detection_opset(n, 0))

AFFINE_GRID_OPSET = 20  # the first ai.onnx opset with AffineGrid (an export at 18/19 is refused: they lack it)
MAX_UNPOOL_BF16_OPSET = 22  # MaxUnpool-22 adds bfloat16 (MaxUnpool-11 lacks it)
register_opset_rule(ONNX_DOMAIN, "AffineGrid", lambda n: AFFINE_GRID_OPSET)
register_opset_rule(ONNX_DOMAIN, "MaxUnpool", lambda n: MAX_UNPOOL_BF16_OPSET if n.inputs and n.inputs[0].type is not None
                    and n.inputs[0].type.dtype is DType.BFLOAT16 else 0)


@register_expansion(ONNX_DOMAIN, "MaxUnpool", native_since=MAX_UNPOOL_BF16_OPSET)
def _expand_max_unpool(em: Emitter, node: Node) -> None:
    """Before opset 22 MaxUnpool takes no bfloat16: written as itself, a bfloat16 one refused by name (default_opset
    picks 22 for it)."""
    t = em.input_type(0)
    if t is not None and t.dtype is DType.BFLOAT16:
        raise KilnError(f"{node.describe()}: MaxUnpool of bfloat16 needs ai.onnx opset {MAX_UNPOOL_BF16_OPSET}; "
                        f"this export writes opset {em.opset}")
    inputs = list(em.inputs)
    while inputs and inputs[-1] == "":
        inputs.pop()
    em.add("MaxUnpool", inputs, outputs=[em.outputs[0]], **node.attrs)


@register_expansion(ONNX_DOMAIN, "CenterCropPad")
def _expand_center_crop_pad(em: Emitter, node: Node) -> None:
    """CenterCropPad as itself, an int32 `shape` cast to int64 first (exact: it holds sizes): the op's ONNX function
    body takes Max of `shape` and Shape(input_data), an int64, so a runtime that runs the body (onnxruntime)
    rejects an int32 `shape`."""
    shape = em.inputs[1]
    t = em.input_type(1)
    if t is None or t.dtype is not DType.INT64:
        shape = em.add("Cast", [shape], to=TensorProto.INT64)
    em.add("CenterCropPad", [em.inputs[0], shape], outputs=[em.outputs[0]], **node.attrs)


QUANT_HALF_OPSET = 19     # Quantize/DequantizeLinear-19: float16/bfloat16 x and scales, int32 y_scale (13: float)
QUANT_BLOCKED_OPSET = 21  # -21: int16/uint16 data, block_size, QuantizeLinear's output_dtype


def _dtype_of(v: Optional[Value]) -> Optional[DType]:
    return None if v is None or v.type is None else v.type.dtype


def _dequantize_form(node: Node) -> tuple:
    """(opset, scale cast, output cast) of the ONNX form of a DequantizeLinear (kiln.ir.ops.quant): itself where the
    output has the scale's type; else (output_dtype is DequantizeLinear-23's, past the opsets kiln writes) the scale
    widened to float32 (exact), DequantizeLinear's float32 product (kiln's own) and a Cast to the output type."""
    x, scale, out = (_dtype_of(v) for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
    other = out is not None and scale is not None and out is not scale
    cast_scale = other and scale is not DType.FLOAT32
    cast_out = out if other and out is not DType.FLOAT32 else None
    written = DType.FLOAT32 if cast_scale else scale
    if int(node.attrs.get("block_size", 0)) or (x is not None and x.itemsize == 2):
        return QUANT_BLOCKED_OPSET, cast_scale, cast_out
    return (QUANT_HALF_OPSET if written in (DType.FLOAT16, DType.BFLOAT16) else 0), cast_scale, cast_out


def _quantize_form(node: Node) -> tuple:
    """(opset, division type to cast x and y_scale to or None, whether output_dtype is written) of the ONNX form
    of a QuantizeLinear, None where it has none: itself where x and y_scale are of types opsets 18..22 divide as
    kiln does (one type, or int32 x with a float32 scale); else (precision, and a y_scale type apart from x's, are
    QuantizeLinear-23's) both cast to kiln's division type first where QuantizeLinear-21 takes it (a float type)."""
    from kiln.ir.ops.quant import SCALE_T, division_dtype
    x, scale, out = (_dtype_of(v) for v in (node.inputs[0], node.inputs[1], node.outputs[0]))
    has_zp = len(node.inputs) > 2 and node.inputs[2] is not None
    write_dtype = not has_zp and out is not None and out is not DType.UINT8
    if x is None or scale is None:
        return 0, None, write_dtype
    div = division_dtype(x, scale, int(node.attrs.get("precision", 0)))
    if (x is scale or (x, scale) == (DType.INT32, DType.FLOAT32)) and div is division_dtype(x, scale):
        cast, written = None, {x, scale}
    elif div in SCALE_T:
        cast, written = div, {div}
    else:
        return None
    if int(node.attrs.get("block_size", 0)) or write_dtype or (out is not None and out.itemsize == 2):
        return QUANT_BLOCKED_OPSET, cast, write_dtype
    half_or_int = written & {DType.FLOAT16, DType.BFLOAT16} or (cast is None and scale is DType.INT32)
    return (QUANT_HALF_OPSET if half_or_int else 0), cast, write_dtype


def _quant_attrs(node: Node) -> dict:
    attrs = {"axis": int(node.attrs.get("axis", 1))}
    if int(node.attrs.get("block_size", 0)):
        attrs["block_size"] = int(node.attrs["block_size"])
    return attrs


def _quant_opset(em: Emitter, node: Node, need: int) -> None:
    if em.opset < need:
        x, scale = (_dtype_of(v) for v in node.inputs[:2])
        raise KilnError(f"{node.describe()}: {node.op} of {x} data with a {scale} scale, block_size "
                        f"{int(node.attrs.get('block_size', 0))} and output {_dtype_of(node.outputs[0])} needs ai.onnx "
                        f"opset {need}; this export writes opset {em.opset}")


@register_expansion(ONNX_DOMAIN, "DequantizeLinear")
def _expand_dequantize_linear(em: Emitter, node: Node) -> None:
    """DequantizeLinear as itself (at opset 19 for a half scale, 21 for int16/uint16 data or blocked scales, which
    default_opset picks; an older opset asked for is refused by name), an output_dtype other than the scale's type
    as _dequantize_form writes it."""
    need, cast_scale, cast_out = _dequantize_form(node)
    _quant_opset(em, node, need)
    scale = em.add("Cast", [em.inputs[1]], to=TensorProto.FLOAT) if cast_scale else em.inputs[1]
    inputs = [em.inputs[0], scale] + ([em.inputs[2]] if len(em.inputs) > 2 and em.inputs[2] else [])
    if cast_out is None:
        em.add("DequantizeLinear", inputs, outputs=[em.outputs[0]], **_quant_attrs(node))
    else:
        em.add("Cast", [em.add("DequantizeLinear", inputs, **_quant_attrs(node))], outputs=[em.outputs[0]],
               to=cast_out.value)


@register_expansion(ONNX_DOMAIN, "QuantizeLinear")
def _expand_quantize_linear(em: Emitter, node: Node) -> None:
    """QuantizeLinear as itself (at opset 19 for half or int32-by-int32 division, 21 for int16/uint16 outputs,
    blocked scales or output_dtype without a zero point), x and y_scale cast to the division type first as
    _quantize_form says; a division QuantizeLinear-21 cannot express (float64, or an int32 y_scale with a float x)
    is refused by name. ``saturate`` (float8 outputs only) is written where it is 0."""
    form = _quantize_form(node)
    x, scale = (_dtype_of(v) for v in node.inputs[:2])
    if form is None:
        raise KilnError(f"{node.describe()}: QuantizeLinear of {x} by a {scale} scale (precision "
                        f"{int(node.attrs.get('precision', 0))}) divides in a type ai.onnx QuantizeLinear takes from "
                        f"opset 23 on only, and kiln writes opsets {MIN_OPSET}..{MAX_OPSET}; save the model as .kiln "
                        f"(kiln.save), which keeps it")
    need, cast, write_dtype = form
    _quant_opset(em, node, need)
    inputs = list(em.inputs[:2])
    if cast is not None:
        inputs = [name if t is cast else em.add("Cast", [name], to=cast.value)
                  for name, t in zip(inputs, (x, scale))]
    if len(em.inputs) > 2 and em.inputs[2]:
        inputs.append(em.inputs[2])
    attrs = _quant_attrs(node)
    if write_dtype:
        attrs["output_dtype"] = _dtype_of(node.outputs[0]).value
    from kiln.ir.dtypes import FLOAT8_TYPES
    if not int(node.attrs.get("saturate", 1)) and _dtype_of(node.outputs[0]) in FLOAT8_TYPES:
        attrs["saturate"] = 0  # QuantizeLinear-19's; float8 makes the export opset 19 or later
    em.add("QuantizeLinear", inputs, outputs=[em.outputs[0]], **attrs)


register_opset_rule(ONNX_DOMAIN, "DequantizeLinear", lambda n: _dequantize_form(n)[0])
register_opset_rule(ONNX_DOMAIN, "QuantizeLinear", lambda n: (_quantize_form(n) or (0,))[0])


@register_expansion(ONNX_DOMAIN, "BitCast")
def _expand_bitcast(em: Emitter, node: Node) -> None:
    """BitCast is an ai.onnx op from opset 26, past the opsets kiln writes: written where an older op means the
    same (to its own type: Identity; bool to or from int8/uint8: Cast, 0/1 either way and a nonzero byte True, as
    kiln.ir.ops.bitcast reads it), refused by name otherwise."""
    src, dst = _dtype_of(node.inputs[0]), DType(int(node.attrs["to"]))
    if src is dst:
        em.add("Identity", [em.inputs[0]], outputs=[em.outputs[0]])
    elif src is not None and {src, dst} in ({DType.BOOL, DType.INT8}, {DType.BOOL, DType.UINT8}):
        em.add("Cast", [em.inputs[0]], outputs=[em.outputs[0]], to=dst.value)
    else:
        raise KilnError(f"{node.describe()}: ai.onnx BitCast exists from opset 26 on, and kiln writes ONNX opsets "
                        f"{MIN_OPSET}..{MAX_OPSET}, where no op reads {src} bits as {dst}; save the model as .kiln "
                        f"(kiln.save), which keeps it")


def default_opset(graph: Graph) -> int:
    """18, or 20 when the graph (or a body) has a Gelu, so Gelu is written as itself, or what a
    registered opset rule or a storage type (float8: 19, int4: 21) asks for."""
    opset = GELU_OPSET if any(n.op == "Gelu" and n.domain == ONNX_DOMAIN for n in graph.walk()) else MIN_OPSET
    for n in graph.walk():
        rule = _OPSET_RULES.get((n.domain, n.op))
        if rule is not None:
            opset = max(opset, rule(n))
    storage = _storage_opset(graph)
    return max(opset, storage[0]) if storage else opset


# The first ai.onnx opset whose ops take each storage type (Cast-19: float8; Cast-21: int4/uint4; Cast-23:
# float4e2m1; Cast-24: float8e8m0; Cast-25: int2/uint2).
STORAGE_TYPE_OPSET = {DType.FLOAT8E4M3FN: 19, DType.FLOAT8E4M3FNUZ: 19, DType.FLOAT8E5M2: 19,
                      DType.FLOAT8E5M2FNUZ: 19, DType.UINT4: 21, DType.INT4: 21, DType.FLOAT4E2M1: 23,
                      DType.FLOAT8E8M0: 24, DType.UINT2: 25, DType.INT2: 25}


def _storage_opset(graph: Graph) -> Optional[tuple[int, Value]]:
    """The opset the graph's storage types need, and the value needing it (None: no storage type)."""
    worst = None
    for g in graph.all_graphs():
        for v in g.values():
            need = STORAGE_TYPE_OPSET.get(v.type.dtype) if v.type is not None else None
            if need is not None and (worst is None or need > worst[0]):
                worst = (need, v)
    if worst is not None and worst[0] > MAX_OPSET:
        raise KilnError(f"value '{worst[1].name}' is {worst[1].type.dtype}, which ai.onnx has from opset {worst[0]} "
                        f"on; kiln writes opsets {MIN_OPSET}..{MAX_OPSET}: save the model as .kiln (kiln.save), "
                        f"which keeps it")
    return worst


def _check_opset(opset: int, graph: Optional[Graph] = None) -> int:
    if not isinstance(opset, (int, np.integer)) or isinstance(opset, bool):
        raise KilnError(f"opset must be an int, not {opset!r}")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise KilnError(f"kiln exports ai.onnx opsets {MIN_OPSET} to {MAX_OPSET}, not {opset}: kiln ops have "
                        f"opset-{MIN_OPSET} semantics, which older opsets cannot express")
    storage = _storage_opset(graph) if graph is not None else None
    if storage is not None and storage[0] > opset:
        raise KilnError(f"value '{storage[1].name}' is {storage[1].type.dtype}, which ai.onnx has from opset "
                        f"{storage[0]} on; export at opset {storage[0]} or later, not {opset}")
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
    opset = default_opset(graph) if opset is None else _check_opset(opset, graph)
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
    opset = default_opset(graph) if opset is None else _check_opset(opset, graph)
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
