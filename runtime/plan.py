"""The execution plan: a graph lowered once, at load, to a flat list of instructions.

Each instruction holds its kernel (already chosen for the node's op and input dtypes, with its
attributes decoded), the integer slots it reads and writes, and the slots whose values die after
it (liveness), so a run is one loop over a list: no graph walking, no name lookups, no attribute
parsing. Constants live in the slot template that every run copies. Subgraphs (If/Loop bodies)
are lowered into the same slot space, so a body reads outer values by slot.

In-place outputs (issue 5). A kernel that can write its result into one of its inputs gets that
variant for an instruction when the plan proves, at build time, that nothing can observe the
overwrite: the input's value dies at that instruction and no other live value shares its memory.
The protocol a kernel adopts (attributes on the function it returns; none are required):

``kernel.fresh = True``
    Every array the kernel returns is new on each call: it shares memory with no argument, no
    constant, no sibling output and nothing the kernel keeps between calls (a view of a buffer
    it just allocated is fine). Such outputs are what in-place writes may target. A kernel that
    is a numpy ufunc is fresh; so, unless a kernel says ``fresh = False``, are the kernels of
    the ops in ``FRESH_OPS``, whose results are computed, never an input passed through.
``kernel.inplace = {k: variant}``
    ``variant(*args)`` returns what ``kernel(*args)`` returns, written into ``args[k]`` (and
    returns that array) when it can: it checks at run time that ``args[k]`` is a writeable
    ndarray of the result's shape and dtype, and otherwise returns the kernel's fresh result.
    The plan passes it only arguments that share no memory with ``args[k]``, except the very
    same value (``x + x``: ufuncs with ``out=`` handle that). Single-output kernels only.
    ``ufunc_inplace`` builds such variants for ufunc calls; a kernel that is a bare numpy
    ufunc (Add is ``np.add``) gets them without attributes.

Static rules (``PlanBuilder._with_inplace``): each value has alias roots, the fresh buffers it may
share memory with. A fresh kernel's outputs (and an in-place instruction's output, which takes
over a buffer nothing else can reach any more) are their own roots; any other kernel's outputs
may alias any value it reads (a reshape, a transpose, Identity, an If branch returning an outer
value), so they inherit all those roots. Graph inputs, constants, graph outputs and outputs of
non-fresh kernels with no inputs are never roots. Input k may be overwritten only if it is a
root, dies at this instruction, every value aliasing it dies by then too (none is a graph output),
and no other argument aliases it. Nested If/Loop bodies get no in-place variants: their values
live until the owning node ends and a Loop body runs many times.
"""
from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kiln.ir.graph import Graph, Node, Value

Kernel = Callable[..., Any]

# Ops whose every kernel (fast or reference) computes new arrays: none can return an input, a
# view of one or a stored array. Their outputs are in-place targets like a fresh kernel's; a
# kernel of one of them that does alias must say ``fresh = False``. (Shape and Size matter
# beyond their own small outputs: taken as views, they would tie every shape computation to the
# tensor measured, keeping it "aliased" until the last reshape.)
FRESH_OPS = frozenset({"Shape", "Size", "MatMul", "Gemm", "Conv", "ConvTranspose", "BatchNormalization",
                       "LayerNormalization", "Softmax", "LogSoftmax", "Gelu", "Erf", "Tanh", "Sigmoid",
                       "HardSigmoid", "HardSwish"})


# Outputs of a statically known size below this get no in-place variant: numpy allocates small
# arrays from its own cache in well under a microsecond, while the variant's run-time checks
# cost about 0.3 µs per call (a 1000-op chain of [1, 8] ufuncs went from 0.63 to 0.93 µs per
# node). Large or symbolic outputs are where reuse saves page faults and cache misses.
INPLACE_MIN_BYTES = 64 << 10


@dataclass(frozen=True)
class Instruction:
    kernel: Kernel
    inputs: tuple          # slot per input (-1: an omitted optional input)
    outputs: tuple         # slot per output
    release: tuple         # slots whose values are dead after this instruction
    node: Node             # for error messages only
    single: bool           # the kernel returns one array, not a tuple
    with_slots: bool       # control flow: the kernel also gets the run's slot list first
    inplace: int = -1      # the input whose buffer ``kernel`` (an in-place variant) writes into


