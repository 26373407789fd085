"""Resize and Upsample across ONNX versions, in both directions.

kiln's Resize means ONNX Resize-19 (opset 19+), a superset of every earlier form, so import
translates each version exactly instead of asking ``onnx.version_converter`` (whose Resize 10->11
adapter drops Resize-10's asymmetric coordinates: the converted model would answer differently):

============  =====================================================================================
Upsample-7    scales attribute; nearest/linear with asymmetric coordinates, nearest rounding down
Upsample-9/10 the same with a scales input
Resize-10     the same (ONNX's own Resize 10->11 conversion now says so); a nearest downsample is
              refused: onnxruntime rounds it up there, the ONNX converter down, so its meaning is
              not settled
Resize-11     roi, scales, sizes; ``tf_half_pixel_for_nn`` (x = (y + 0.5) / scale) becomes
              half_pixel with the rounding rule shifted by half a pixel (floor -> round_prefer_ceil,
              round_prefer_floor -> ceil); other rules under it, and linear/cubic, are refused
Resize-13/18  as they are (their attributes are Resize-19's; 18's half_pixel_symmetric is 19's)
Resize-19     as it is
============  =====================================================================================

Empty ``roi``/``scales`` constants ("not given" in Resize-11/13 files) are dropped. When the rest
of the model needs ``version_converter``, Resize/Upsample nodes wait in a private domain while it
runs (``hide_from_converter``), so it never touches them, and are translated from the version they
had.

Export: kiln's Resize is written as itself. Opsets 18 has Resize-18, which lacks only
``half_pixel_symmetric``: a graph using it exports at opset 19 by default, and asking for 18 is
refused by name.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import numpy as np
import onnx
from onnx import AttributeProto, helper

from kiln.errors import FormatError, UnsupportedOpError
from kiln.ir.registry import ONNX_DOMAIN

LEGACY_DOMAIN = "kiln.onnx_resize"   # where Resize/Upsample wait while version_converter runs
VERSION_ATTR = "kiln_onnx_version"
TRANSLATED = ("Resize", "Upsample")
SYMMETRIC_OPSET = 19                 # the first opset whose Resize has half_pixel_symmetric

_R11 = {"coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside", "extrapolation_value", "mode",
        "nearest_mode"}
_ATTRS = {("Upsample", 7): {"mode", "scales"}, ("Upsample", 9): {"mode"}, ("Upsample", 10): {"mode"},
          ("Resize", 10): {"mode"}, ("Resize", 11): _R11, ("Resize", 13): _R11,
          ("Resize", 18): _R11 | {"antialias", "axes", "keep_aspect_ratio_policy"},
          ("Resize", 19): _R11 | {"antialias", "axes", "keep_aspect_ratio_policy"}}
_COORDS_13 = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize")


def handles(n, domain: str) -> bool:
    """Whether ``n`` is imported by :func:`translate` (any version) rather than as a kiln op."""
    return (domain == ONNX_DOMAIN and n.op_type in TRANSLATED) or domain == LEGACY_DOMAIN


def _since(op: str, opset: Optional[int]) -> Optional[int]:
    if opset is None:
        return None
    try:
        return onnx.defs.get_schema(op, max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        return None


def _graphs(g):
    yield g
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                yield from _graphs(sub)


def hide_from_converter(proto, opset: int):
    """A copy of ``proto`` whose Resize/Upsample nodes sit in LEGACY_DOMAIN, each recording the
    op version it had, so ``version_converter`` leaves them alone (the original is unchanged)."""
    if not any(n.op_type in TRANSLATED and n.domain in ("", "ai.onnx") for g in _graphs(proto.graph) for n in g.node):
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for g in _graphs(copy.graph):
        for n in g.node:
            if n.op_type in TRANSLATED and n.domain in ("", "ai.onnx"):
                version = _since(n.op_type, opset)
                if version is None:
                    raise UnsupportedOpError(f"op '{n.op_type}' is not defined in ai.onnx opset {opset}")
                n.domain = LEGACY_DOMAIN
                n.attribute.append(helper.make_attribute(VERSION_ATTR, version))
    copy.opset_import.append(helper.make_opsetid(LEGACY_DOMAIN, 1))
    return copy


def _attrs(n, op: str, version: int, label: str) -> dict:
    allowed = _ATTRS[(op, version)]
    out = {}
    for a in n.attribute:
        if a.name == VERSION_ATTR:
            continue
        if a.ref_attr_name:
            raise UnsupportedOpError(f"{label} ({op}): attribute '{a.name}' refers to function attribute "
                                     f"'{a.ref_attr_name}'; kiln imports only concrete attribute values")
        if a.name not in allowed:
            raise UnsupportedOpError(f"{label} ({op}-{version}): attribute '{a.name}' is not part of "
                                     f"{op}-{version} (its attributes: {', '.join(sorted(allowed))})")
        value = helper.get_attribute_value(a)
        out[a.name] = value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value
    return out


def _absent_if_empty(v):
    """A constant empty tensor is ONNX's way of omitting an input."""
    return None if v is not None and v.const is not None and v.const.size == 0 else v


