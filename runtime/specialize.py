"""Plans specialized to an input signature: a model's shape computations run once per signature, not per run.

A model traced with a symbolic dim (``dynamic_batch=True``, an ONNX file with a named batch axis) computes its
reshape targets at run time: ``Shape -> Gather -> Unsqueeze -> Concat -> Reshape``, about ten tiny instructions per
attention layer, each costing the run loop and a kernel call (0.5-1.5 us) for values that depend only on the
inputs' shapes. A run's signature (its inputs' shapes and dtypes, which ``Program`` already keys its input checks
by) fixes those shapes, so the second run of a signature records those values (the first run of every signature
stays plain: a workload of ever-new shapes pays nothing), and later runs of it take a plan without their
instructions, the values in its slot template. ONNX Runtime and TensorRT get the same from symbolic shape
inference; here nothing depends on inference being right (see the guards).

What is folded (``Specializer.candidates``, found once at load): an instruction whose op the IR may fold
(``schema.foldable``, no subgraphs: never ``kiln.Guard``/``kiln.Assert`` or a random op) and each of whose inputs
is a constant, a folded value, or an input whose shape alone matters (``Shape``, ``Size``:
``fold_constants.SHAPE_ONLY_INPUTS``); a recorded value must also be an ndarray (or numpy scalar) of at most
``FOLD_MAX_BYTES``, else it and what depends on it stay in the plan.

Guards. Where a folded ``Shape``/``Size`` measures a value other than a graph input (whose shape the signature
holds), the specialized plan keeps a guard in its place that compares that value's shape with the recorded one
(~0.2 us). On a mismatch (a shape the signature does not determine, after a ``NonZero`` say) the call starts over
on the generic plan, and that signature is never specialized again. A specialized run's results are the generic
plan's bit for bit: the folded values are the recorded outputs of the same kernels.

Views. A chain of view ops (``VIEW_OPS``: Reshape, Transpose, Squeeze, Gather of a constant index, ...) whose
every input but the data is a constant or folded value computes, from its source's layout, a fixed geometry: the
recorded run gives each view's shape, strides and byte offset in its source's buffer. The specialized plan keeps
one instruction per view something else reads, making it from the source directly (``np.ndarray`` over the
source's buffer, 0.25 us) where the chain took an instruction a link (0.3-0.6 us each, with the run loop's step):
an attention layer's ``Reshape -> Unsqueeze -> Transpose -> Squeeze -> Gather -> Reshape -> Transpose`` of its
packed QKV output becomes three instructions. A recorded link that copied (a Reshape of a transposed array, a
Gather of an index array) is not a view and stays as it was, a new source for what follows. Each view instruction
checks that its source has the recorded shape, strides and dtype (a kernel might hand back another layout); if
not, the call starts over on the generic plan, as a guard's does. Sources are never graph inputs (their layout is
the caller's), and plans with control flow (whose bodies read outer slots) get no collapsed views.

Folded values are marked read-only. In-place kernel variants (runtime/plan.py) check at run time that the array
they would write into is writeable, and make a fresh result otherwise, so no run can write into a value every run
shares; ``Program.run`` copies out any read-only output.
"""
from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import numpy as np

from kiln.ir.passes.fold_constants import SHAPE_ONLY_INPUTS
from kiln.runtime.plan import Instruction, Plan, execute, outer_values

# A recorded value over this many bytes is not folded (nor anything computed from it): a mask built from a
# shape may be large, and each specialized plan keeps its own.
FOLD_MAX_BYTES = 1 << 20
# At most this many signatures are tracked (counted or specialized); past it the table starts over, so a model
# run on ever-new shapes keeps a bounded table.
SIGNATURES_MAX = 64
# Which sighting of a signature records its values (and builds its plan): the second.
RECORD_AT = 2
# Ops whose CPU kernels may return a view of their first input (each recorded run says whether it did): what
# a specialized plan can make straight from the chain's source (module docstring, "Views").
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Slice", "Gather"})


class _OneStep:
    """A plan of one step for ``execute`` (its loop, run one instruction at a time by ``Specializer.record``)."""

    __slots__ = ("steps",)

    def __init__(self):
        self.steps = [None]


class ShapeChanged(Exception):
    """A guard found a shape other than the one recorded for this signature (never leaves Program.run)."""