@dataclass
class Plan:
    instructions: list
    input_slots: tuple
    output_slots: tuple
    none_slot: int = -1    # a slot that always holds None: where omitted optional inputs read

    def __post_init__(self) -> None:
        # What the run loop unpacks per instruction: plain tuples (faster than attribute reads)
        # with omitted inputs pointing at the None slot, so building the arguments needs no test.
        self.steps = [_step(ins.kernel, tuple(self.none_slot if s < 0 else s for s in ins.inputs),
                            ins.outputs, ins.release, ins.single, ins.with_slots) for ins in self.instructions]


# Step kinds (``execute``). The usual instruction (one output, no slot access) with 1, 2 or 3
# inputs gets its own kind, whose branch passes the arguments by name: on Python 3.11 a list
# comprehension is a function call of its own, and ``kernel(*[...])`` was a third of the loop's
# time (a 1000-node chain of tiny ufuncs: 0.65 -> 0.46 us per node). Other instructions take the
# general branch: bit 0 = several outputs, bit 1 = the kernel also gets the slot list.
_UNARY, _BINARY, _TERNARY, _GENERAL = 4, 5, 6, 0


def _step(kernel: Kernel, inputs: tuple, outputs: tuple, release: tuple, single: bool, with_slots: bool) -> tuple:
    """``(kernel, inputs, outputs, release, kind)`` for ``execute``: the special kinds carry
    ``inputs`` as one slot (unary) and ``outputs`` as one slot (all single-output kinds)."""
    if single and not with_slots and 1 <= len(inputs) <= 3:
        kind = (_UNARY, _BINARY, _TERNARY)[len(inputs) - 1]
        return kernel, inputs[0] if kind == _UNARY else inputs, outputs[0], release, kind
    kind = (0 if single else 1) + (2 if with_slots else 0)
    return kernel, inputs, outputs[0] if single else outputs, release, kind


class PlanBuilder:
    """Lowers a graph to a Plan; ``choose(node, builder)`` picks each node's kernel."""

    def __init__(self, choose: Callable[[Node, "PlanBuilder"], Kernel]):
        self.choose = choose
        self.slots: dict[Value, int] = {}
        self.template: list = [None]  # slot 0 stays None: omitted optional inputs read it

    def slot(self, v: Value) -> int:
        if v not in self.slots:
            self.slots[v] = len(self.template)
            self.template.append(v.const)
        return self.slots[v]

    def build(self, graph: Graph, *, liveness: bool = True, inplace: bool = True) -> Plan:
        """Lower ``graph``; nested graphs are built with ``liveness=False`` (their values stay
        until the owning node ends: a Loop body runs many times). ``inplace`` (with liveness)
        lets kernels write into inputs that die (see the module docstring)."""
        input_slots = tuple(self.slot(v) for v in graph.inputs)
        for v in graph.initializers.values():
            self.slot(v)
        slot = self.slot
        rows, reads = [], []  # (kernel, inputs, outputs, node, single, with_slots) per node
        for node in graph.nodes:
            kernel = self.choose(node, self)
            ins = tuple(-1 if v is None else slot(v) for v in node.inputs)
            outs = tuple(slot(v) for v in node.outputs)
            rows.append((kernel, ins, outs, node, len(outs) == 1, getattr(kernel, "with_slots", False)))
            reads.append(ins + tuple(slot(v) for v in outer_values(node)) if node.attrs else ins)
        output_slots = tuple(self.slot(v) for v in graph.outputs)
        release = [()] * len(rows)
        targets = [-1] * len(rows)
        kernels = [row[0] for row in rows]
        if liveness:
            keep = set(output_slots) | set(input_slots)
            last = self._last_uses(rows, reads)
            dying: dict[int, list] = {}
            template = self.template
            for s, i in last.items():
                if s not in keep and template[s] is None:
                    dying.setdefault(i, []).append(s)
            for i, slots in dying.items():
                release[i] = tuple(sorted(slots))
            if inplace:
                self._choose_inplace(rows, reads, last, keep, kernels, targets)
        instructions = [Instruction(kernels[i], ins, outs, release[i], node, single, with_slots, targets[i])
                        for i, (_, ins, outs, node, single, with_slots) in enumerate(rows)]
        return Plan(instructions, input_slots, output_slots, none_slot=0)

    @staticmethod
    def _last_uses(rows: list, reads: list) -> dict:
        """Slot -> index of the last instruction that reads (or, if none does, makes) it."""
        last: dict[int, int] = {}
        for i, (row, r) in enumerate(zip(rows, reads)):
            for s in row[2]:
                last[s] = i  # a value nobody reads dies right after it is made
            for s in r:
                if s >= 0:
                    last[s] = i
        return last

    def _choose_inplace(self, rows: list, reads: list, last: dict, keep: set, kernels: list,
                        targets: list) -> None:
        """Swap in in-place variants (into ``kernels``, the input each writes into ``targets``) where the
        rules of the module docstring allow it."""
        # Alias roots (module docstring): a slot in ``own`` is its own only root; any other slot maps in
        # ``roots`` to the roots whose buffers it may share; ``aliases``: root -> every slot sharing it.
        own: set = set()
        roots: dict[int, frozenset] = {}
        aliases: dict[int, set] = {}
        template = self.template

        def dead_after(s: int, i: int) -> bool:
            return s not in keep and template[s] is None and last.get(s, -1) <= i

        for i, (kernel, ins, outs, node, single, with_slots) in enumerate(rows):
            k, variant = -1, None
            if single and not with_slots:
                k, variant = _inplace_target(kernel, node, ins, reads[i], i, own, roots, aliases, dead_after)
            if k >= 0:
                kernels[i], targets[i] = variant, k
            if k >= 0 or _is_fresh(kernel, node):
                for o in outs:
                    own.add(o)
                    aliases[o] = {o}
            else:
                shared = set()
                for s in reads[i]:
                    if s in own:
                        shared.add(s)
                    elif s in roots:
                        shared.update(roots[s])
                shared = frozenset(shared)
                for o in outs:
                    own.discard(o)
                    roots[o] = shared
                    for root in shared:
                        aliases[root].add(o)


