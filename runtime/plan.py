"""The execution plan: a graph lowered once, at load, to a flat list of instructions.

Each instruction holds its kernel (already chosen for the node's op and input dtypes, with its
attributes decoded), the integer slots it reads and writes, and the slots whose values die after
it (liveness), so a run is one loop over a list: no graph walking, no name lookups, no attribute
parsing. Constants live in the slot template that every run copies. Subgraphs (If/Loop bodies)
are lowered into the same slot space, so a body reads outer values by slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from kiln.ir.graph import Graph, Node, Value

Kernel = Callable[..., Any]


@dataclass(frozen=True)
class Instruction:
    kernel: Kernel
    inputs: tuple          # slot per input (-1: an omitted optional input)
    outputs: tuple         # slot per output
    release: tuple         # slots whose values are dead after this instruction
    node: Node             # for error messages only
    single: bool           # the kernel returns one array, not a tuple
    with_slots: bool       # control flow: the kernel also gets the run's slot list first


@dataclass
class Plan:
    instructions: list
    input_slots: tuple
    output_slots: tuple
    none_slot: int = -1    # a slot that always holds None: where omitted optional inputs read

    def __post_init__(self) -> None:
        # What the run loop unpacks per instruction: plain tuples (faster than attribute reads)
        # with omitted inputs pointing at the None slot, so building the arguments needs no test.
        self.steps = [(ins.kernel, tuple(self.none_slot if s < 0 else s for s in ins.inputs),
                       ins.outputs[0] if ins.single else ins.outputs, ins.release,
                       (0 if ins.single else 1) + (2 if ins.with_slots else 0)) for ins in self.instructions]


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

    def build(self, graph: Graph, *, liveness: bool = True) -> Plan:
        """Lower ``graph``; nested graphs are built with ``liveness=False`` (their values stay
        until the owning node ends: a Loop body runs many times)."""
        input_slots = tuple(self.slot(v) for v in graph.inputs)
        for v in graph.initializers.values():
            self.slot(v)
        instructions, reads = [], []
        for node in graph.nodes:
            kernel = self.choose(node, self)
            ins = tuple(-1 if v is None else self.slot(v) for v in node.inputs)
            outs = tuple(self.slot(v) for v in node.outputs)
            instructions.append(Instruction(kernel, ins, outs, (), node, len(outs) == 1,
                                            getattr(kernel, "with_slots", False)))
            reads.append(ins + tuple(self.slot(v) for v in outer_values(node)))
        output_slots = tuple(self.slot(v) for v in graph.outputs)
        if liveness:
            instructions = self._with_liveness(instructions, reads, set(output_slots) | set(input_slots))
        return Plan(instructions, input_slots, output_slots, none_slot=0)

    def _with_liveness(self, instructions: list, reads: list, keep: set) -> list:
        last: dict[int, int] = {}
        for i, (ins, r) in enumerate(zip(instructions, reads)):
            for s in ins.outputs:
                last[s] = i  # a value nobody reads dies right after it is made
            for s in r:
                if s >= 0:
                    last[s] = i
        dying: dict[int, list] = {}
        for s, i in last.items():
            if s not in keep and self.template[s] is None:
                dying.setdefault(i, []).append(s)
        return [Instruction(ins.kernel, ins.inputs, ins.outputs, tuple(sorted(dying.get(i, ()))), ins.node,
                            ins.single, ins.with_slots) for i, ins in enumerate(instructions)]


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
        if kind == 0:  # one output, no slot access: the common case, kept to one line of work
            slots[outputs] = kernel(*[slots[s] for s in inputs])
        else:
            args = [slots[s] for s in inputs]
            result = kernel(slots, *args) if kind >= 2 else kernel(*args)
            if kind & 1:
                for s, r in zip(outputs, result):
                    slots[s] = r
            else:
                slots[outputs] = result
        for s in release:
            slots[s] = None