class Specialized:
    """One signature's plan (``plan``, its instructions those of the generic plan less the folded ones, guards in
    place of the folded Shape/Size of computed values) and the slot ``template`` holding the folded values."""

    __slots__ = ("plan", "template", "folded", "views")

    def __init__(self, plan: Plan, template: list, folded: int, views: int = 0):
        self.plan, self.template, self.folded, self.views = plan, template, folded, views


class Specializer:
    """The signature table of one Program (module docstring)."""

    def __init__(self, plan: Plan, template: list):
        self.plan = plan
        self.template = template
        self.candidates = _candidates(plan, template)
        self.views = _view_candidates(plan)
        self._constants = {id(t) for t in template if t is not None}
        self._table: dict = {}  # signature -> sightings (int), a Specialized, or None (stays generic)
        self._lock = threading.Lock()
        self._warned = False

    @property
    def useful(self) -> bool:
        """Whether any instruction could be folded or made a direct view at all (else the Program skips all of
        this)."""
        return bool(self.candidates or self.views)

    def lookup(self, key: Any) -> Any:
        """The ``Specialized`` for ``key``; ``True`` when this run should record (then call ``build``); None
        (the generic plan)."""
        entry = self._table.get(key, 0)
        if entry.__class__ is not int:
            return entry
        if key is None:
            return None
        with self._lock:
            entry = self._table.get(key, 0)
            if entry.__class__ is not int:
                return entry
            if len(self._table) >= SIGNATURES_MAX:
                self._table.clear()
            self._table[key] = entry + 1
        return True if entry + 1 == RECORD_AT else None

    def specialized(self, key: Any) -> Optional[Specialized]:
        """The specialized plan for ``key`` if one was built (no counting)."""
        entry = self._table.get(key)
        return entry if isinstance(entry, Specialized) else None

    def record(self, slots: list) -> tuple:
        """Run the generic plan over ``slots`` (a run's copy of the template, inputs in place) as ``execute``
        does, keeping each candidate's input shapes and outputs (made read-only), and each view candidate's
        layouts (``_view_record``): what ``build`` folds and makes direct."""
        captured, viewed = {}, {}
        candidates, views = self.candidates, self.views
        input_owners = {id(_owner(slots[s])) for s in self.plan.input_slots if isinstance(slots[s], np.ndarray)}
        one = _OneStep()
        for i, (ins, (kernel, inputs, outputs, release, kind)) in enumerate(zip(self.plan.instructions,
                                                                                  self.plan.steps)):
            shapes = None
            if i in candidates:
                shapes = tuple(getattr(slots[s], "shape", None) if s >= 0 else None for s in ins.inputs)
            one.steps[0] = (kernel, inputs, outputs, (), kind)  # execute's own dispatch, releases after the capture
            execute(one, slots)
            if shapes is not None:
                outs = tuple(slots[s] for s in ins.outputs)
                for v in outs:
                    # Read-only from here on: a later instruction's in-place variant would otherwise overwrite
                    # the value this run records (it makes a fresh result instead), as in the specialized runs.
                    # (A constant passed through, Identity's, keeps its flags: the model's own array, never written.)
                    if isinstance(v, np.ndarray) and _foldable_value(v) and id(v) not in self._constants:
                        v.flags.writeable = False
                captured[i] = (shapes, outs)
            elif i in views:
                viewed[i] = _view_record(slots[ins.inputs[0]], slots[ins.outputs[0]], input_owners)
            for s in release:
                slots[s] = None
        return captured, viewed

    def build(self, key: Any, recorded: tuple) -> None:
        """Make and keep ``key``'s plan from what a recording run saw (``record``; None: nothing to change)."""
        entry = _specialize(self.plan, self.template, self.candidates, *recorded)
        with self._lock:
            if len(self._table) >= SIGNATURES_MAX:
                self._table.clear()
            self._table[key] = entry

    def give_up(self, key: Any, error: ShapeChanged) -> None:
        """A guard failed: ``key`` runs on the generic plan from now on."""
        with self._lock:
            self._table[key] = None
        if not self._warned:
            self._warned = True
            warnings.warn(f"kiln: {error}; this input signature runs without specialization (the answer is "
                          f"unaffected; the model's shape types may be wrong, please report it)", RuntimeWarning,
                          stacklevel=3)


def _candidates(plan: Plan, template: list) -> frozenset:
    """Instructions that can be folded if their recorded values allow (module docstring), in plan order."""
    folded: set = set()
    found = []
    for i, ins in enumerate(plan.instructions):
        node = ins.node
        schema = getattr(node, "schema", None)
        if ins.with_slots or schema is None or not schema.foldable or schema.has_subgraphs or not ins.inputs:
            continue
        shape_only = _shape_only(node)
        if all(s < 0 or template[s] is not None or s in folded or j in shape_only
               for j, s in enumerate(ins.inputs)):
            found.append(i)
            folded.update(ins.outputs)
    return frozenset(found)


