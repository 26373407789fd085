"""Import ONNX models into kiln: ``import_onnx(path | ModelProto | bytes) -> Graph``.

An ONNX graph maps almost one to one onto kiln's IR, because kiln's ops *are* ai.onnx ops
(opset 18 semantics, Gelu from opset 20) and kiln's dtype codes are ONNX's. What this module
adds is everything around that mapping that must not go silently wrong:

Opsets. A node's meaning depends on the model's ai.onnx opset. For each node we look up, with
``onnx.defs``, the version of its op in effect at the model's opset and compare it with the
version kiln implements (the one in effect at opset 18):

- equal: same semantics, imported as is (most nodes of most models, whatever the opset);
- older (model opset < 18): the model is upgraded with ``onnx.version_converter`` first, and
  only when some node needs it (the converter is slow, and fails on some ops it need not touch);
- newer (model opset > 18): accepted only for ops in ``SAME_SEMANTICS_AS_18``, a reviewed list of
  version bumps that only added element types or an attribute whose default keeps the old
  meaning (kiln's schema then rejects the attribute if a model sets it); anything else is an
  ``UnsupportedOpError`` naming the op, node, opset and the version kiln implements.

Ops kiln lacks, other domains (com.microsoft, ai.onnx.ml), element types kiln has no dtype for
(string, float8, uint32...), non-tensor values (sequences, maps, optionals) and attributes
kiln's schema lacks all raise ``UnsupportedOpError`` naming the op, node, domain and opset.
Malformed models (undefined names, duplicate definitions, broken external data) raise
``FormatError``. Nothing is dropped or approximated.

Untrusted input (issue 16). A model file is attacker-controlled: every tensor's declared dims are
checked (>= 0, product under 2^63) and matched against the data actually present (raw bytes, typed
values, external file range) before anything is allocated; sparse tensors have their indices
range-checked and their dense size capped (``MAX_SPARSE_DENSE_BYTES``); the model must have a graph
with outputs (a 0-byte file is an empty ModelProto), opsets in range, text fields valid UTF-8 and
subgraphs no deeper than ``serializer.format.MAX_SUBGRAPH_NESTING``. Every failure is a kiln error
naming the field; serializer/onnx_attacks.py and serializer/onnx_fuzz.py keep the attacks.

Constants. ``Constant`` nodes are folded into initializers (of the graph, or subgraph, they sit
in) under their output names: kiln's shape inference reads constant inputs only from
initializers, so shape tensors given as Constants (Reshape/Slice/Unsqueeze arguments, as
``torch.onnx.export`` writes them) resolve at import time, and a .kiln file stores constants
as initializers anyway. Initializers also listed as graph inputs (IR version < 4) are constants.

External data. Locations must name a regular file inside the model's folder: absolute paths,
``..`` components and symlinks resolving outside are rejected, as are offsets/lengths that
exceed the file or disagree with the tensor's size. The data is read straight into the numpy
array (no intermediate copy into the protobuf).

Names. kiln needs value names unique across a graph and all its subgraphs, while ONNX lets
sibling subgraphs (If branches) reuse names and lets names be empty. Graph inputs, outputs and
initializers of the main graph keep their names exactly; other values keep theirs when unique
and free of whitespace, else get ``name_N``. Reads resolve through nested scopes, so a subgraph
may read values of enclosing graphs (outer-scope references) by their ONNX names.

Types. Input/output types come from the model (``dim_param`` -> symbol str, ``dim_value`` -> int,
missing -> None); everything else is inferred node by node while building, with the same
algorithm as ``kiln.ir.passes.infer_shapes`` (subgraphs first), so a Loop body input the model
leaves untyped can take the type of the value fed to it. ``value_info`` entries are hints
that kiln's inference supersedes, and are not used.

Model-local functions (as written by the dynamo exporter) are inlined with ``onnx.inliner``
before anything else.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import onnx
from google.protobuf.message import Message as _Message
from onnx import AttributeProto, TensorProto, numpy_helper

import kiln.ir.ops  # noqa: F401  (registers every op)
from kiln.errors import FormatError, KilnError, UnsupportedOpError
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Value
from kiln.ir.ops.tensor import dropout_ratio
from kiln.ir.passes.shape_inference import infer_node
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN, all_op_names, get_schema, has_op
from kiln.ir.types import TensorType
from kiln.ir.verifier import verify
from kiln.ir.versions import ONNX_OPSET_BASE
from kiln.serializer import onnx_resize
from kiln.serializer import onnx_scan
from kiln.serializer import onnx_sequences
from kiln.serializer.format import MAX_SUBGRAPH_NESTING

ModelLike = Union[str, os.PathLike, bytes, bytearray, "onnx.ModelProto"]

# Ops whose kiln implementation follows a later ai.onnx version than the base opset. (Resize-19:
# every Resize/Upsample version is translated at import, see serializer/onnx_resize.py.)
KILN_ONNX_VERSION = {"Gelu": 20, "Resize": 19, "Attention": 25, "Mod": 28, "RMSNormalization": 23,
                     "RotaryEmbedding": 23, "CumProd": 26, "BitShift": 28, "GridSample": 22, "QLinearMatMul": 21,
                     # issue 22, second round (each op module says what its version covers):
                     "LinearAttention": 27, "CausalConvWithState": 27, "TensorScatter": 24, "SwiGLU": 28, "Swish": 24,
                     "AffineGrid": 20, "BitCast": 26}
KILN_ONNX_VERSION["DFT"] = 20  # axis as an optional input (kiln.ir.ops.signal); DFT-17 is rewritten at import
# Older versions of such ops that kiln's implementation covers as they are (no upgrade through the version
# converter, which knows nothing past opset 18's ops): Attention-23/24 are Attention-25 without its new
# optional input and attributes (kiln.ir.ops.attention); Mod-10/13 are Mod-28 restricted to fmod=0 for integers
# and fmod=1 for floats (28 defines both for both); BitShift-11 is BitShift-28 on unsigned types only;
# GridSample-16 is 20's 4-D form with the modes spelled bilinear/bicubic (kiln takes both spellings), 22 adds types;
# QLinearMatMul-21 adds half scales and float8 (which kiln lacks) to 10.
IMPORTED_AS_IS = {"Attention": (23, 24), "Mod": (10, 13), "BitShift": (11,), "GridSample": (16, 20),
                  "QLinearMatMul": (10,)}
# DFT-17 is DFT-20 with `axis` an attribute (default 1) instead of an optional input (default -2), same range and
# semantics otherwise: _dft_axis_as_input moves the attribute (or 1) into a constant axis input.
IMPORTED_AS_IS["DFT"] = (17,)
# GroupNormalization-21 (kiln.ir.ops.normalization) takes scale and bias per channel; 18 took them per group and
# computed in X's type: _group_norm_18_as_21 repeats them per channel and sets stash_type to X's type.
KILN_ONNX_VERSION["GroupNormalization"] = 21
IMPORTED_AS_IS["GroupNormalization"] = (18,)
# QuantizeLinear/DequantizeLinear (kiln.ir.ops.quant) are version 28 over kiln's dtypes; each older version is 28
# with fewer types, or attributes whose defaults keep its meaning (checked against the onnx 1.23 schemas and
# reference evaluator): 13 added `axis` (10's scalar scale is per-tensor under any axis); 19 float16/bfloat16 x and
# scales, float8 and `saturate` (float8 only); 21 int16/uint16, int4/uint4, `block_size` (0: not blocked) and
# QuantizeLinear's `output_dtype` (0: the zero point's type); 23 DequantizeLinear's `output_dtype` (0: the scale's
# type) and QuantizeLinear's `precision` (0: the division in x's and y_scale's type, which were one type before),
# a y_scale type apart from x's and float4e2m1; 24 float8e8m0 scales; 25 int2/uint2; 28 float6. The types kiln
# lacks (float6) are refused by element type, output_dtype/precision naming one by _refuse_unsupported_modes.
KILN_ONNX_VERSION["QuantizeLinear"] = KILN_ONNX_VERSION["DequantizeLinear"] = 28
IMPORTED_AS_IS["QuantizeLinear"] = IMPORTED_AS_IS["DequantizeLinear"] = (10, 13, 19, 21, 23, 24, 25)
# Deprecated ai.onnx ops imported as the op that replaced them: Scatter-9/11 is ScatterElements (Scatter-11's
# documentation says so; same inputs, types and `axis`), i.e. ScatterElements-18 with reduction 'none'.
IMPORTED_AS = {"Scatter": "ScatterElements"}

# Ops whose versions after opset 18 keep opset-18 semantics for everything kiln can express,
# with the newest version checked (a later version is rejected until reviewed). Reviewed
# against the onnx 1.23 schemas (type constraints, attributes, docs):
SAME_SEMANTICS_AS_18 = {
    # 19 adds `dilations` (MaxPool had it; kiln's AveragePool has it too); 22 adds bfloat16 and
    # spells out the ceil_mode rule kiln already follows (no window starts in the end padding).
    "AveragePool": 22, "MaxPool": 22,
    # 19 adds float8 types and `saturate` (float8 only; kiln has the attribute); 21/23/24/25/28
    # add int4/float4/float8e8m0/int2/float6 types; 24 adds `round_mode` (float8e8m0 only).
    "Cast": 28,
    # CastLike follows Cast: 19 adds float8 types and `saturate` (kiln has the attribute), 21/23/24/25 types.
    "CastLike": 25,
    # New element types only (int4/uint4, float4, float8e8m0, int2/uint2...).
    "Constant": 25, "ConstantOfShape": 25, "Flatten": 25, "Identity": 25, "If": 25, "Loop": 25,
    "Reshape": 25, "Shape": 25, "Size": 25, "Squeeze": 25, "Transpose": 25, "Unsqueeze": 25,
    # 19 adds mode 'wrap' (kiln.ir.ops.layout implements it), later versions types only.
    "Pad": 25,
    # 19: string inputs. 20: float8 inputs. 20: bool inputs (False < True; kiln's ReduceMax/Min take them).
    "Equal": 19, "IsInf": 20, "IsNaN": 20, "ReduceMax": 20, "ReduceMin": 20,
    # 22: bfloat16 added.
    "Conv": 22, "ConvTranspose": 22, "Cos": 22, "Sin": 22, "Dropout": 22, "Elu": 22,
    "GlobalAveragePool": 22, "GlobalMaxPool": 22, "HardSigmoid": 22, "HardSwish": 22,
    "InstanceNormalization": 22, "Mish": 22, "Selu": 22, "Softplus": 22, "Softsign": 22,
    # 24/28: bfloat16 added; DepthToSpace-28's schema is identical to 13's.
    "TopK": 24, "Einsum": 28, "DepthToSpace": 28,
    # 28 adds `mode` whose default (DCR) is 13's behaviour; kiln's SpaceToDepth has it (DCR and CRD).
    "SpaceToDepth": 28,
    # Element types only (bfloat16; float16/double for Celu), reviewed against onnx 1.23's schemas: same
    # attributes and documentation.
    "Acos": 22, "Acosh": 22, "Asin": 22, "Asinh": 22, "Atan": 22, "Atanh": 22, "Cosh": 22, "Sinh": 22, "Tan": 22,
    "Round": 22, "EyeLike": 22, "LpNormalization": 22, "ThresholdedRelu": 22, "LpPool": 22,
    "NegativeLogLikelihoodLoss": 22, "OneHot": 28, "Compress": 28, "Celu": 28,
    # 22: bfloat16 added (LSTM/GRU/RNN-14 otherwise).
    "LSTM": 22, "GRU": 22, "RNN": 22,
    # 28: same attributes, types and documentation (a revised function body).
    "ReduceLogSumExp": 28, "ReduceLogSum": 28,
}
# bfloat16 added, nothing else (attributes, inputs, outputs and documentation identical in onnx 1.23's schemas):
# Unique-28 (11), ReverseSequence-28 (10), Det-22 (11).
SAME_SEMANTICS_AS_18.update({"Unique": 28, "ReverseSequence": 28, "Det": 22})
# RoiAlign-22 adds bfloat16 to 16, nothing else (same attributes, defaults, inputs and documentation in onnx 1.23);
# RoiAlign-10 (no coordinate_transformation_mode: output_half_pixel) is upgraded by onnx.version_converter, which
# sets that mode (kiln.ir.ops.detection).
SAME_SEMANTICS_AS_18["RoiAlign"] = 22
# DeformConv (kiln.ir.ops.detection) implements 22; 19 is 22 without bfloat16 (same attributes, defaults, inputs
# and documentation in onnx 1.23), imported as it is.
KILN_ONNX_VERSION["DeformConv"] = 22
IMPORTED_AS_IS["DeformConv"] = (19,)
# MaxUnpool (kiln.ir.ops.image) implements 11, the version in effect at opset 18. 22 adds bfloat16, nothing else
# (same attributes, inputs and documentation in onnx 1.23); 9 differs from 11 only in that 11 documents strides'
# default of 1, which kiln uses (onnx's version converter upgrades 10 -> 11 with a CompatibleAdapter).
SAME_SEMANTICS_AS_18["MaxUnpool"] = 22
IMPORTED_AS_IS["MaxUnpool"] = (9,)
# Range (kiln.ir.ops.tensor) implements 27, which adds float16/bfloat16 and `stash_type` (the type those two are
# computed in; no effect on the others): Range-11 (same inputs) is 27 on its types, imported as it is.
KILN_ONNX_VERSION["Range"] = 27
IMPORTED_AS_IS["Range"] = (11,)
# Scan is built as a Loop (serializer/onnx_scan.py, from the version in effect at opset 18, 16); 19/21/23/24/25 add
# element types only (float8, int4, float4, float8e8m0, int2: same attributes, inputs and documentation in onnx
# 1.23). Scan-8 (batch axis, sequence_lens) is refused by onnx_scan.check_version.
SAME_SEMANTICS_AS_18["Scan"] = 25
# GlobalLpPool-22 (2 otherwise) and MaxRoiPool-22 (1 otherwise) add bfloat16, nothing else: same attributes,
# defaults, inputs and documentation in onnx 1.23 (kiln.ir.ops.pool).
SAME_SEMANTICS_AS_18.update({"GlobalLpPool": 22, "MaxRoiPool": 22})

_DEFAULT_DOMAINS = ("", "ai.onnx")
_MAX_OPSET_VERSION = 1000  # far past any released opset; keeps onnx.defs lookups in C int range
_KILN_DTYPES = {d.value: d for d in DType}


def import_onnx(model: ModelLike, *, base_dir: Optional[Union[str, os.PathLike]] = None,
                check: bool = True) -> Graph:
    """Import an ONNX model (a path, an ``onnx.ModelProto`` or serialized bytes) as a kiln Graph.

    ``base_dir`` is the folder external tensor data is read from (default: the model file's
    folder; required for a proto/bytes model with external data). The graph's types are
    inferred while it is built; ``check`` also runs ``kiln.ir.verify`` on the result.
    Raises ``UnsupportedOpError`` for anything kiln cannot represent exactly and
    ``FormatError`` for a malformed model.
    """
    proto, base = _load(model, base_dir)
    _check_model(proto)
    if len(proto.functions):
        try:
            from onnx import inliner
            proto = inliner.inline_local_functions(proto)
        except Exception as e:  # noqa: BLE001 - the inliner raises plain C++ errors
            raise UnsupportedOpError(f"could not inline the model's local functions: {e}") from e
    opset = _default_opset(proto)
    if _check_ops(proto.graph, opset, _opset_imports(proto)) and opset is not None:
        proto = _convert(proto, opset)
        opset = ONNX_OPSET_BASE
        _check_ops(proto.graph, opset, _opset_imports(proto))
    graph = _Importer(proto, base, opset).run()
    if check:
        verify(graph)
    return graph


# --------------------------------------------------------------------------- loading


def _load(model: ModelLike, base_dir) -> tuple["onnx.ModelProto", Optional[Path]]:
    base = None if base_dir is None else Path(base_dir)
    if isinstance(model, onnx.ModelProto):
        return model, base
    if isinstance(model, (bytes, bytearray, memoryview)):
        if not len(model):
            raise FormatError("not an ONNX model: 0 bytes")
        proto = onnx.ModelProto()
        try:
            proto.ParseFromString(bytes(model))
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise FormatError(f"not a valid ONNX model ({len(model)} bytes): {e}") from e
        return proto, base
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.is_file():
            raise FormatError(f"ONNX model file '{path}' does not exist")
        if path.stat().st_size == 0:
            raise FormatError(f"'{path}' is empty (0 bytes), not an ONNX model")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # noqa: BLE001
            raise FormatError(f"'{path}' is not a valid ONNX model: {e}") from e
        return proto, base if base is not None else path.parent
    raise TypeError(f"import_onnx takes a path, an onnx.ModelProto or bytes, not {type(model).__name__}")


def _check_model(proto) -> None:
    """What the whole model must have before any node is looked at: a graph with outputs (an empty
    protobuf parses as a valid, empty ModelProto, which would otherwise convert to an empty model),
    sane opset versions, and subgraphs nested no deeper than a .kiln file can hold."""
    if not proto.HasField("graph"):
        raise FormatError("the ONNX model has no graph (an empty or truncated file?)")
    if not len(proto.graph.output):
        raise FormatError(f"the ONNX model's graph '{proto.graph.name}' has no outputs: there is nothing to compute")
    for o in proto.opset_import:
        if not 1 <= o.version <= _MAX_OPSET_VERSION:
            raise FormatError(f"opset_import of domain '{o.domain or 'ai.onnx'}' has version {o.version}, "
                              f"not in [1, {_MAX_OPSET_VERSION}]")
    _check_nesting(proto.graph)
    _check_strings(proto)


def _check_strings(proto) -> None:
    """Every string field must be text: protobuf parses an ONNX (proto2) string that is not valid
    UTF-8 as ``bytes``, which would otherwise surface as a TypeError wherever the name is used."""
    from google.protobuf.descriptor import FieldDescriptor

    string, message = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE
    stack = [(proto, "model")]
    while stack:
        msg, where = stack.pop()
        if isinstance(msg, TensorProto):
            # Not ListFields: that would copy raw_data, the bulk of a model; a tensor's text is here.
            fields = [(TensorProto.DESCRIPTOR.fields_by_name[f], getattr(msg, f)) for f in ("name", "doc_string")]
            stack.extend((m, f"{where}.{f}") for f in ("external_data", "metadata_props") for m in getattr(msg, f))
        else:
            fields = msg.ListFields()
        for fd, value in fields:
            if fd.type == string:
                for item in ([value] if isinstance(value, (str, bytes)) else value):
                    if not isinstance(item, str):
                        raise FormatError(f"{where}.{fd.name} is not valid UTF-8 text: {bytes(item)[:60]!r}")
            elif fd.type == message:
                if isinstance(value, _Message):
                    stack.append((value, f"{where}.{fd.name}"))
                else:
                    stack.extend((m, f"{where}.{fd.name}[{k}]") for k, m in enumerate(value))


def _check_nesting(graph) -> None:
    """Refuse subgraphs nested deeper than MAX_SUBGRAPH_NESTING (the level a .kiln file holds), walking
    iteratively: the importer recurses per level and must not meet a RecursionError first."""
    stack = [(graph, 0, ())]
    while stack:
        g, depth, chain = stack.pop()
        for n in g.node:
            for a in n.attribute:
                for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    here = chain + (f"{_node_label(n, '')} ({n.op_type}).{a.name}",)
                    if depth + 1 > MAX_SUBGRAPH_NESTING:
                        raise FormatError(
                            f"subgraphs nested {depth + 1} levels deep (at {' > '.join(here[-3:])}); kiln "
                            f"imports at most {MAX_SUBGRAPH_NESTING} levels of nested If/Loop bodies")
                    stack.append((sub, depth + 1, here))


def _opset_imports(proto) -> dict:
    return {("" if o.domain in _DEFAULT_DOMAINS else o.domain): o.version for o in proto.opset_import}


def _default_opset(proto) -> Optional[int]:
    """The model's ai.onnx opset (None when it imports none: then only other domains may appear,
    which kiln rejects op by op)."""
    return _opset_imports(proto).get("")


def _convert(proto, opset: int):
    from onnx import version_converter
    proto = onnx_resize.hide_from_converter(proto, opset)
    try:
        return version_converter.convert_version(proto, ONNX_OPSET_BASE)
    except Exception as e:  # noqa: BLE001 - the converter raises plain C++ errors
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedOpError(
            f"the model uses ai.onnx opset {opset}; kiln implements opset {ONNX_OPSET_BASE} and "
            f"onnx.version_converter could not upgrade it: {msg}") from e


# --------------------------------------------------------------------------- opset checks


@functools.lru_cache(maxsize=None)
def _onnx_since(op: str, opset: int) -> Optional[int]:
    """The since_version of ai.onnx ``op`` in effect at ``opset`` (None: not defined there)."""
    try:
        return onnx.defs.get_schema(op, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def _kiln_since(op: str) -> Optional[int]:
    return KILN_ONNX_VERSION.get(op) or _onnx_since(op, ONNX_OPSET_BASE)


def _node_label(n, where: str) -> str:
    """How errors name an ONNX node: by name, else by its first output."""
    if n.name:
        name = f"node '{n.name}'"
    else:
        first = next((o for o in n.output if o), "")
        name = f"the unnamed node writing '{first}'" if first else "an unnamed node"
    return f"{name}{where}"


def _check_ops(g, opset: Optional[int], imports: dict, where: str = "") -> bool:
    """Raise UnsupportedOpError for the first node kiln cannot import at ``opset``; return
    whether some node needs the model upgraded to opset 18 first."""
    needs_upgrade = False
    for n in g.node:
        domain = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        label = _node_label(n, where)
        if onnx_resize.handles(n, domain):
            continue  # every version is translated when the node is built
        if domain != "":
            if domain == KILN_DOMAIN and has_op(n.op_type, KILN_DOMAIN):
                continue
            raise UnsupportedOpError(
                f"op '{n.op_type}' of domain '{domain}' (opset {imports.get(domain, '?')}) in {label} is not "
                f"supported: kiln implements ai.onnx ops only")
        if opset is None:
            raise FormatError(f"{label} uses ai.onnx op '{n.op_type}', but the model imports no ai.onnx opset")
        if n.op_type in IMPORTED_AS:
            if _onnx_since(n.op_type, opset) is None:
                raise UnsupportedOpError(f"op '{n.op_type}' in {label} is not defined in ai.onnx opset {opset}")
            continue  # built as IMPORTED_AS[op] by _Importer._node, every version alike
        if domain == "" and (n.op_type in onnx_sequences.SEQUENCE_OPS or n.op_type in onnx_sequences.OPTIONAL_OPS):
            continue  # lowered to tensors when static (serializer/onnx_sequences.py), else refused by name there
        if onnx_scan.handles(n, domain):
            onnx_scan.check_version(n, opset, label)  # Scan-8 refused; 9+ is built as a Loop, its body checked below
        elif not has_op(n.op_type, ONNX_DOMAIN):
            raise UnsupportedOpError(
                f"op '{n.op_type}' (domain ai.onnx, opset {opset}) in {label} is not supported by kiln "
                f"(`kiln info --ops` lists the {len(all_op_names())} ops kiln has)")
        theirs, ours = _onnx_since(n.op_type, opset), _kiln_since(n.op_type)
        if theirs is None:
            raise UnsupportedOpError(
                f"op '{n.op_type}' in {label} is not defined in ai.onnx opset {opset} "
                f"(kiln implements {n.op_type}-{ours})")
        if theirs < ours and theirs not in IMPORTED_AS_IS.get(n.op_type, ()):
            needs_upgrade = True
        elif theirs > ours and not _same_semantics(n, theirs, label):
            raise UnsupportedOpError(
                f"op '{n.op_type}' (domain ai.onnx) in {label}: the model's opset {opset} means "
                f"{n.op_type}-{theirs}, whose semantics differ from {n.op_type}-{ours} that kiln implements "
                f"(kiln follows ai.onnx opset {ONNX_OPSET_BASE}, Gelu opset 20)")
        for a in n.attribute:
            for sub in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                inner = f" in subgraph '{a.name}' of {label}"
                needs_upgrade |= _check_ops(sub, opset, imports, inner)
    return needs_upgrade


def _dft_axis_as_input(imp: "_Importer", kg: Graph, n, inputs: list, label: str) -> tuple:
    """A DFT-17 node (opsets 17..19) as kiln's DFT-20: its `axis` attribute (DFT-17's default 1 when absent; DFT-20's
    default is -2) becomes a constant int64 `axis` input, inputs and other attributes unchanged."""
    axis = 1
    for a in n.attribute:
        if a.name != "axis":
            continue
        if a.ref_attr_name:
            raise UnsupportedOpError(f"{label} (DFT): attribute 'axis' refers to function attribute "
                                     f"'{a.ref_attr_name}'; kiln imports only concrete attribute values")
        if a.type != AttributeProto.INT:
            raise FormatError(f"{label} (DFT-17): attribute 'axis' must be an int")
        axis = int(a.i)
    if len(inputs) > 2:
        raise FormatError(f"{label} (DFT-17) has {len(inputs)} inputs; DFT-17 takes input and dft_length")
    node = onnx.NodeProto()
    node.CopyFrom(n)
    del node.attribute[:]
    node.attribute.extend(a for a in n.attribute if a.name != "axis")
    value = kg.add_initializer(imp._pick("", f"{n.name or 'dft'}_axis"), np.array(axis, np.int64))
    return node, (inputs + [None])[:2] + [value]


def _group_norm_18_as_21(imp: "_Importer", kg: Graph, n, inputs: list, attrs: dict, label: str) -> tuple:
    """A GroupNormalization-18 node (opsets 18..20) as kiln's GroupNormalization-21: 18's scale and bias hold one
    value per group, 21's one per channel, so each is repeated over its group's channels (a constant here, a
    computed one by a Gather of constant indices); 18's function body computes in X's type, so stash_type is X's
    type. Needs X's channel count."""
    what = f"{label} (GroupNormalization-18)"
    groups = attrs.get("num_groups")
    if len(inputs) != 3 or any(v is None for v in inputs) or not isinstance(groups, int) or groups < 1:
        raise FormatError(f"{what} needs inputs X, scale, bias and num_groups >= 1")
    x = inputs[0]
    shape = x.type.shape if x.type is not None else None
    channels = shape[1] if shape is not None and len(shape) >= 2 else None
    if not isinstance(channels, int):
        raise UnsupportedOpError(f"{what}: X's channel count (dim 1) is not known at import; kiln imports 18's "
                                 f"per-group scale and bias as 21's per-channel ones, which needs it")
    if channels % groups:
        raise FormatError(f"{what}: num_groups {groups} does not divide X's {channels} channels")
    index = np.arange(channels, dtype=np.int64) // (channels // groups)
    hint = n.name or "group_norm"
    per_channel = []
    for v, name in zip(inputs[1:], ("scale", "bias")):
        s = v.type.shape if v.type is not None else None
        if s is not None and (len(s) != 1 or s[0] not in (groups, None) and not isinstance(s[0], str)):
            raise FormatError(f"{what}: {name} must hold one value per group, [{groups}], got {list(s)}")
        if v.const is not None:
            if np.shape(v.const) != (groups,):
                raise FormatError(f"{what}: {name} must hold one value per group, [{groups}], got "
                                  f"{list(np.shape(v.const))}")
            per_channel.append(kg.add_initializer(imp._pick("", f"{hint}_{name}"), np.asarray(v.const)[index]))
            continue
        idx = kg.add_initializer(imp._pick("", f"{hint}_{name}_channels"), index)
        gather = kg.add_node("Gather", [v, idx], {"axis": 0}, output_names=[imp._pick("", f"{hint}_{name}")])
        infer_node(gather, imp.symbols)
        per_channel.append(gather.outputs[0])
    return [x, *per_channel], {**attrs, "stash_type": x.type.dtype.value}


