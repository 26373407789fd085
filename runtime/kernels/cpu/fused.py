"""CPU kernel of ``kiln.FusedElementwise``, ``kiln.FusedEpilogue`` and ``kiln.FusedAttention``:
the body lowered once, at load, to its own plan.

The CPU gains nothing from fusion itself (numpy still makes one pass per op), but a fused graph
(the CUDA loader's input, or a file saved after fusing) must run here too, at the speed of the
unfused graph: so the body becomes a nested plan with the CPU kernels of its ops, built once,
and each call is one loop over it in a fresh slot list (thread safe, like Program.run). The body
is closed (it reads only its inputs and initializers), so unlike If/Loop bodies it needs no
access to the enclosing run's slots: it gets a PlanBuilder of its own, with liveness and
in-place writes into its intermediates (never into its inputs: the plan keeps those intact).
A FusedEpilogue body is the same kind of closed body (its anchor, a Conv/Gemm/MatMul, is one
more op of the nested plan), so the same kernel runs it; so is a FusedAttention body (MatMul,
scale, mask Add, Softmax, MatMul: the CPU has no score-free attention kernel to gain from, and
runs the ops as the unfused graph does, the [..., Lq, Lk] scores included).

The exceptions: where the native extension is built, the CPU loader (runtime/program.py) fuses each Conv it
covers with a following activation (Relu, HardSwish, HardSigmoid, Clip, LeakyRelu), and such a body runs as one
native call that applies the activation in the convolution's output pass (native.epilogue_kernel); and it fuses
chains of the elementwise ops the extension has, whose body runs as one native pass over cache-sized chunks
(native.elementwise_kernel; the nested plan stays the fallback for operands it cannot broadcast).

One thing the body hides: which of its inputs are constants. An epilogue's weights are node
inputs (never pulled into the body, whatever their size), and the CPU kernels prepare a constant
weight once at load (Conv's GEMM layout, Gemm's transposed view) and fall back to the reference
for a computed one; choosing the anchor's kernel on the body node alone made ResNet-18 twice and
MobileNetV3 ten times slower than unfused. So a body node reading a body input that stands for
an outer constant gets its kernel chosen on a detached copy of itself reading the outer values
(uses not registered, never part of a graph); the plan still passes the same arrays at run time.
"""
from __future__ import annotations

from typing import Any

from kiln.ir.graph import Node
from kiln.runtime.kernels.cpu import choose, kernel, native
from kiln.runtime.plan import PlanBuilder, nested_executor


def _seeing_constants(inner: Node, consts: dict) -> Node:
    """A detached copy of body node ``inner`` whose inputs that stand for outer constants are
    those outer Values (``consts``: body input -> outer constant Value). Its uses are not
    registered (the inputs are set below the use-tracking setter): only a kernel factory sees it."""
    shadow = Node(inner.graph, inner.op, inner.domain, inner.name, inner.attrs)
    shadow.meta = inner.meta
    shadow.outputs = inner.outputs
    shadow._inputs = tuple(None if v is None else consts.get(v, v) for v in inner.inputs)
    return shadow


@kernel("FusedElementwise", "FusedEpilogue", "FusedAttention", domain="kiln")
def fused_elementwise(node: Node, attrs: dict):
    if node.op == "FusedEpilogue":  # a Conv and its activation in one native call, where the extension has it
        direct = native.epilogue_kernel(node, attrs)
        if direct is not None:
            return direct
    body = attrs["body"]
    consts = {b: v for b, v in zip(body.inputs, node.inputs) if v is not None and v.const is not None}

    def choose_body(inner: Node, builder: PlanBuilder):
        seen = _seeing_constants(inner, consts) if any(v in consts for v in inner.inputs) else inner
        return choose(seen, inner.schema.fill_attrs(inner.attrs))

    builder = PlanBuilder(choose_body)
    plan = builder.build(body)
    template = builder.template
    input_slots, output_slots = plan.input_slots, plan.output_slots
    single = len(output_slots) == 1

    def run(*args: Any) -> Any:
        slots = list(template)
        for s, a in zip(input_slots, args):
            slots[s] = a
        nested_executor()(plan, slots)  # execute, or the profiler's timed loop (plan.NESTED_EXECUTOR)
        if single:
            return slots[output_slots[0]]
        return tuple(slots[s] for s in output_slots)

    if node.op == "FusedElementwise":  # one native pass over the chain, where the extension has its ops
        direct = native.elementwise_kernel(node, attrs, run)
        if direct is not None:
            return direct
    return run