def _view_candidates(plan: Plan) -> frozenset:
    """Instructions that may be made direct views (module docstring, "Views"); none in a plan where a subgraph
    reads outer values (their reads are not the instructions' inputs)."""
    if any(ins.with_slots or (ins.node.attrs and outer_values(ins.node)) for ins in plan.instructions):
        return frozenset()
    inputs = set(plan.input_slots)
    return frozenset(i for i, ins in enumerate(plan.instructions)
                     if ins.node.domain == "" and ins.node.op in VIEW_OPS and len(ins.outputs) == 1
                     and ins.inputs and ins.inputs[0] >= 0 and ins.inputs[0] not in inputs)


def _owner(a: np.ndarray) -> Any:
    return a if a.base is None else a.base


def _view_record(x: Any, y: Any, input_owners: set) -> Optional[tuple]:
    """What a view instruction's recorded run shows: (source address, source layout, view address, view layout)
    where ``y`` is a view into ``x``'s buffer (both plain ndarrays of one owner, not a graph input's, of a dtype without
    Python objects: an array over raw memory must not hold references), else None."""
    if x.__class__ is not np.ndarray or y.__class__ is not np.ndarray or _owner(x) is not _owner(y) \
            or id(_owner(x)) in input_owners or x.dtype != y.dtype or x.dtype.hasobject \
            or x.flags.writeable != y.flags.writeable:
        return None
    return (x.__array_interface__["data"][0], (x.shape, x.strides, x.dtype, x.flags.c_contiguous),
            y.__array_interface__["data"][0], (y.shape, y.strides))


def _direct_view(node_text: str, source: tuple, shape: tuple, strides: tuple, offset: int):
    """A kernel making the recorded view from its chain's source: ``shape``/``strides`` at byte ``offset`` of a
    source of layout ``source`` (shape, strides, dtype); another layout raises ShapeChanged."""
    s_shape, s_strides, s_dtype = source

    def view(x):
        if x.__class__ is not np.ndarray or x.shape != s_shape or x.strides != s_strides or x.dtype != s_dtype:
            raise ShapeChanged(f"{node_text} got a source of layout {getattr(x, 'shape', None)} strides "
                               f"{getattr(x, 'strides', None)} where this input signature's recorded run had "
                               f"{s_shape} strides {s_strides}")
        return np.ndarray(shape, s_dtype, x, offset, strides)
    return view


def _collapse_views(kept: list, origin: list, template: list, viewed: dict, output_slots: tuple) -> tuple:
    """``kept`` (a specialized plan's instructions; ``origin``: each one's index in the generic plan) with its view
    chains made direct (module docstring, "Views"): (instructions, how many views were made direct)."""
    root: dict = {}    # slot of a view made direct -> (source slot, the source's recorded address, its layout)
    made: dict = {}    # position in kept -> the direct view's instruction
    for q, ins in enumerate(kept):
        record = viewed.get(origin[q])
        if record is None or not all(t < 0 or template[t] is not None for t in ins.inputs[1:]):
            continue
        x_address, (x_shape, x_strides, x_dtype, x_contiguous), y_address, (y_shape, y_strides) = record
        src = ins.inputs[0]
        if src in root:
            src, address, layout = root[src]
        elif x_contiguous and template[src] is None:
            address, layout = x_address, (x_shape, x_strides, x_dtype)
        else:
            continue
        root[ins.outputs[0]] = (src, address, layout)
        made[q] = Instruction(_direct_view(ins.node.describe(), layout, y_shape, y_strides, y_address - address),
                              (src,), ins.outputs, ins.release, ins.node, True, False)
    if not made:
        return kept, 0
    # A view made direct stays only where something other than another such view reads it (or it is an output).
    needed = set(output_slots)
    for q, ins in enumerate(kept):
        if q not in made:
            needed.update(ins.inputs)
    out: list = []
    carried: list = []
    last_source_read: dict = {}
    for q, ins in enumerate(kept):
        new = made.get(q)
        if new is not None and ins.outputs[0] not in needed:
            carried.extend(ins.release)  # released later than before: always safe
            continue
        ins = new or ins
        if carried:
            ins = _with_release(ins, tuple(sorted(set(ins.release) | set(carried))))
            carried = []
        if new is not None:
            last_source_read[ins.inputs[0]] = len(out)
        out.append(ins)
    if carried and out:
        out[-1] = _with_release(out[-1], tuple(sorted(set(out[-1].release) | set(carried))))
    # A source lives until its last direct view is made: a release before that moves there (one pass over the
    # releases: a loop per source over the plan before it was quadratic on a long plan).
    moved: dict = {}  # position -> sources whose release moves there
    for q, ins in enumerate(out):
        early = {t for t in ins.release if last_source_read.get(t, -1) > q}
        if early:
            out[q] = _with_release(ins, tuple(t for t in ins.release if t not in early))
            for t in early:
                moved.setdefault(last_source_read[t], set()).add(t)
    for at, sources in moved.items():
        out[at] = _with_release(out[at], tuple(sorted(set(out[at].release) | sources)))
    return out, len(made)


