"""CPU kernel of ``kiln.FusedElementwise``: the body lowered once, at load, to its own plan.

The CPU gains nothing from fusion itself (numpy still makes one pass per op), but a fused graph
(the CUDA loader's input, or a file saved after fusing) must run here too, at the speed of the
unfused graph: so the body becomes a nested plan with the CPU kernels of its ops, built once,
and each call is one loop over it in a fresh slot list (thread safe, like Program.run). The body
is closed (it reads only its inputs and initializers), so unlike If/Loop bodies it needs no
access to the enclosing run's slots: it gets a PlanBuilder of its own, with liveness and
in-place writes into its intermediates (never into its inputs: the plan keeps those intact).
"""
from __future__ import annotations

from typing import Any

from kiln.ir.graph import Node
from kiln.runtime.kernels.cpu import choose, kernel
from kiln.runtime.plan import PlanBuilder, execute


def _choose_body(node: Node, builder: PlanBuilder):
    return choose(node, node.schema.fill_attrs(node.attrs))


@kernel("FusedElementwise", domain="kiln")
def fused_elementwise(node: Node, attrs: dict):
    builder = PlanBuilder(_choose_body)
    plan = builder.build(attrs["body"])
    template = builder.template
    input_slots, output_slots = plan.input_slots, plan.output_slots
    single = len(output_slots) == 1

    def run(*args: Any) -> Any:
        slots = list(template)
        for s, a in zip(input_slots, args):
            slots[s] = a
        execute(plan, slots)
        if single:
            return slots[output_slots[0]]
        return tuple(slots[s] for s in output_slots)

    return run
