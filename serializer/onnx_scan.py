"""ONNX Scan imported as kiln's Loop (an exact rewrite at import; kiln has no Scan op).

Scan-9 and later (9, 11 allowing negative axes, 16 to 25 adding element types) run a body once per
element of the scan inputs along their axes, carrying state values from one iteration to the next and
stacking each iteration's scan output elements. A Loop does the same given the trip count and a body
that slices its own elements, so a Scan node ``N`` states, ``M`` scan inputs and ``K`` scan outputs
becomes, in the graph the Scan sat in:

- ``T = Gather(Shape(scan_input_0), scan_input_axes[0])``: the trip count (ONNX requires every scan
  input to have this length along its axis; lengths known at import are checked), and ``T - 1`` when an
  input is scanned backwards;
- ``Loop(T, "", *initial_states)`` whose body takes ``(i, cond, *states)`` and starts with one
  ``Gather(scan_input_j, i or T - 1 - i, axis=scan_input_axes[j])`` per scan input (the element, its
  axis removed, named as the Scan body's input), then the Scan body's own nodes; it returns ``cond``
  unchanged, the states and the scan output elements. The Loop stacks those on a new axis 0 in
  iteration order;
- per scan output, a reversal along axis 0 (``Slice`` with step -1) for ``scan_output_directions`` 1
  (prepending) and a ``Transpose`` moving axis 0 to ``scan_output_axes[k]`` when that is not 0 (its rank
  must then be known at import).

The body keeps reading outer values by name (Loop bodies do too); the names the rewrite adds are fresh
over the whole model, and a scan input whose name the body redefines is read through an ``Identity``.
Everything here is built as ONNX nodes of kiln's opset-18 forms and handed to the importer's usual node
path, so types, names and checks are the importer's own.

Scan-8 (a batch axis on every input, the optional ``sequence_lens`` and ``directions``) is refused by
name before ``onnx.version_converter`` would see it: its Scan 8->9 adapter drops the batch axis from the
model's inputs, which changes the model's interface.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from kiln.errors import FormatError, UnsupportedOpError
from kiln.ir.registry import ONNX_DOMAIN

SCAN_LOOP_SINCE = 9  # Scan-9: the form without a batch axis, the one written as a Loop
_ATTRS = ("body", "num_scan_inputs", "scan_input_axes", "scan_input_directions", "scan_output_axes",
          "scan_output_directions")
_INT64_MIN = int(np.iinfo(np.int64).min)


def handles(n, domain: str) -> bool:
    """Whether ``n`` is an ai.onnx Scan (imported by :func:`build` as a Loop, not as a kiln op)."""
    return domain == ONNX_DOMAIN and n.op_type == "Scan"


def check_version(n, opset: int, label: str) -> None:
    """Refuse Scan-8 by name (and a Scan the opset does not define); Scan-9 and later are built as a Loop."""
    try:
        since = onnx.defs.get_schema("Scan", max_inclusive_version=opset, domain="").since_version
    except onnx.defs.SchemaError:
        raise UnsupportedOpError(f"op 'Scan' in {label} is not defined in ai.onnx opset {opset}") from None
    if since < SCAN_LOOP_SINCE:
        raise UnsupportedOpError(
            f"{label} (Scan-{since}, opset {opset}): Scan-8's batch axis, sequence_lens and directions are not "
            f"supported; kiln imports Scan-{SCAN_LOOP_SINCE} and later (as a Loop)")


# --------------------------------------------------------------------------- names


def _graph_names(g, out: set) -> None:
    for vi in (*g.input, *g.output, *g.value_info):
        out.add(vi.name)
    out.update(t.name for t in g.initializer)
    out.update(s.values.name for s in g.sparse_initializer)
    for node in g.node:
        out.update(node.input)
        out.update(node.output)
        for a in node.attribute:
            for sub in ([a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)):
                _graph_names(sub, out)


class _Names:
    """Value names unused anywhere in the model (and by earlier rewrites)."""

    def __init__(self, proto):
        self.taken: set = set()
        _graph_names(proto.graph, self.taken)

    def fresh(self, hint: str) -> str:
        hint = hint or "scan"
        name, k = hint, 0
        while name in self.taken:
            k += 1
            name = f"{hint}_{k}"
        self.taken.add(name)
        return name


def _names(importer) -> _Names:
    names = getattr(importer, "_scan_names", None)
    if names is None:
        names = importer._scan_names = _Names(importer.proto)
    return names


# --------------------------------------------------------------------------- attributes


def _attrs(n, label: str) -> dict:
    out = {}
    for a in n.attribute:
        if a.ref_attr_name:
            raise UnsupportedOpError(f"{label} (Scan): attribute '{a.name}' refers to function attribute "
                                     f"'{a.ref_attr_name}'; kiln imports only concrete attribute values")
        if a.name not in _ATTRS:
            raise UnsupportedOpError(f"{label} (Scan): attribute '{a.name}' is not part of Scan-9 and later "
                                     f"(its attributes: {', '.join(_ATTRS)})")
        want = AttributeProto.GRAPH if a.name == "body" else \
            AttributeProto.INT if a.name == "num_scan_inputs" else AttributeProto.INTS
        if a.type != want:
            raise FormatError(f"{label} (Scan): attribute '{a.name}' is of kind "
                              f"{AttributeProto.AttributeType.Name(a.type)}, not "
                              f"{AttributeProto.AttributeType.Name(want)}")
        out[a.name] = a.g if a.name == "body" else helper.get_attribute_value(a)
    for required in ("body", "num_scan_inputs"):
        if required not in out:
            raise FormatError(f"{label} (Scan) has no '{required}' attribute")
    return out


def _per_value(attrs: dict, name: str, count: int, label: str, directions: bool = False) -> list:
    values = [int(v) for v in attrs.get(name, [0] * count)]
    if len(values) != count:
        raise FormatError(f"{label} (Scan): {name} has {len(values)} entries, the node has {count} such values")
    if directions and any(v not in (0, 1) for v in values):
        raise FormatError(f"{label} (Scan): {name} {values} must hold 0 (forward) or 1 (reverse) only")
    return values


def _rank(v) -> Optional[int]:
    return None if v is None or v.type is None or v.type.shape is None else len(v.type.shape)


def _axis(axis: int, rank: Optional[int], what: str, label: str) -> int:
    """``axis`` checked against ``rank`` (when known) and made non-negative where it can be."""
    if rank is None:
        return axis
    if not -rank <= axis < rank:
        raise FormatError(f"{label} (Scan): {what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


# --------------------------------------------------------------------------- the rewrite


def build(importer, kg, n, scope, declared: dict, where: str, label: str) -> None:
    """Build Scan node ``n`` into kiln graph ``kg`` as the Loop of the module docstring, defining the Scan's
    output names in ``scope``."""
    attrs = _attrs(n, label)
    body = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    inputs = list(n.input)
    n_state = len(inputs) - m
    if m < 1 or n_state < 0:
        raise FormatError(f"{label} (Scan): num_scan_inputs is {m}, the node has {len(inputs)} inputs "
                          f"(states, then at least one scan input)")
    if any(not name for name in inputs):
        raise FormatError(f"{label} (Scan): an input is left empty; Scan's states and scan inputs are all required")
    init_names = {t.name for t in body.initializer} | {s.values.name for s in body.sparse_initializer}
    body_inputs = [vi for vi in body.input if vi.name not in init_names]
    if len(body_inputs) != n_state + m:
        raise FormatError(f"{label} (Scan): the body takes {len(body_inputs)} inputs; the node gives {n_state} "
                          f"states and {m} scan inputs")
    n_out = len(body.output) - n_state
    outputs = list(n.output)
    if n_out < 0 or len(outputs) > n_state + n_out:
        raise FormatError(f"{label} (Scan): the body returns {len(body.output)} values, the node has {n_state} "
                          f"states and {len(outputs)} outputs")
    outputs += [""] * (n_state + n_out - len(outputs))
    in_axes = _per_value(attrs, "scan_input_axes", m, label)
    in_dirs = _per_value(attrs, "scan_input_directions", m, label, directions=True)
    out_axes = _per_value(attrs, "scan_output_axes", n_out, label)
    out_dirs = _per_value(attrs, "scan_output_directions", n_out, label, directions=True)

    names = _names(importer)
    stem = n.name or next((o for o in outputs if o), "scan")
    node_names = iter(range(1, 1 << 30))

    def add(op_type: str, ins: list, outs: Optional[list] = None, **node_attrs) -> list:
        """Build one ONNX node in kg through the importer; returns its output names."""
        outs = outs if outs is not None else [names.fresh(f"{stem}_{op_type.lower()}")]
        proto = helper.make_node(op_type, ins, outs, name=f"{n.name}/{op_type}_{next(node_names)}" if n.name else "",
                                 **node_attrs)
        importer._node(kg, proto, scope, declared, where)
        return outs

    def const(value: np.ndarray) -> str:
        return add("Constant", [], value=numpy_helper.from_array(value))[0]

    # The scan inputs: axes checked where ranks are known, lengths compared where known, and a name the body
    # redefines read through an Identity (the body's Gather reads the outer value by name).
    scan_values = [scope.lookup(name) for name in inputs[n_state:]]
    axes = [_axis(a, _rank(v), f"scan_input_axes[{j}]", label) for j, (a, v) in enumerate(zip(in_axes, scan_values))]
    lengths = {v.type.shape[a] for v, a in zip(scan_values, axes)
               if _rank(v) is not None and a >= 0 and isinstance(v.type.shape[a], int)}
    if len(lengths) > 1:
        raise FormatError(f"{label} (Scan): the scan inputs have lengths {sorted(lengths)} along their scan axes; "
                          f"they must all have one length")
    defined = {vi.name for vi in body.input} | init_names | {o for node in body.node for o in node.output}
    outer = [add("Identity", [name])[0] if name in defined else name for name in inputs[n_state:]]

    trips = add("Gather", [add("Shape", [outer[0]])[0], const(np.array(axes[0], np.int64))], axis=0)[0]
    last = add("Sub", [trips, const(np.array(1, np.int64))])[0] if any(in_dirs) else None

    # The Loop body: (i, cond, *states) -> (cond, *states, *scan output elements).
    i_name, cond_name = names.fresh(f"{stem}_i"), names.fresh(f"{stem}_cond")
    nodes = []
    back = None
    if last is not None:
        back = names.fresh(f"{stem}_i_reversed")
        nodes.append(helper.make_node("Sub", [last, i_name], [back]))
    for j, (name, vi) in enumerate(zip(outer, body_inputs[n_state:])):
        nodes.append(helper.make_node("Gather", [name, back if in_dirs[j] else i_name], [vi.name], axis=axes[j]))
    nodes.extend(body.node)
    loop_body = helper.make_graph(
        nodes, body.name or f"{stem}_body",
        [helper.make_tensor_value_info(i_name, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond_name, TensorProto.BOOL, []), *body_inputs[:n_state]],
        [helper.make_tensor_value_info(cond_name, TensorProto.BOOL, []), *body.output],
        initializer=list(body.initializer), value_info=list(body.value_info),
        sparse_initializer=list(body.sparse_initializer))

    # The Loop writes the final states and the stacked scan outputs under the Scan's names, except where a
    # reversal or transpose follows (or the output is unused): there under fresh names.
    def direct(k: int) -> bool:
        return bool(outputs[n_state + k]) and not out_dirs[k] and out_axes[k] == 0

    loop_outs = [o or names.fresh(f"{stem}_unused") for o in outputs[:n_state]]
    loop_outs += [outputs[n_state + k] if direct(k) else names.fresh(f"{stem}_stacked") for k in range(n_out)]
    loop = helper.make_node("Loop", [trips, "", *inputs[:n_state]], loop_outs, name=n.name, body=loop_body)
    importer._node(kg, loop, scope, declared, where)

    for k in range(n_out):
        final = outputs[n_state + k]
        if direct(k) or not final:
            continue
        v = loop_outs[n_state + k]
        rank = _rank(scope.lookup(v))
        axis = _axis(out_axes[k], rank, f"scan_output_axes[{k}]", label)
        if axis < 0 or (axis > 0 and rank is None):
            raise UnsupportedOpError(f"{label} (Scan): scan output {k} goes to axis {out_axes[k]}, and its rank is "
                                     f"not known at import (kiln writes the axis move as a Transpose)")
        if out_dirs[k]:  # prepended each iteration: the stack reversed
            v = add("Slice", [v, const(np.array([-1], np.int64)), const(np.array([_INT64_MIN], np.int64)),
                              const(np.array([0], np.int64)), const(np.array([-1], np.int64))],
                    outs=[final] if axis == 0 else None)[0]
        if axis:
            perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
            add("Transpose", [v], outs=[final], perm=perm)