def signature(arrays: list) -> tuple:
    """The key of a run on these checked arrays: their shapes and dtypes in input order (``Program._signature``'s;
    on every run's path: a loop of appends, 0.1 us, where a generator took 0.26)."""
    key = []
    for a in arrays:
        key.append(a.shape)
        key.append(a.dtype)
    return tuple(key)


def _shape_only(node: Any) -> tuple:
    """The inputs of ``node`` whose shape alone it reads (``Shape``, ``Size``)."""
    return SHAPE_ONLY_INPUTS.get(node.op, ()) if node.domain == "" else ()


def _foldable_value(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return v.nbytes <= FOLD_MAX_BYTES and v.dtype != object
    return isinstance(v, np.generic)


def _guard(node_text: str, expected: tuple, value: Any):
    def guard(x):
        if x.shape != expected:
            raise ShapeChanged(f"{node_text} measured a shape {list(x.shape)} where this input signature's "
                               f"recorded run had {list(expected)}")
        return value
    return guard


def _specialize(plan: Plan, template: list, candidates: frozenset, captured: dict,
                viewed: Optional[dict] = None) -> Optional[Specialized]:
    input_slots = set(plan.input_slots)
    folded: set = set()
    values: dict = {}
    kept: list = []
    origin: list = []  # each kept instruction's index in the generic plan
    carried: list = []  # releases of dropped instructions, passed on to the next kept one
    count = 0
    for i, ins in enumerate(plan.instructions):
        got = captured.get(i)
        fold = False
        if got is not None:
            shapes, outs = got
            shape_only = _shape_only(ins.node)
            fold = all(_foldable_value(v) for v in outs) and all(
                s < 0 or template[s] is not None or s in folded or (j in shape_only and shapes[j] is not None)
                for j, s in enumerate(ins.inputs))
        if not fold:
            release = ins.release
            if carried:
                release = tuple(sorted(set(release) | set(carried)))
                carried = []
            kept.append(ins if release is ins.release else _with_release(ins, release))
            origin.append(i)
            continue
        count += 1
        for s, v in zip(ins.outputs, outs):
            if isinstance(v, np.ndarray):
                v = v.view()  # read-only without touching the recorded run's own array
                v.flags.writeable = False
            values[s] = v
            folded.add(s)
        measured = [j for j, s in enumerate(ins.inputs) if j in shape_only and s >= 0 and s not in input_slots
                    and template[s] is None and s not in folded]
        if measured:  # a computed value's shape: keep a guard in the instruction's place
            j = measured[0]
            guard = _guard(ins.node.describe(), shapes[j], values[ins.outputs[0]])
            kept.append(Instruction(guard, (ins.inputs[j],), ins.outputs[:1],
                                    tuple(sorted(set(ins.release) | set(carried))), ins.node, True, False))
            origin.append(-1)
            carried = []
        else:
            carried.extend(s for s in ins.release if s not in folded and template[s] is None)
    if carried and kept:
        last = kept[-1]
        kept[-1] = _with_release(last, tuple(sorted(set(last.release) | set(carried))))
    spec_template = list(template)
    for s, v in values.items():
        spec_template[s] = v
    kept, direct = _collapse_views(kept, origin, spec_template, viewed or {}, plan.output_slots)
    if not count and not direct:
        return None
    return Specialized(Plan(kept, plan.input_slots, plan.output_slots, plan.none_slot), spec_template, count,
                       direct)


def _with_release(ins: Instruction, release: tuple) -> Instruction:
    return Instruction(ins.kernel, ins.inputs, ins.outputs, release, ins.node, ins.single, ins.with_slots,
                       ins.inplace)