def _refuse_unsupported_modes(n, inputs: list, attrs: dict, out_names: list, label: str) -> None:
    """Uses of an op kiln registers that its inference-only kernels do not implement: refused
    by name here rather than failing later in shape inference or at run time (a refusal, not
    a wrong graph)."""
    if n.op_type == "Dropout" and len(inputs) > 2 and inputs[2] is not None and inputs[2].const is not None:
        # A constant True: exact only with a ratio known to be 0 (the identity). A computed training_mode (or
        # ratio) is checked when the run meets it: kiln's Dropout refuses True with a ratio other than 0.
        ratio_v = inputs[1] if len(inputs) > 1 else None
        ratio = dropout_ratio(None if ratio_v is None else ratio_v.const)
        if bool(np.asarray(inputs[2].const).reshape(-1)[0]) and (ratio_v is None or ratio_v.const is not None) \
                and ratio != 0:
            raise UnsupportedOpError(f"{label} (Dropout): training_mode is True with ratio {ratio}; kiln runs inference "
                                     f"only (training mode is exact only with ratio 0, where it is the identity)")
    for name in _DTYPE_ATTRS.get(n.op_type, ()):
        code = attrs.get(name)
        if code and code not in _KILN_DTYPES:
            kind = TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else str(code)
            raise UnsupportedOpError(f"{label} ({n.op_type}): {name}={kind} is an element type kiln does not support "
                                     f"({', '.join(d.short for d in DType)})")


