"""ONNX sequences whose length and elements are known at import, lowered to tensors (issue 22).

kiln's IR has tensors only: a value of sequence type has no dtype, shape or .kiln encoding, and no kernel takes
one. What exporters write, though, is mostly *static* sequences: ``torch.onnx.export`` turns a Python list built
by a loop of fixed length (torchvision's MViT pools q/k/v that way) into ``SequenceEmpty``, a ``Loop`` with a
constant trip count whose body ``SequenceInsert``s a slice, and ``SequenceAt`` with constant positions. Such a
sequence is a Python list of tensors the importer can track, exactly, while it builds the graph:

- ``SequenceEmpty``/``SequenceConstruct``/``SequenceInsert``/``SequenceErase`` (constant positions) and
  ``Identity`` edit the list;
- ``SequenceAt`` (constant position) is its element, ``SequenceLength`` a constant;
- ``ConcatFromSequence`` is a ``Concat`` (``new_axis``: of ``Unsqueeze``d elements);
- ``SplitToSequence`` is a ``Split`` (sizes from the ``split`` input, or pieces of one along a dim known at import,
  squeezed unless ``keepdims``);
- a ``Loop`` that carries a sequence, with a constant trip count and a condition that stays constant True, is
  unrolled: its body is built once per iteration, in the graph the Loop sat in.

Optional values likewise (``Optional``, ``OptionalHasElement``, ``OptionalGetElement``): inside a graph whether an
optional holds a value is known at import, so ``OptionalHasElement`` is a constant and ``OptionalGetElement`` the
value itself (an empty one is refused by name).

The tensors this makes are ONNX nodes handed to the importer's usual node path (types, names and checks are the
importer's own). Everything else refuses by name: a sequence at a graph's interface (kiln's IR cannot type it),
a position or trip count computed at run time, a Loop that may exit early or would unroll past
``MAX_UNROLLED_NODES``, a sequence read by any other op (``SequenceMap``, ``If``...).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from onnx import TensorProto, helper

from kiln.errors import UnsupportedOpError

# The ops this module builds (lists at import time), and Loop/Identity when they carry a sequence.
SEQUENCE_OPS = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase", "SequenceAt",
                          "SequenceLength", "ConcatFromSequence", "SplitToSequence"})
OPTIONAL_OPS = frozenset({"Optional", "OptionalHasElement", "OptionalGetElement"})
# An unrolled Loop adds (iterations x body nodes) nodes; past this the model is refused rather than bloated.
MAX_UNROLLED_NODES = 100_000


@dataclass(frozen=True)
class StaticSequence:
    """A sequence value known at import: its elements (kiln Values, one dtype) in order."""

    items: tuple
    elem_type: int  # the ONNX TensorProto element type (of an empty sequence too)


@dataclass(frozen=True)
class StaticOptional:
    """An optional value known at import: its value (a kiln Value or a StaticSequence), or None when empty."""

    value: Any
    elem_type: Optional[int] = None


_STATIC = (StaticSequence, StaticOptional)


def handles(n, domain: str, inputs: list) -> bool:
    """Whether ``n`` is built here: a sequence or optional op, or a Loop/Identity reading a static sequence."""
    if domain != "":
        return False
    if n.op_type in SEQUENCE_OPS or n.op_type in OPTIONAL_OPS:
        return True
    return n.op_type in ("Loop", "Identity") and any(isinstance(v, StaticSequence) for v in inputs)


def check_inputs(n, inputs: list, label: str) -> None:
    """Any other op reading a static sequence: refused by name (kiln ops take tensors)."""
    for name, v in zip(n.input, inputs):
        if isinstance(v, StaticOptional):
            raise UnsupportedOpError(f"{label} ({n.op_type}) reads '{name}', an optional value; only "
                                     f"OptionalHasElement and OptionalGetElement take one")
        if isinstance(v, StaticSequence):
            raise UnsupportedOpError(
                f"{label} ({n.op_type}) reads '{name}', a sequence; kiln lowers sequences to tensors only where "
                f"their length and elements are known at import (Sequence* ops with constant positions, "
                f"ConcatFromSequence, SplitToSequence, Loops with a constant trip count)")


def check_outputs(g, scope: Any, what: str) -> None:
    """A graph output that is a sequence cannot be typed in kiln's IR: refused by name."""
    for vi in g.output:
        if isinstance(scope.lookup(vi.name), _STATIC):
            raise UnsupportedOpError(f"output '{vi.name}' of {what} is a sequence; kiln's IR has tensors only "
                                     f"(a sequence inside a model is lowered to tensors, one at its interface is not)")