def _inplace_target(kernel: Kernel, node: Node, ins: tuple, reads: tuple, i: int, own: set, roots: dict,
                    aliases: dict, dead_after: Callable[[int, int], bool]) -> tuple:
    """(the input instruction ``i`` may overwrite, the variant doing it), or (-1, None)."""
    out_type = node.outputs[0].type
    if _static_nbytes(out_type) < INPLACE_MIN_BYTES:
        return -1, None
    variants = _variants(kernel, node)
    if not variants:
        return -1, None
    order = list(variants)
    if len(order) > 1:  # prefer an input whose static shape is the output's: its run-time check then passes
        order.sort(key=lambda k: not _same_shape(node.inputs[k].type, out_type))
    for k in order:
        s = ins[k]
        if s < 0 or s not in own or not dead_after(s, i):
            continue
        if not _may_fit(node.inputs[k].type, out_type):
            continue
        if not all(dead_after(m, i) for m in aliases[s]):
            continue
        # Another argument sharing the buffer (an own-root argument shares only its own).
        if any(t != s and t not in own and s in roots.get(t, ()) for t in reads if t >= 0):
            continue
        return k, variants[k]
    return -1, None


def _is_fresh(kernel: Kernel, node: Node) -> bool:
    fresh = getattr(kernel, "fresh", None)
    if fresh is None:
        return isinstance(kernel, np.ufunc) or (node.domain == "" and node.op in FRESH_OPS)
    return bool(fresh)


def _variants(kernel: Kernel, node: Node) -> dict:
    """``{input index: in-place variant}`` of ``kernel`` (see the module docstring)."""
    variants = getattr(kernel, "inplace", None)
    if variants is not None:
        return variants
    if isinstance(kernel, np.ufunc) and kernel.nout == 1 and kernel.nin in (1, 2) \
            and len(node.inputs) == kernel.nin and len(node.outputs) == 1:
        out = node.outputs[0].type
        dt = None if out is None else out.dtype
        # Same dtype in and out (statically; checked again per call): out= changes nothing then.
        if dt is not None and all(v is not None and v.type is not None and v.type.dtype is dt for v in node.inputs):
            key = (kernel, dt)
            found = _UFUNC_VARIANTS.get(key)
            if found is None:  # the variants depend on nothing else: built once per (ufunc, dtype)
                np_dt = _static_dtype(node.outputs[0])
                found = _UFUNC_VARIANTS[key] = {} if np_dt is None else {
                    k: ufunc_inplace(kernel, k, kernel.nin, np_dt) for k in range(kernel.nin)}
            return found
    return {}