# Attributes naming an element type (a TensorProto.DataType code; 0: unset) of ops whose inputs do not show it.
_DTYPE_ATTRS = {"BitCast": ("to",), "QuantizeLinear": ("output_dtype", "precision"),
                "DequantizeLinear": ("output_dtype",)}


def _same_semantics(n, since: int, label: str) -> bool:
    newest = SAME_SEMANTICS_AS_18.get(n.op_type)
    if newest is None or since > newest:
        return False
    return True


# --------------------------------------------------------------------------- tensors and types


def _dtype(code: int, what: str) -> DType:
    dt = _KILN_DTYPES.get(code)
    if dt is None:
        name = TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else str(code)
        supported = ", ".join(d.short for d in DType)
        raise UnsupportedOpError(f"{what} has element type {name}, which kiln does not support ({supported})")
    return dt


def _type(tp, what: str) -> Optional[TensorType]:
    """A kiln TensorType from an ONNX TypeProto (None when the model gives no type)."""
    kind = tp.WhichOneof("value")
    if kind is None:
        return None
    if kind != "tensor_type":
        raise UnsupportedOpError(f"{what} is of ONNX type {kind.replace('_type', '')}; kiln supports tensors only")
    tt = tp.tensor_type
    if tt.elem_type == TensorProto.UNDEFINED:
        return None
    dt = _dtype(tt.elem_type, what)
    if not tt.HasField("shape"):
        return TensorType(dt, None)
    dims = []
    for d in tt.shape.dim:
        which = d.WhichOneof("value")
        if which == "dim_value" and d.dim_value >= 0:
            dims.append(int(d.dim_value))
        elif which == "dim_param" and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return TensorType(dt, dims)


