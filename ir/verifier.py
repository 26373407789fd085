"""``verify(graph)``: the checkpoint before and after every pass.

Checks SSA (one definition per value, unique names across subgraphs), topological order and
scoping (a node reads only values defined earlier in its graph or in an enclosing graph),
schemas (op known at the graph's opset, input/output counts, attribute kinds, input dtypes and
the ranks an input parameter declares, e.g. Reshape's 1-D ``shape``), types (every value typed,
initializers matching their arrays, optionally that re-running inference agrees with the
recorded types) and that use lists mirror node inputs.
Raises VerifyError listing every problem, each naming its node.

Time and memory are linear in the graph (issue 16): one scope set for the whole walk (a
subgraph's values are taken out again when it ends, never a copy of the enclosing scope per
subgraph), O(1) use lookups, and node descriptions built only for a problem. ``deadline`` (a
``time.monotonic()`` value) stops a verification that runs past it.
"""
from __future__ import annotations

import time
from typing import Optional

from kiln.errors import KilnError, VerifyError
from kiln.ir.graph import Graph, Node, Value, normalize_attrs
from kiln.ir.registry import InferContext, normalize_inferred
from kiln.ir.types import TensorType, dims_compatible

_MAX_REPORTED = 20
_CLOCK_EVERY = 1024  # nodes between two looks at the clock


def verify(graph: Graph, *, require_types: bool = True, check_inference: bool = True,
           deadline: Optional[float] = None) -> None:
    """Raise VerifyError if ``graph`` breaks an IR invariant; return None if it is sound.
    With ``deadline`` (``time.monotonic()`` seconds), a verification still running then stops
    with a VerifyError saying so."""
    problems: list[str] = []
    _Verifier(problems, require_types, check_inference, deadline).graph(graph, visible=set(), names=set())
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise VerifyError(f"graph '{graph.name}' is invalid:\n  " + "\n  ".join(problems[:_MAX_REPORTED]) + more)