_UFUNC_VARIANTS: dict = {}


def _static_dtype(v: Value) -> Optional[np.dtype]:
    try:
        return np.dtype(v.type.dtype.numpy)
    except Exception:  # noqa: BLE001 - no type, or a dtype numpy does not know: no variant
        return None


def _static_nbytes(t) -> float:
    """The byte size of a value of type ``t`` when its shape and dtype are static, else inf."""
    shape = getattr(t, "shape", None)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return float("inf")
    try:
        itemsize = np.dtype(t.dtype.numpy).itemsize
    except Exception:  # noqa: BLE001 - a dtype numpy does not know
        return float("inf")
    n = itemsize
    for d in shape:
        n *= d
    return n


def _same_shape(a, b) -> bool:
    """Both static shapes known and equal (the same symbol is the same size in one run)."""
    if a is b:  # a loaded graph shares one TensorType object per distinct type
        return a is not None and a.shape is not None and None not in a.shape
    sa, sb = getattr(a, "shape", None), getattr(b, "shape", None)
    return sa is not None and sb is not None and None not in sa and tuple(sa) == tuple(sb)


def _may_fit(a, b) -> bool:
    """False when static shapes prove an input of type ``a`` cannot hold an output of type ``b``."""
    if a is b:
        return True
    sa, sb = getattr(a, "shape", None), getattr(b, "shape", None)
    if sa is None or sb is None:
        return True
    if len(sa) != len(sb):
        return False
    return all(x is None or y is None or isinstance(x, str) or isinstance(y, str) or x == y
               for x, y in zip(sa, sb))


def _fits(shape: tuple, into: tuple) -> bool:
    """An operand of ``shape`` broadcasts against ``into`` without growing it."""
    if shape == into:
        return True
    n = len(shape)
    return n <= len(into) and all(a == 1 or a == b for a, b in zip(shape, into[len(into) - n:]))


def ufunc_inplace(fn: Callable[..., Any], k: int, nin: int, dtype: np.dtype) -> Kernel:
    """An in-place variant of ``fn(*args, out=None)`` (a ufunc, or a function that passes ``out``
    to one) for ``nin`` arguments of ``dtype`` whose result has ``dtype`` too.

    It writes into ``args[k]`` when that is a writeable ndarray of ``dtype``, the other argument
    has ``dtype`` and broadcasts into it without growing it (the result then has its shape and
    dtype); otherwise it returns ``fn(*args)``, a new array."""
    if nin == 1:
        def unary_into(x):
            if type(x) is np.ndarray and x.dtype == dtype and x.flags.writeable:
                return fn(x, out=x)
            return fn(x)
        return unary_into
    if nin != 2:
        raise ValueError(f"ufunc_inplace handles 1 or 2 arguments, not {nin}")

    def binary_into(a, b):
        x, y = (a, b) if k == 0 else (b, a)
        if type(x) is np.ndarray and x.dtype == dtype and y.dtype == dtype and x.flags.writeable \
                and _fits(y.shape, x.shape):
            return fn(a, b, out=x)
        return fn(a, b)
    return binary_into


def outer_values(node: Node) -> list:
    """Values defined outside ``node``'s subgraphs that the subgraphs read."""
    found = []
    for sg in node.subgraphs():
        defined = set()
        for g in sg.all_graphs():
            defined.update(g.values())
        for inner in sg.walk():
            found.extend(v for v in inner.inputs if v is not None and v not in defined)
        for g in sg.all_graphs():
            found.extend(v for v in g.outputs if v not in defined)
    return list(dict.fromkeys(found))


