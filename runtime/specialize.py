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
from kiln.runtime.plan import Instruction, Plan, execute

# A recorded value over this many bytes is not folded (nor anything computed from it): a mask built from a
# shape may be large, and each specialized plan keeps its own.
FOLD_MAX_BYTES = 1 << 20
# At most this many signatures are tracked (counted or specialized); past it the table starts over, so a model
# run on ever-new shapes keeps a bounded table.
SIGNATURES_MAX = 64
# Which sighting of a signature records its values (and builds its plan): the second.
RECORD_AT = 2


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

    __slots__ = ("plan", "template", "folded")

    def __init__(self, plan: Plan, template: list, folded: int):
        self.plan, self.template, self.folded = plan, template, folded


class Specializer:
    """The signature table of one Program (module docstring)."""

    def __init__(self, plan: Plan, template: list):
        self.plan = plan
        self.template = template
        self.candidates = _candidates(plan, template)
        self._constants = {id(t) for t in template if t is not None}
        self._table: dict = {}  # signature -> sightings (int), a Specialized, or None (stays generic)
        self._lock = threading.Lock()
        self._warned = False

    @property
    def useful(self) -> bool:
        """Whether any instruction could be folded at all (else the Program skips all of this)."""
        return bool(self.candidates)

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

    def record(self, slots: list) -> dict:
        """Run the generic plan over ``slots`` (a run's copy of the template, inputs in place) as ``execute``
        does, keeping each candidate's input shapes and outputs (made read-only): what ``build`` folds."""
        captured = {}
        candidates = self.candidates
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
            for s in release:
                slots[s] = None
        return captured

    def build(self, key: Any, captured: dict) -> None:
        """Make and keep ``key``'s plan from a recording run's ``captured`` values (None: nothing to fold)."""
        entry = _specialize(self.plan, self.template, self.candidates, captured)
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


def _specialize(plan: Plan, template: list, candidates: frozenset, captured: dict) -> Optional[Specialized]:
    input_slots = set(plan.input_slots)
    folded: set = set()
    values: dict = {}
    kept: list = []
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
            carried = []
        else:
            carried.extend(s for s in ins.release if s not in folded and template[s] is None)
    if not count:
        return None
    if carried and kept:
        last = kept[-1]
        kept[-1] = _with_release(last, tuple(sorted(set(last.release) | set(carried))))
    spec_template = list(template)
    for s, v in values.items():
        spec_template[s] = v
    return Specialized(Plan(kept, plan.input_slots, plan.output_slots, plan.none_slot), spec_template, count)


def _with_release(ins: Instruction, release: tuple) -> Instruction:
    return Instruction(ins.kernel, ins.inputs, ins.outputs, release, ins.node, ins.single, ins.with_slots,
                       ins.inplace)