def _legacy_mode(mode: str, label: str, what: str) -> dict:
    if mode == "nearest":
        return {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}
    if mode in ("linear", "bilinear"):
        return {"mode": "linear", "coordinate_transformation_mode": "asymmetric"}
    raise UnsupportedOpError(f"{label} ({what}): mode '{mode}' is not one of nearest, linear")


def translate(importer, kg, n, inputs: list, domain: str, label: str) -> tuple:
    """(inputs, attrs) of the kiln Resize that means what ONNX node ``n`` means."""
    op = n.op_type
    if domain == LEGACY_DOMAIN:
        version = next((a.i for a in n.attribute if a.name == VERSION_ATTR), None)
        if version is None:
            raise FormatError(f"{label}: op '{op}' of domain '{LEGACY_DOMAIN}' is kiln's own import marker")
    else:
        version = _since(op, importer.opset)
        if version is None:
            raise UnsupportedOpError(f"op '{op}' in {label} is not defined in ai.onnx opset {importer.opset}")
    if (op, version) not in _ATTRS:
        raise UnsupportedOpError(f"{label}: {op}-{version} is not supported (kiln imports Upsample-7/9/10 and "
                                 "Resize-10/11/13/18/19)")
    what = f"{op}-{version}"
    attrs = _attrs(n, op, version, label)
    inputs = list(inputs) + [None] * 4
    x = inputs[0]
    if x is None:
        raise FormatError(f"{label} ({what}) has no input X")
    if op == "Upsample" or version == 10:
        scales = inputs[1]
        if op == "Upsample" and version == 7:
            if "scales" not in attrs:
                raise FormatError(f"{label} ({what}) has no scales attribute")
            arr = np.array(attrs.pop("scales"), np.float32)
            scales = kg.add_initializer(importer._pick(f"{n.name or 'upsample'}_scales", "scales"), arr)
        if scales is None:
            raise FormatError(f"{label} ({what}) has no scales")
        mode = attrs.get("mode", "nearest")
        new = _legacy_mode(mode, label, what)
        if op == "Resize" and mode == "nearest":
            s = scales.const
            if s is None or np.any(np.asarray(s) < 1):
                why = "a computed scale" if s is None else f"scales {np.asarray(s).tolist()}"
                raise UnsupportedOpError(
                    f"{label} ({what}): nearest with {why} may downsample, where the opset-10 rounding is not "
                    "settled (onnxruntime rounds up, ONNX's converter down); convert the model to opset >= 11")
        return [x, None, scales], new
    roi, scales, sizes = (_absent_if_empty(v) for v in inputs[1:4])
    coord = attrs.get("coordinate_transformation_mode", "half_pixel")
    if version < 19 and coord not in _COORDS_13 + (("tf_half_pixel_for_nn",) if version == 11 else ()):
        raise UnsupportedOpError(f"{label} ({what}): coordinate_transformation_mode '{coord}' is not part of "
                                 f"{what} (half_pixel_symmetric arrived in Resize-19)")
    if coord == "tf_half_pixel_for_nn":
        rule = attrs.get("nearest_mode", "round_prefer_floor")
        shifted = {"floor": "round_prefer_ceil", "round_prefer_floor": "ceil"}
        if attrs.get("mode", "nearest") != "nearest" or rule not in shifted:
            raise UnsupportedOpError(
                f"{label} ({what}): coordinate_transformation_mode 'tf_half_pixel_for_nn' with mode "
                f"'{attrs.get('mode', 'nearest')}', nearest_mode '{rule}' has no Resize-19 form (kiln takes it with "
                "nearest and nearest_mode floor or round_prefer_floor)")
        attrs["coordinate_transformation_mode"] = "half_pixel"
        attrs["nearest_mode"] = shifted[rule]
    if scales is not None and attrs.get("coordinate_transformation_mode") in _OUTPUT_WIDTH_MODES:
        _warn_fractional_width(x, scales, attrs, label, what)
    out = [x, roi, scales, sizes]
    while out[-1] is None:
        out.pop()
    return out, attrs