class _Builder:
    def __init__(self, imp: Any, kg: Any, n, scope: Any, where: str, label: str):
        self.imp, self.kg, self.n, self.scope, self.where, self.label = imp, kg, n, scope, where, label

    def fail(self, why: str) -> None:
        raise UnsupportedOpError(f"{self.label} ({self.n.op_type}): {why}")

    def ref(self, v: Any) -> str:
        """A fresh ONNX name for kiln value ``v`` in this scope, so an ONNX node built here can read it."""
        name = self.imp.fresh_onnx_name("seq")
        self.scope.define(name, v, self.label)
        return name

    def node(self, op_type: str, inputs: list, outputs: Optional[list] = None, **attrs) -> list:
        """Build one ONNX node through the importer; returns the kiln values of its outputs."""
        outputs = outputs or [self.imp.fresh_onnx_name("seq")]
        proto = helper.make_node(op_type, [self.ref(v) if v is not None else "" for v in inputs], outputs,
                                 name=self.imp.fresh_onnx_name(f"{self.n.name or self.n.op_type}/{op_type}"),
                                 **attrs)
        self.imp._node(self.kg, proto, self.scope, {}, self.where)
        return [self.scope.lookup(o) for o in outputs]

    def tensor_out(self, k: int, v: Any) -> None:
        """Define output ``k`` of the node as tensor ``v`` (through an Identity, so it gets the ONNX name)."""
        if self.n.output[k]:
            self.node("Identity", [v], [self.n.output[k]])

    def seq_out(self, k: int, seq: StaticSequence) -> None:
        if self.n.output[k]:
            self.scope.define(self.n.output[k], seq, self.label)

    def const_int(self, v: Any, what: str) -> int:
        arr = None if v is None else v.const
        if arr is None:
            self.fail(f"{what} is computed at run time; kiln lowers sequences only with positions known at import")
        arr = np.asarray(arr)
        if arr.size != 1 or arr.dtype.kind not in "iu":
            self.fail(f"{what} must be one integer, got {arr.dtype}{list(arr.shape)}")
        return int(arr.reshape(-1)[0])

    def seq_in(self, inputs: list, i: int) -> StaticSequence:
        v = inputs[i] if i < len(inputs) else None
        if not isinstance(v, StaticSequence):
            self.fail(f"input {i} ('{self.n.input[i] if i < len(self.n.input) else ''}') must be a sequence")
        return v

    def position(self, v: Any, length: int, *, insert: bool) -> int:
        pos = self.const_int(v, "the position")
        hi = length if insert else length - 1
        if not -length <= pos <= hi:
            self.fail(f"position {pos} is out of range for a sequence of {length} elements")
        return pos + length if pos < 0 else pos


def _attr(n, name: str, default: Any) -> Any:
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _elem_type(v: Any) -> Optional[int]:
    return None if v.type is None else v.type.dtype.value