def _inside(base: Path, location: str, what: str) -> Path:
    """The file ``location`` names, checked to lie inside ``base`` (no absolute paths, no '..',
    no symlink leading out)."""
    if any(ord(c) < 32 or c == "\x7f" for c in location):
        raise FormatError(f"{what}: external data location {location!r} holds a control character (a NUL "
                          f"byte would cut the path short)")
    if len(location.encode("utf-8", "surrogatepass")) > 4096:
        raise FormatError(f"{what}: external data location is {len(location)} characters long")
    if (not location or os.path.isabs(location) or location.startswith(("/", "\\"))
            or re.match(r"^[A-Za-z]:", location)):
        raise FormatError(f"{what}: external data location '{location}' must be a relative path "
                          f"inside the model's folder")
    if ".." in re.split(r"[\\/]", location):
        raise FormatError(f"{what}: external data location '{location}' leaves the model's folder ('..')")
    root = os.path.realpath(base)
    full = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, full]) != root:
        raise FormatError(f"{what}: external data location '{location}' resolves to '{full}', "
                          f"outside the model's folder '{root}' (a symlink?)")
    if not os.path.isfile(full):
        raise FormatError(f"{what}: external data file '{location}' does not exist in '{root}'")
    return Path(full)


# The most bytes a sparse tensor may expand to when made dense (kiln stores constants dense). A
# sparse tensor's declared dims are not backed by data, so without a cap a few bytes of protobuf
# could ask for any amount of memory.
MAX_SPARSE_DENSE_BYTES = 1 << 30
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _dims(dims, what: str) -> tuple[tuple[int, ...], int]:
    """A tensor's declared dims, each >= 0, and their product (a Python int: no overflow)."""
    out = tuple(int(d) for d in dims)
    for k, d in enumerate(out):
        if d < 0:
            raise FormatError(f"{what}: dims[{k}] is {d} (dims {list(out)}); a tensor's dims must be >= 0")
    count = span = 1
    for d in out:
        count *= d
        span *= max(d, 1)
    if span >= 1 << 63:
        raise FormatError(f"{what}: dims {list(out)} are too large for any array (their product passes 2^63)")
    return out, count