class _Verifier:
    def __init__(self, problems: list[str], require_types: bool, check_inference: bool,
                 deadline: Optional[float] = None):
        self.problems = problems
        self.require_types = require_types
        self.check_inference = check_inference
        self.deadline = deadline
        self.countdown = _CLOCK_EVERY
        # Elementwise ops infer from their attributes and input types alone (no constants, no symbols): one
        # inference per distinct (op, attributes, input types) in a graph, not one per node (a model repeats
        # the same layer; a 30k-node chain of Add/Mul/Relu had three).
        self.elementwise_inferred: dict = {}

    def fail(self, msg: str) -> None:
        self.problems.append(msg)

    def define(self, v: Value, g: Graph, visible: set, names: set, what) -> bool:
        """Put ``v`` in scope; True if it was not there yet. ``what`` may be a callable giving
        the description, so that nothing is formatted for a sound value."""
        if v.name in names:
            self.fail(f"value name '{v.name}' ({_text(what)}) is defined more than once")
        names.add(v.name)
        fresh = v not in visible
        visible.add(v)
        if v.graph is not g:
            self.fail(f"value '{v.name}' ({_text(what)}) belongs to graph '{v.graph.name}', not '{g.name}'")
        if self.require_types and v.type is None:
            self.fail(f"value '{v.name}' ({_text(what)}) has no type")
        return fresh

    def graph(self, g: Graph, visible: set, names: set) -> None:
        """Check ``g`` with ``visible`` the values of the enclosing scopes. The values ``g``
        defines are added to ``visible`` and, for a subgraph, taken out again at its end."""
        added: list = []
        for v in g.inputs:
            if self.define(v, g, visible, names, f"input of graph '{g.name}'"):
                added.append(v)
        for name, v in g.initializers.items():
            if self.define(v, g, visible, names, "initializer"):
                added.append(v)
            if name != v.name:
                self.fail(f"initializer key '{name}' differs from its value name '{v.name}'")
            if v.const is None:
                self.fail(f"initializer '{v.name}' has no data")
            elif v.type is not None and v.type != TensorType.of(v.const):
                self.fail(f"initializer '{v.name}' is typed {v.type} but holds {TensorType.of(v.const)}")
        for node in g.nodes:
            self.node(node, g, visible, names, added)
        for v in g.outputs:
            if v not in visible:
                self.fail(f"output '{v.name}' of graph '{g.name}' is not defined in scope")
        if g.parent is not None:
            visible.difference_update(added)

    def node(self, node: Node, g: Graph, visible: set, names: set, added: list) -> None:
        self.countdown -= 1
        if self.countdown <= 0:
            self.countdown = _CLOCK_EVERY
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise VerifyError(f"graph '{g.name}': verification ran past its time budget "
                                  f"(stopped at {node.describe()})")
        if node.graph is not g:
            self.fail(f"{node.describe()} belongs to graph '{node.graph.name}', not '{g.name}'")
        try:
            schema = node.schema
        except KilnError as e:
            self.fail(f"{node.describe()}: {e}")
            return
        n_in = len(node.inputs)
        if n_in < schema.min_inputs or (schema.max_inputs is not None and n_in > schema.max_inputs):
            self.fail(f"{node.describe()}: has {n_in} inputs, {schema.qualified_name} takes "
                      f"{schema.min_inputs}..{schema.max_inputs if schema.max_inputs is not None else 'n'}")
        for i, v in enumerate(node.inputs):
            self.node_input(node, schema, i, v, visible)
        try:
            normalize_attrs(schema, node.attrs, node.op)
        except KilnError as e:
            self.fail(f"{node.describe()}: {e}")
        for sg in node.subgraphs():
            if sg.parent is not g:
                self.fail(f"{node.describe()}: subgraph '{sg.name}' does not name graph '{g.name}' as its parent")
            self.graph(sg, visible, names)
        for v in node.outputs:
            if self.define(v, g, visible, names, lambda: f"output of {node.describe()}"):
                added.append(v)
            if v.producer is not node:
                self.fail(f"{node.describe()}: output '{v.name}' does not point back to its producer")
        if self.check_inference and all(v.type is not None for v in node.outputs):
            self.inference_agrees(node, schema)

    def node_input(self, node: Node, schema, i: int, v, visible: set) -> None:
        if v is None:
            try:
                optional = schema.input_param(i).optional
            except IndexError:
                optional = False
            if not optional:
                self.fail(f"{node.describe()}: required input {i} is missing")
            return
        if v not in visible:
            self.fail(f"{node.describe()}: input {i} '{v.name}' is not defined before this node (or not in scope)")
        if (node, i) not in v._uses:
            self.fail(f"{node.describe()}: input {i} '{v.name}' does not list the node among its uses")
        try:
            param = schema.input_param(i)
        except IndexError:
            return
        t = v.type
        if t is None:
            return
        if t.dtype not in param.types:
            allowed = ", ".join(sorted(str(t) for t in param.types))
            self.fail(f"{node.describe()}: input {i} ('{param.name}') is {t.dtype}; allowed: {allowed}")
        # The forms kernels rely on (issue 16): a rank the parameter declares, checked whenever
        # the rank is known (always for a constant), so no kernel sees a 2-D shape operand.
        if param.ranks is not None and t.shape is not None and len(t.shape) not in param.ranks:
            self.fail(f"{node.describe()}: input {i} ('{param.name}') '{v.name}' has rank {len(t.shape)} "
                      f"({t}); {schema.qualified_name} takes {param.describe_ranks()}")
        elif param.max_elements is not None and t.shape is not None and all(isinstance(d, int) for d in t.shape):
            count = 1
            for d in t.shape:
                count *= d
            if count > param.max_elements:
                self.fail(f"{node.describe()}: input {i} ('{param.name}') '{v.name}' has {count} elements "
                          f"({t}); {schema.qualified_name} takes at most {param.max_elements}")

    def inference_agrees(self, node: Node, schema) -> None:
        types = [None if v is None else v.type for v in node.inputs]
        key = None
        if "elementwise" in schema.traits:
            try:
                key = (schema.name, schema.since_version, tuple(sorted(node.attrs.items())), tuple(types),
                       len(node.outputs))
                hash(key)
            except TypeError:  # an unhashable attribute value (an array): inferred as any other node
                key = None
        inferred = self.elementwise_inferred.get(key) if key is not None else None
        if inferred is None:
            consts = [None if v is None else v.const for v in node.inputs]
            try:
                ctx = InferContext(node, schema, types, consts)
                inferred = normalize_inferred(ctx, schema.infer(ctx))
            except Exception as e:  # noqa: BLE001 - any inference failure is a verify failure
                self.fail(f"{node.describe()}: shape inference fails: {e}")
                return
            if key is not None:
                self.elementwise_inferred[key] = inferred
        for v, t in zip(node.outputs, inferred):
            if t is None or v.type is None:
                continue
            if t.dtype is not v.type.dtype:
                self.fail(f"{node.describe()}: output '{v.name}' is typed {v.type}, inference gives {t}")
            elif t.shape is not None and v.type.shape is not None and (
                    len(t.shape) != len(v.type.shape)
                    or not all(dims_compatible(a, b) for a, b in zip(t.shape, v.type.shape))):
                self.fail(f"{node.describe()}: output '{v.name}' is typed {v.type}, inference gives {t}")


def _text(what) -> str:
    return what() if callable(what) else what