def execute(plan: Plan, slots: list) -> None:
    """Run every instruction of ``plan`` over ``slots`` (one run's copy of the template)."""
    for kernel, inputs, outputs, release, kind in plan.steps:
        if kind == _BINARY:  # the common cases first, each one line of work (see ``_step``)
            a, b = inputs
            slots[outputs] = kernel(slots[a], slots[b])
        elif kind == _UNARY:
            slots[outputs] = kernel(slots[inputs])
        elif kind == _TERNARY:
            a, b, c = inputs
            slots[outputs] = kernel(slots[a], slots[b], slots[c])
        else:
            args = [slots[s] for s in inputs]
            result = kernel(slots, *args) if kind >= 2 else kernel(*args)
            if kind & 1:
                for s, r in zip(outputs, result):
                    slots[s] = r
            else:
                slots[outputs] = result
        if release:
            for s in release:
                slots[s] = None


# What kernels run their nested plans (If/Loop bodies, fused bodies) with. ``kiln.runtime.profile`` sets
# it, in its own context (so for its own thread only) and only while it traces a run, to a loop that
# times each instruction: a trace then shows the bodies' instructions too. Such a kernel reads it once
# per call through ``nested_executor`` (a Loop once, not per iteration); the plan's own loop above
# stays free of instrumentation.
NESTED_EXECUTOR: ContextVar = ContextVar("kiln_nested_executor", default=None)


def nested_executor() -> Callable[[Plan, list], None]:
    """``execute``, or the profiler's timed loop while it traces a run in this context."""
    return NESTED_EXECUTOR.get() or execute


# --------------------------------------------------------------------------- memory budget (issue 16)

# Ops whose CPU kernels return views of an input (no new buffer): they add nothing to a run's
# memory. Every other kernel's outputs are counted in full, so the estimate errs high, never low
# (in-place variants and numpy's own views make the real peak smaller).
VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Slice", "Split",
                      "Dropout", "Shape", "Size"})


class MemoryEstimate:
    """The peak bytes of the buffers a run of a plan allocates, from the value types the plan was
    built from: at each instruction its outputs are added and the values dying there (liveness)
    taken off; the estimate is the largest total. Graph inputs (the caller's arrays) and
    constants (mapped from the file) are not counted; If/Loop outputs are, their bodies' own
    temporaries are not; a dim that is neither an int nor a symbol bound by the inputs (a
    data-dependent size) counts as 0, so such values can pass unseen.

    ``static`` is the estimate when every counted dim is an int (the plan has one size), else
    None and ``peak(bindings)`` computes it once the inputs bind the symbols."""

    def __init__(self, plan: "Plan", template: list, types: dict):
        self.steps = []  # (((itemsize, dims) per output), released slots)
        self.sizes: dict[int, tuple] = {}
        symbolic = False
        for ins in plan.instructions:
            outs = []
            view = ins.node.domain == "" and ins.node.op in VIEW_OPS
            for s in ins.outputs:
                t = types.get(s)
                size = None if view or t is None else _size_of(t)
                if size is not None:
                    self.sizes[s] = size
                    outs.append((s, size))
                    symbolic = symbolic or any(isinstance(d, str) for d in size[1])
            self.steps.append((tuple(outs), tuple(s for s in ins.release if s in self.sizes)))
        self.static = None if symbolic else self.peak({})

    def peak(self, bindings: dict) -> int:
        nbytes = {s: _bytes(size, bindings) for s, size in self.sizes.items()}
        live = top = 0
        for outs, release in self.steps:
            for s, _ in outs:
                live += nbytes[s]
            if live > top:
                top = live
            for s in release:
                live -= nbytes[s]
        return top


def _size_of(t) -> Optional[tuple]:
    """(itemsize, dims) of a value of type ``t``, or None if its rank or dtype is unknown."""
    if t is None or t.shape is None:
        return None
    try:
        itemsize = np.dtype(t.dtype.numpy).itemsize
    except Exception:  # noqa: BLE001 - a dtype numpy does not know (bfloat16 without ml_dtypes)
        itemsize = 2
    return itemsize, tuple(t.shape)


def _bytes(size: tuple, bindings: dict) -> int:
    n, dims = size
    for d in dims:
        if isinstance(d, str):
            d = bindings.get(d)
        if not isinstance(d, int):
            return 0
        n *= d
    return n