def _file_bytes(dt: DType, count: int) -> int:
    """Bytes ``count`` values of ``dt`` take in an ONNX file: the 4- and 2-bit types are packed, two or four to
    a byte, the first value in the low bits."""
    return -(-count * dt.bits // 8)


def _unpack(raw: np.ndarray, dt: DType, count: int) -> np.ndarray:
    """ONNX's packed 4- or 2-bit values (``raw``, uint8) as one ml_dtypes element per byte: each value's bits
    in the low bits of its byte, which is how ml_dtypes holds int4/uint4/int2/uint2/float4e2m1."""
    bits = dt.bits
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((raw.size, per), np.uint8)
    for k in range(per):
        out[:, k] = (raw >> np.uint8(k * bits)) & mask
    return out.reshape(-1)[:count].view(dt.numpy)


class _Tensors:
    """Reads TensorProtos (inline or external) into numpy arrays of kiln dtypes. Every size comes from
    the data actually present: declared dims are checked against it before anything is allocated."""

    def __init__(self, base: Optional[Path]):
        self.base = base

    def array(self, t, what: str) -> np.ndarray:
        dt = _dtype(t.data_type, what)
        if t.HasField("segment"):
            raise UnsupportedOpError(f"{what} is a segmented tensor, which kiln does not read")
        dims, count = _dims(t.dims, what)
        if t.data_location == TensorProto.EXTERNAL:
            return self._external(t, dt, dims, count, what)
        if t.data_location != TensorProto.DEFAULT:
            raise FormatError(f"{what}: unknown data_location {t.data_location}")
        if t.HasField("raw_data"):
            have, need = len(t.raw_data), _file_bytes(dt, count)
            if have != need:
                raise FormatError(f"{what}: raw_data holds {have} bytes, a {dt} tensor of dims {list(dims)} "
                                  f"needs {need}")
            if dt.bits < 8:
                return _unpack(np.frombuffer(t.raw_data, np.uint8), dt, count).reshape(dims)
        else:
            field = onnx.helper.tensor_dtype_to_field(t.data_type)
            have = len(getattr(t, field))
            for other in _TYPED_FIELDS:
                if other != field and len(getattr(t, other)):
                    raise FormatError(f"{what}: a {dt} tensor keeps its values in {field}, but {other} is set")
            need = -(-count * dt.bits // 8) if dt.bits < 8 else count  # sub-byte values are packed there too
            if have != need:
                raise FormatError(f"{what}: {field} holds {have} values, a {dt} tensor of dims {list(dims)} "
                                  f"needs {need}")
        try:
            arr = numpy_helper.to_array(t)
        except Exception as e:  # noqa: BLE001
            raise FormatError(f"{what}: cannot decode its data: {e}") from e
        if arr.dtype != dt.numpy:
            arr = arr.astype(dt.numpy)
        return arr

    def _external(self, t, dt: DType, dims: tuple, count: int, what: str) -> np.ndarray:
        info = {e.key: e.value for e in t.external_data}
        if "location" not in info:
            raise FormatError(f"{what}: external data without a 'location' entry")
        location = info["location"]
        if self.base is None:
            raise FormatError(f"{what} keeps its data in external file {location!r}; pass base_dir= "
                              f"(the folder holding it) to import a model given as a proto or bytes")
        path = _inside(self.base, location, what)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise FormatError(f"{what}: cannot read external data file {location!r}: {e.strerror or e}") from e
        try:
            offset = int(info.get("offset", "0"))
            length = int(info["length"]) if "length" in info else size - offset
        except ValueError as e:
            raise FormatError(f"{what}: external data offset/length must be integers (offset "
                              f"{info.get('offset')!r}, length {info.get('length')!r})") from e
        want = _file_bytes(dt, count)
        if offset < 0 or length < 0 or offset + length > size:
            raise FormatError(f"{what}: external data [{offset}, {offset + length}) lies outside "
                              f"{location!r} ({size} bytes)")
        if length != want:
            raise FormatError(f"{what}: external data holds {length} bytes, a {dt} tensor of dims "
                              f"{list(dims)} needs {want}")
        packed = dt.bits < 8
        try:
            arr = np.fromfile(path, dtype=np.uint8 if packed else dt.numpy, count=want if packed else count,
                              offset=offset)
        except OSError as e:
            raise FormatError(f"{what}: cannot read external data file {location!r}: {e.strerror or e}") from e
        if arr.size != (want if packed else count):
            raise FormatError(f"{what}: external data file {location!r} changed while it was read")
        if packed:
            return _unpack(arr, dt, count).reshape(dims)
        if sys.byteorder == "big" and dt.itemsize > 1:
            arr = arr.byteswap()
        return arr.reshape(dims)

    def sparse(self, s, what: str) -> np.ndarray:
        """A dense array from a SparseTensorProto (values at linear or per-dim indices), every index
        and the dense size checked first."""
        dims, count = _dims(s.dims, what)
        values = self.array(s.values, f"{what}: values")
        dt = _dtype(s.values.data_type, what)
        if count * dt.itemsize > MAX_SPARSE_DENSE_BYTES:
            raise FormatError(f"{what}: dims {list(dims)} make a dense {dt} tensor of {count * dt.itemsize:,} "
                              f"bytes, over the {MAX_SPARSE_DENSE_BYTES:,} bytes kiln expands a sparse tensor to")
        if values.ndim != 1:
            raise FormatError(f"{what}: values must be 1-D [NNZ], got dims {list(values.shape)}")
        nnz = values.shape[0]
        if not s.HasField("indices"):
            if nnz:
                raise FormatError(f"{what}: {nnz} values but no indices")
            return np.zeros(dims, dtype=values.dtype)
        indices = self.array(s.indices, f"{what}: indices")
        if indices.dtype != np.int64:
            raise FormatError(f"{what}: indices must be int64, got {indices.dtype}")
        if indices.ndim == 1 and indices.shape[0] == nnz:
            if nnz and (indices.min() < 0 or indices.max() >= count):
                raise FormatError(f"{what}: a linear index lies outside [0, {count}) (dims {list(dims)})")
            flat = indices
        elif indices.ndim == 2 and indices.shape == (nnz, len(dims)):
            if nnz and ((indices < 0).any() or (indices >= np.asarray(dims, np.int64)).any()):
                raise FormatError(f"{what}: an index lies outside dims {list(dims)}")
            flat = np.ravel_multi_index(tuple(indices.T), dims) if nnz else indices.reshape(-1)
        else:
            raise FormatError(f"{what}: indices of dims {list(indices.shape)} do not fit {nnz} values of a "
                              f"rank-{len(dims)} tensor (want [{nnz}] or [{nnz}, {len(dims)}])")
        out = np.zeros(dims, dtype=values.dtype)
        if nnz:
            out.reshape(-1)[flat] = values
        return out


# --------------------------------------------------------------------------- building


class _Scope:
    """ONNX name -> kiln Value for one graph, falling back to the enclosing graphs."""

    def __init__(self, parent: Optional["_Scope"] = None):
        self.parent = parent
        self.names: dict[str, Value] = {}

    def lookup(self, name: str) -> Optional[Value]:
        s: Optional[_Scope] = self
        while s is not None:
            v = s.names.get(name)
            if v is not None:
                return v
            s = s.parent
        return None

    def define(self, name: str, v: Value, what: str) -> None:
        if name in self.names:
            raise FormatError(f"{what}: value '{name}' is defined twice in the same graph")
        self.names[name] = v


class _Importer:
    def __init__(self, proto, base: Optional[Path], opset: Optional[int]):
        self.proto = proto
        self.opset = opset
        self.tensors = _Tensors(base)
        self.symbols: dict = {}  # shape inference's symbolic shape values, shared over the graph
        self.used: set[str] = set()  # every value name given out
        g = proto.graph
        init_names = {t.name for t in g.initializer} | {s.values.name for s in g.sparse_initializer}
        # Names only the main graph's own inputs, initializers and outputs may take.
        self.outputs = {vi.name for vi in g.output}
        self.reserved = init_names | {vi.name for vi in g.input} | self.outputs

    def run(self) -> Graph:
        g = self.proto.graph
        root = Graph(g.name or "main")
        md = root.metadata
        md.doc_string = self.proto.doc_string
        md.props = {p.key: p.value for p in self.proto.metadata_props}
        producer = f"{self.proto.producer_name} {self.proto.producer_version}".strip()
        if producer:
            md.props.setdefault("onnx.producer", producer)
        if self.opset is not None:
            md.props.setdefault("onnx.opset", str(self.opset))
        self._fill(root, g, _Scope(), "", root_level=True)
        return root

    # ---- names
    def fresh_onnx_name(self, hint: str) -> str:
        """An ONNX value name no model value has, for nodes the importer builds itself (sequence lowering)."""
        self._fresh = getattr(self, "_fresh", 0) + 1
        return f"__kiln_{hint}_{self._fresh}"

    def _pick(self, name: str, hint: str, exact: bool = False) -> str:
        """A graph-unique kiln name for ONNX ``name``: itself when possible (always for ``exact``
        names: the main graph's interface and initializers), else ``base_N``."""
        if exact:
            if name in self.used:
                raise FormatError(f"value name '{name}' is defined more than once in the model")
            self.used.add(name)
            return name
        if name and name not in self.used and name not in self.reserved and not re.search(r"\s", name):
            self.used.add(name)
            return name
        base = re.sub(r"\s+", "_", name or hint) or "v"
        base = re.sub(r"_\d+$", "", base) or base
        i = 1
        while f"{base}_{i}" in self.used or f"{base}_{i}" in self.reserved:
            i += 1
        self.used.add(f"{base}_{i}")
        return f"{base}_{i}"

    # ---- graphs
    def _fill(self, kg: Graph, g, scope: _Scope, where: str, root_level: bool = False,
              input_types: Optional[list] = None) -> None:
        """Build ONNX graph ``g`` into the empty kiln graph ``kg``."""
        what_g = f"graph '{g.name}'{where}" if g.name else f"the graph{where}"
        for t in g.initializer:
            arr = self.tensors.array(t, f"initializer '{t.name}'{where}")
            v = kg.add_initializer(self._pick(t.name, "init", exact=root_level), arr)
            scope.define(t.name, v, what_g)
        for s in g.sparse_initializer:
            name = s.values.name
            arr = self.tensors.sparse(s, f"sparse initializer '{name}'{where}")
            v = kg.add_initializer(self._pick(name, "init", exact=root_level), arr)
            scope.define(name, v, what_g)
        inputs = [vi for vi in g.input if vi.name not in scope.names]  # IR < 4: initializers listed too
        for i, vi in enumerate(inputs):
            what = f"input '{vi.name}' of {what_g}"
            t = _type(vi.type, what)
            if t is None and input_types is not None and i < len(input_types):
                t = input_types[i]
            if t is None:
                raise FormatError(f"{what} has no type")
            v = kg.add_input(self._pick(vi.name, "input", exact=root_level), t.dtype, t.shape)
            scope.define(vi.name, v, what_g)
        declared = {}
        for vi in g.output:
            t = _type(vi.type, f"output '{vi.name}' of {what_g}")
            if t is not None:
                declared[vi.name] = t
        for n in g.node:
            self._node(kg, n, scope, declared, where)
        onnx_sequences.check_outputs(g, scope, what_g)
        outs = []
        for vi in g.output:
            v = scope.lookup(vi.name)
            if v is None:
                raise FormatError(f"output '{vi.name}' of {what_g} is not defined by any node, input or initializer")
            outs.append(v)
        kg.outputs = outs

    def _subgraph(self, kg: Graph, g, attr: str, scope: _Scope, label: str,
                  input_types: Optional[list]) -> Graph:
        sub = kg.subgraph(g.name or attr)
        self._fill(sub, g, _Scope(scope), f" in subgraph '{attr}' of {label}", input_types=input_types)
        return sub

    # ---- nodes
    def _node(self, kg: Graph, n, scope: _Scope, declared: dict, where: str) -> None:
        label = _node_label(n, where)
        domain = "" if n.domain in _DEFAULT_DOMAINS else n.domain
        inputs: list[Optional[Value]] = []
        for name in n.input:
            if not name:
                inputs.append(None)
                continue
            v = scope.lookup(name)
            if v is None:
                raise FormatError(f"{label} ({n.op_type}) reads '{name}', which is not defined before it "
                                  f"(ONNX graphs list nodes in topological order)")
            inputs.append(v)
        while inputs and inputs[-1] is None:
            inputs.pop()
        if n.op_type == "Constant" and domain == "":
            self._constant(kg, n, scope, label, declared)
            return
        if onnx_sequences.handles(n, domain, inputs):
            onnx_sequences.build(self, kg, n, inputs, scope, where, label)  # a list at import, tensors in the graph
            return
        onnx_sequences.check_inputs(n, inputs, label)
        if onnx_scan.handles(n, domain):
            onnx_scan.build(self, kg, n, scope, declared, where, label)  # as a Loop
            return
        if n.op_type == "DFT" and domain == "" and _onnx_since("DFT", self.opset) == 17:
            n, inputs = _dft_axis_as_input(self, kg, n, inputs, label)
        op_type = n.op_type
        if onnx_resize.handles(n, domain):
            op_type, domain = "Resize", ""
            inputs, attrs = onnx_resize.translate(self, kg, n, inputs, "" if n.domain in _DEFAULT_DOMAINS else n.domain,
                                                  label)
            schema = get_schema(op_type, domain)
            for i, v in enumerate(inputs):
                self._check_input_type(n, schema, i, v, label)
        else:
            if domain == "" and op_type in IMPORTED_AS:
                op_type = IMPORTED_AS[op_type]
            schema = get_schema(op_type, domain)
            for i, v in enumerate(inputs):
                self._check_input_type(n, schema, i, v, label)
            attrs: dict[str, Any] = {}
            for a in n.attribute:
                attrs[a.name] = self._attr(kg, n, a, schema, scope, label, inputs)
        out_names = list(n.output)
        while len(out_names) > 1 and not out_names[-1]:
            out_names.pop()  # trailing unused optional outputs
        _refuse_unsupported_modes(n, inputs, attrs, out_names, label)
        if op_type == "GroupNormalization" and domain == "" and _onnx_since(op_type, self.opset) == 18:
            inputs, attrs = _group_norm_18_as_21(self, kg, n, inputs, attrs, label)
        hint = n.name or n.op_type.lower()
        top = kg.parent is None
        names = [self._pick(o, f"{hint}_unused" if not o else hint, exact=top and o in self.outputs)
                 for o in out_names]
        types = [declared.get(o) if o else None for o in out_names]
        try:
            node = kg.add_node(op_type, inputs, attrs, domain=domain, name=n.name or None,
                               output_names=names, output_types=types)
        except KilnError as e:
            raise FormatError(f"{label} ({n.op_type}): {e}") from e
        for o, v in zip(out_names, node.outputs):
            if o:
                scope.define(o, v, label)
        infer_node(node, self.symbols)

    def _attr(self, kg: Graph, n, a, schema, scope: _Scope, label: str, inputs: list) -> Any:
        op = n.op_type
        if a.ref_attr_name:
            raise UnsupportedOpError(f"{label} ({op}): attribute '{a.name}' refers to function attribute "
                                     f"'{a.ref_attr_name}'; kiln imports only concrete attribute values")
        spec = schema.attrs.get(a.name)
        if spec is None:
            known = ", ".join(sorted(schema.attrs)) or "none"
            raise UnsupportedOpError(f"{label} ({op}, opset {self.opset}): attribute '{a.name}' is not supported "
                                     f"by kiln's {op} (its attributes: {known})")
        what = f"attribute '{a.name}' of {label} ({op})"
        t = a.type
        if t == AttributeProto.GRAPH:
            body_types = self._loop_body_types(inputs) if op == "Loop" else None
            return self._subgraph(kg, a.g, a.name, scope, label, body_types)
        if t == AttributeProto.TENSOR:
            return self.tensors.array(a.t, what)
        if t == AttributeProto.SPARSE_TENSOR:
            return self.tensors.sparse(a.sparse_tensor, what)
        if t == AttributeProto.FLOAT:
            return float(a.f)
        if t == AttributeProto.INT:
            return int(a.i)
        if t == AttributeProto.STRING:
            return a.s.decode("utf-8", errors="replace")
        if t == AttributeProto.FLOATS:
            return [float(x) for x in a.floats]
        if t == AttributeProto.INTS:
            return [int(x) for x in a.ints]
        if t == AttributeProto.STRINGS:
            return [s.decode("utf-8", errors="replace") for s in a.strings]
        kind = AttributeProto.AttributeType.Name(t) if t in AttributeProto.AttributeType.values() else str(t)
        raise UnsupportedOpError(f"{what} is of kind {kind}; kiln's {op} wants {spec.kind.value}")

    def _check_input_type(self, n, schema, i: int, v: Optional[Value], label: str) -> None:
        """An input dtype kiln's op does not accept is a missing feature, not a broken model."""
        if v is None or v.type is None:
            return
        try:
            param = schema.input_param(i)
        except IndexError:
            return  # too many inputs: verify reports it
        if v.type.dtype not in param.types:
            allowed = ", ".join(sorted(t.short for t in param.types))
            raise UnsupportedOpError(f"{label} ({n.op_type}, opset {self.opset}): input {i} ('{param.name}') is "
                                     f"{v.type.dtype}, which kiln's {n.op_type} does not accept ({allowed})")

    @staticmethod
    def _loop_body_types(inputs: list) -> list:
        """Fallback types of a Loop body's inputs: iteration number, condition, then each carried
        value with its initial dtype (shape unknown: it may change from one iteration to the next)."""
        carried = [None if v is None or v.type is None else TensorType(v.type.dtype, None) for v in inputs[2:]]
        return [TensorType(DType.INT64, ()), TensorType(DType.BOOL, ()), *carried]

    def _constant(self, kg: Graph, n, scope: _Scope, label: str, declared: dict) -> None:
        """Fold a Constant node into an initializer named after its output."""
        given = []
        for a in n.attribute:
            what = f"attribute '{a.name}' of {label} (Constant)"
            if a.ref_attr_name:
                raise UnsupportedOpError(f"{what} refers to function attribute '{a.ref_attr_name}'")
            if a.name == "value":
                given.append(self.tensors.array(a.t, what))
            elif a.name == "sparse_value":
                given.append(self.tensors.sparse(a.sparse_tensor, what))
            elif a.name == "value_float":
                given.append(np.array(a.f, np.float32))
            elif a.name == "value_floats":
                given.append(np.array(list(a.floats), np.float32))
            elif a.name == "value_int":
                given.append(np.array(a.i, np.int64))
            elif a.name == "value_ints":
                given.append(np.array(list(a.ints), np.int64))
            elif a.name in ("value_string", "value_strings"):
                raise UnsupportedOpError(f"{label} (Constant) holds strings; kiln has no string tensors")
            else:
                raise FormatError(f"{label} (Constant) has an unknown attribute '{a.name}'")
        if len(given) != 1 or len(n.output) != 1 or not n.output[0]:
            raise FormatError(f"{label} (Constant) must have exactly one value attribute and one output")
        name = n.output[0]
        arr = given[0]
        want = declared.get(name)
        if want is not None and not want.matches(arr):
            raise FormatError(f"{label} (Constant): output '{name}' is declared {want} but holds "
                              f"{TensorType.of(arr)}")
        v = kg.add_initializer(self._pick(name, "const", exact=kg.parent is None and name in self.outputs), arr)
        scope.define(name, v, label)