def build(imp: Any, kg: Any, n, inputs: list, scope: Any, where: str, label: str) -> None:
    """Build sequence node ``n`` (see the module doc): define its outputs in ``scope``."""
    b = _Builder(imp, kg, n, scope, where, label)
    op = n.op_type
    if op == "SequenceEmpty":
        b.seq_out(0, StaticSequence((), int(_attr(n, "dtype", TensorProto.FLOAT))))
    elif op == "SequenceConstruct":
        if not inputs or any(v is None or isinstance(v, StaticSequence) for v in inputs):
            b.fail("takes one or more tensors")
        types = {_elem_type(v) for v in inputs}
        if len(types) != 1:
            b.fail("its tensors have different element types")
        b.seq_out(0, StaticSequence(tuple(inputs), types.pop()))
    elif op == "SequenceInsert":
        seq = b.seq_in(inputs, 0)
        t = inputs[1] if len(inputs) > 1 else None
        if t is None or isinstance(t, StaticSequence):
            b.fail("input 1 must be a tensor")
        if _elem_type(t) != seq.elem_type:
            b.fail(f"inserts a {t.type.dtype} tensor into a sequence of element type "
                   f"{TensorProto.DataType.Name(seq.elem_type)}")
        items = list(seq.items)
        pos = b.position(inputs[2], len(items), insert=True) if len(inputs) > 2 and inputs[2] is not None \
            else len(items)
        items.insert(pos, t)
        b.seq_out(0, StaticSequence(tuple(items), seq.elem_type))
    elif op == "SequenceErase":
        seq = b.seq_in(inputs, 0)
        items = list(seq.items)
        if not items:
            b.fail("erases from an empty sequence")
        pos = b.position(inputs[1], len(items), insert=False) if len(inputs) > 1 and inputs[1] is not None \
            else len(items) - 1
        del items[pos]
        b.seq_out(0, StaticSequence(tuple(items), seq.elem_type))
    elif op == "SequenceAt":
        seq = b.seq_in(inputs, 0)
        b.tensor_out(0, seq.items[b.position(inputs[1] if len(inputs) > 1 else None, len(seq.items),
                                             insert=False)])
    elif op == "SequenceLength":
        seq = b.seq_in(inputs, 0)
        b.node("Constant", [], [n.output[0]], value=helper.make_tensor("v", TensorProto.INT64, [],
                                                                        [len(seq.items)]))
    elif op == "ConcatFromSequence":
        _concat_from_sequence(b, b.seq_in(inputs, 0))
    elif op == "SplitToSequence":
        _split_to_sequence(b, inputs)
    elif op == "Identity":
        b.seq_out(0, b.seq_in(inputs, 0))
    elif op == "Loop":
        _unroll_loop(b, inputs)
    elif op == "Optional":
        v = inputs[0] if inputs else None
        b.seq_out(0, StaticOptional(v, None if v is None else getattr(v, "elem_type", None) or _elem_type(v)))
    elif op == "OptionalHasElement":
        v = inputs[0] if inputs else None
        has = v is not None and not (isinstance(v, StaticOptional) and v.value is None)
        b.node("Constant", [], [n.output[0]], value=helper.make_tensor("v", TensorProto.BOOL, [], [has]))
    elif op == "OptionalGetElement":
        v = inputs[0] if inputs else None
        if isinstance(v, StaticOptional):
            v = v.value
            if v is None:
                b.fail("reads an empty optional value (an error at run time in ONNX)")
        if v is None:
            b.fail("has no input")
        if isinstance(v, StaticSequence):
            b.seq_out(0, v)
        else:
            b.tensor_out(0, v)
    else:  # pragma: no cover - handles() admits only the ops above
        b.fail("is not a sequence op")


def _concat_from_sequence(b: _Builder, seq: StaticSequence) -> None:
    if not seq.items:
        b.fail("concatenates an empty sequence (the result's shape is unknown)")
    axis, new_axis = int(_attr(b.n, "axis", 0)), int(_attr(b.n, "new_axis", 0))
    items = list(seq.items)
    if new_axis:
        rank = items[0].type.shape and len(items[0].type.shape) if items[0].type is not None else None
        if axis < 0 and rank is None:
            b.fail("new_axis with a negative axis needs the elements' rank, which is unknown at import")
        unsq = axis + rank + 1 if axis < 0 else axis
        axes = b.node("Constant", [], value=helper.make_tensor("v", TensorProto.INT64, [1], [unsq]))[0]
        items = [b.node("Unsqueeze", [v, axes])[0] for v in items]
        axis = unsq
    b.node("Concat", items, [b.n.output[0]], axis=axis)


def _split_to_sequence(b: _Builder, inputs: list) -> None:
    x = inputs[0]
    split = inputs[1] if len(inputs) > 1 else None
    axis, keepdims = int(_attr(b.n, "axis", 0)), int(_attr(b.n, "keepdims", 1))
    shape = None if x.type is None else x.type.shape
    if shape is None:
        b.fail("the input's rank is unknown at import")
    rank = len(shape)
    if not -rank <= axis < rank:
        b.fail(f"axis {axis} is out of range for rank {rank}")
    axis %= rank
    length = shape[axis]
    if split is None:
        if not isinstance(length, int):
            b.fail(f"splits into pieces of one along dim {axis}, whose size is {length!r} (not known at import)")
        sizes, squeeze = [1] * length, not keepdims
    else:
        arr = split.const
        if arr is None:
            b.fail("its 'split' input is computed at run time")
        arr = np.asarray(arr).astype(np.int64)
        if arr.ndim == 0:
            if not isinstance(length, int):
                b.fail(f"splits dim {axis} of size {length!r} (not known at import) into chunks of {int(arr)}")
            step = int(arr)
            if step < 1:
                b.fail(f"the chunk size must be >= 1, got {step}")
            sizes = [min(step, length - s) for s in range(0, length, step)]
        else:
            sizes = [int(s) for s in arr]
            if isinstance(length, int) and sum(sizes) != length:
                b.fail(f"split sizes {sizes} do not add up to dim {axis}'s size {length}")
        squeeze = False
    if not sizes:
        b.seq_out(0, StaticSequence((), _elem_type(x)))
        return
    split_v = b.node("Constant", [], value=helper.make_tensor("v", TensorProto.INT64, [len(sizes)], sizes))[0]
    outs = [b.imp.fresh_onnx_name("seq") for _ in sizes]
    parts = b.node("Split", [x, split_v], outs, axis=axis)
    if squeeze:
        axes = b.node("Constant", [], value=helper.make_tensor("v", TensorProto.INT64, [1], [axis]))[0]
        parts = [b.node("Squeeze", [p, axes])[0] for p in parts]
    b.seq_out(0, StaticSequence(tuple(parts), _elem_type(x)))