# Coordinate modes whose formula reads the output length: ONNX (its reference and its node tests)
# takes the fractional scale * length there, onnxruntime and torch the rounded output size.
_OUTPUT_WIDTH_MODES = ("align_corners", "pytorch_half_pixel", "tf_crop_and_resize")


def _warn_fractional_width(x, scales, attrs: dict, label: str, what: str) -> None:
    """Warn where kiln's (ONNX's) answer may differ from onnxruntime's: a length-reading mode with
    scales that do not give a whole output length (or input sizes not known here)."""
    dims = None if x.type is None or x.type.shape is None else x.type.shape
    s = None if scales.const is None else np.asarray(scales.const, np.float32).reshape(-1)
    axes = attrs.get("axes")
    if dims is not None and s is not None:
        picked = [dims[a] for a in axes] if axes is not None else list(dims)
        if len(picked) == len(s) and all(isinstance(d, int) and float(v) * d == int(float(v) * d)
                                         for d, v in zip(picked, s)):
            return
    warnings.warn(f"{label} ({what}): coordinate_transformation_mode '{attrs['coordinate_transformation_mode']}' "
                  "with scales that may not give a whole output length: kiln follows ONNX (its reference and "
                  "node tests use the fractional length scale * size), onnxruntime and torch the rounded output "
                  "size, so answers can differ; a model exported with sizes instead of scales has one meaning",
                  UserWarning, stacklevel=4)


# --------------------------------------------------------------------------- export


def opset_needed(node) -> int:
    """The oldest ai.onnx opset that writes this Resize as itself."""
    return SYMMETRIC_OPSET if node.attrs.get("coordinate_transformation_mode") == "half_pixel_symmetric" else 0


def register_export() -> None:
    from kiln.serializer.onnx import register_expansion, register_opset_rule

    register_opset_rule(ONNX_DOMAIN, "Resize", opset_needed)

    @register_expansion(ONNX_DOMAIN, "Resize", native_since=SYMMETRIC_OPSET)
    def _resize_18(em, node) -> None:
        """Below opset 19 Resize is Resize-18: the same node, unless it needs half_pixel_symmetric."""
        if opset_needed(node) > em.opset:
            raise UnsupportedOpError(f"{node.describe()}: coordinate_transformation_mode 'half_pixel_symmetric' "
                                     f"needs ai.onnx opset {SYMMETRIC_OPSET} (Resize-19); export with "
                                     f"opset={SYMMETRIC_OPSET} or later, not {em.opset}")
        attrs: dict[str, Any] = {k: v for k, v in node.attrs.items() if v is not None}
        inputs = list(em.inputs)
        while inputs and inputs[-1] == "":
            inputs.pop()
        em.add("Resize", inputs, outputs=em.outputs, **attrs)