def _is_true(v: Any) -> bool:
    """Whether ``v`` is the constant True, through Identity nodes (a Loop body passes its condition on so)."""
    while v is not None and not isinstance(v, StaticSequence):
        if v.const is not None:
            arr = np.asarray(v.const)
            return arr.size == 1 and bool(arr.reshape(-1)[0])
        p = v.producer
        if p is None or p.op != "Identity":
            return False
        v = p.inputs[0]
    return False


def _declared_dims(vi) -> list:
    """[1] where a Loop body input is declared a 1-element 1-D tensor, else [] (a scalar, ONNX's form)."""
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if t is not None and t.HasField("shape") and len(t.shape.dim) == 1:
        return [1]
    return []


def _unroll_loop(b: _Builder, inputs: list) -> None:
    n, imp = b.n, b.imp
    body = next((a.g for a in n.attribute if a.name == "body"), None)
    if body is None:
        b.fail("has no body")
    trip = inputs[0] if inputs else None
    if trip is None:
        b.fail("carries a sequence but has no trip count; kiln unrolls such a Loop only with a constant one")
    count = b.const_int(trip, "the trip count (of a Loop carrying a sequence)")
    cond = inputs[1] if len(inputs) > 1 else None
    if cond is not None and not _is_true(cond):
        b.fail("carries a sequence and its initial condition is not the constant True")
    if count < 0:
        b.fail(f"trip count {count} is negative")
    carried = list(inputs[2:])
    if len(body.input) != len(carried) + 2:
        b.fail(f"its body takes {len(body.input)} inputs for {len(carried)} carried values (+ 2)")
    n_scan = len(body.output) - 1 - len(carried)
    if n_scan < 0:
        b.fail("its body returns fewer values than the Loop carries")
    if count * max(1, len(body.node)) > MAX_UNROLLED_NODES:
        b.fail(f"unrolling {count} iterations of a {len(body.node)}-node body passes {MAX_UNROLLED_NODES:,} nodes")
    if n_scan and count == 0:
        b.fail("has scan outputs and a trip count of 0 (their shape is unknown)")
    state = carried
    scans: list = [[] for _ in range(n_scan)]
    child_type = type(b.scope)
    for i in range(count):
        scope = child_type(b.scope)
        where = f"{b.where} (iteration {i} of the Loop unrolled at {b.label})"
        it = _Builder(imp, b.kg, n, scope, where, b.label)
        names = [vi.name for vi in body.input]
        # The iteration number and condition are scalars, or [1] where the body declares rank 1 (as the TorchScript
        # exporter does, and onnxruntime honours).
        if names[0]:
            it.node("Constant", [], [names[0]], value=helper.make_tensor("v", TensorProto.INT64,
                                                                         _declared_dims(body.input[0]), [i]))
        if names[1]:
            it.node("Constant", [], [names[1]], value=helper.make_tensor("v", TensorProto.BOOL,
                                                                         _declared_dims(body.input[1]), [True]))
        for name, v in zip(names[2:], state):
            if name:
                scope.define(name, v, b.label)
        for bn in body.node:
            imp._node(b.kg, bn, scope, {}, where)
        outs = [scope.lookup(o.name) for o in body.output]
        if any(v is None for v in outs):
            b.fail("its body returns a value it does not define")
        if not _is_true(outs[0]):
            b.fail("its body's condition is not the constant True (a Loop that may stop early is not unrolled)")
        state = outs[1:1 + len(carried)]
        for k, v in enumerate(outs[1 + len(carried):]):
            if isinstance(v, StaticSequence):
                b.fail("its scan output is a sequence")
            scans[k].append(v)
    for k, v in enumerate(state):
        if isinstance(v, StaticSequence):
            b.seq_out(k, v)
        else:
            b.tensor_out(k, v)
    for k, elems in enumerate(scans):
        out = n.output[len(carried) + k] if len(carried) + k < len(n.output) else ""
        if not out:
            continue
        axes = b.node("Constant", [], value=helper.make_tensor("v", TensorProto.INT64, [1], [0]))[0]
        b.node("Concat", [b.node("Unsqueeze", [e, axes])[0] for e in elems], [out], axis=0)
