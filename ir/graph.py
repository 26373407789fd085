"""The IR data structures: Value, Node and Graph (typed SSA with nested subgraphs).

Invariants kept by construction (the rest are checked by ``kiln.ir.verify``):
- a Value is defined once: as a graph input, an initializer or one output of one node;
- ``value.uses`` always mirrors every node's ``inputs`` (set through ``Node.inputs`` /
  ``Node.set_input``, never by hand), so users/producers cannot drift;
- names are unique across a graph and all of its subgraphs (one namer per root graph).
Subgraphs (the bodies of If/Loop) may read values of enclosing graphs directly.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from kiln.errors import KilnError
from kiln.ir.dtypes import DType
from kiln.ir.registry import ONNX_DOMAIN, AttrKind, OpSchema, get_schema
from kiln.ir.types import Dim, TensorType
from kiln.ir.versions import IR_VERSION, OPSET_VERSION
from kiln.version import __version__


class Value:
    """An SSA value: a name, a type (None until inferred) and where it comes from."""

    __slots__ = ("name", "type", "graph", "producer", "index", "const", "_uses")

    def __init__(self, name: str, type: Optional[TensorType], graph: "Graph"):
        self.name = name
        self.type = type
        self.graph = graph
        self.producer: Optional[Node] = None
        self.index = 0
        self.const: Optional[np.ndarray] = None
        # (node, input position) -> None: an insertion-ordered set, so that adding, removing and
        # testing one use is O(1) however many uses a value has (issue 16: a list made loading a
        # value read 80k times quadratic).
        self._uses: dict[tuple[Node, int], None] = {}

    @property
    def uses(self) -> tuple:
        """Every (node, input position) reading this value, subgraph nodes included."""
        return tuple(self._uses)

    @property
    def users(self) -> list["Node"]:
        """Distinct nodes reading this value, in first-use order."""
        return list(dict.fromkeys(n for n, _ in self._uses))

    @property
    def is_initializer(self) -> bool:
        return self.const is not None

    @property
    def is_graph_input(self) -> bool:
        return self.producer is None and self.const is None

    @property
    def dtype(self) -> Optional[DType]:
        return None if self.type is None else self.type.dtype

    @property
    def shape(self) -> Optional[tuple]:
        return None if self.type is None else self.type.shape

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}" if self.type is not None else f"%{self.name}"


AttrValue = Union[int, float, str, tuple, np.ndarray, "Graph"]


class Node:
    """One op application. ``inputs`` may hold ``None`` for an omitted optional input."""

    __slots__ = ("op", "domain", "name", "graph", "attrs", "meta", "outputs", "_inputs", "_prev", "_next", "_list")

    def __init__(self, graph: "Graph", op: str, domain: str, name: str, attrs: dict):
        self.graph = graph
        self.op = op
        self.domain = domain
        self.name = name
        self.attrs: dict[str, AttrValue] = attrs
        self.meta: dict[str, str] = {}
        self.outputs: list[Value] = []
        self._inputs: tuple[Optional[Value], ...] = ()
        # Links of the graph's NodeList (None while the node is in no list).
        self._prev: Optional[Node] = None
        self._next: Optional[Node] = None
        self._list: Optional[NodeList] = None

    # ---- inputs, kept in step with Value.uses
    @property
    def inputs(self) -> tuple:
        return self._inputs

    @inputs.setter
    def inputs(self, values: Sequence[Optional[Value]]) -> None:
        self._detach_inputs()
        self._inputs = tuple(values)
        for i, v in enumerate(self._inputs):
            if v is not None:
                v._uses[(self, i)] = None

    def set_input(self, i: int, value: Optional[Value]) -> None:
        new = list(self._inputs)
        new[i] = value
        self.inputs = new

    def replace_input(self, old: Value, new: Optional[Value]) -> None:
        self.inputs = [new if v is old else v for v in self._inputs]

    def _detach_inputs(self) -> None:
        for i, v in enumerate(self._inputs):
            if v is not None:
                del v._uses[(self, i)]

    # ---- schema and helpers
    @property
    def schema(self) -> OpSchema:
        return get_schema(self.op, self.domain, self.graph.opset_version)

    @property
    def qualified_op(self) -> str:
        return f"{self.domain}.{self.op}" if self.domain else self.op

    @property
    def output(self) -> Value:
        """The single output (error if the node has several)."""
        if len(self.outputs) != 1:
            raise KilnError(f"{self.describe()} has {len(self.outputs)} outputs, not 1")
        return self.outputs[0]

    def attr(self, name: str) -> Any:
        """An attribute with the schema default filled in."""
        if name in self.attrs:
            return self.attrs[name]
        return self.schema.attrs[name].default

    def subgraphs(self) -> Iterator["Graph"]:
        """Graph-valued attributes in attribute-name order (a canonical order: walks, value
        numbering and saved files do not depend on the order attributes were set in)."""
        for k in sorted(self.attrs):
            if isinstance(self.attrs[k], Graph):
                yield self.attrs[k]

    def describe(self) -> str:
        """How errors name this node: ``node 'conv_3' (Conv) at layer1.0.conv1``."""
        where = self.meta.get("scope")
        src = self.meta.get("source")
        s = f"node '{self.name}' ({self.qualified_op})"
        if where:
            s += f" at {where}"
        if src:
            s += f" [{src}]"
        return s

    def __repr__(self) -> str:
        return f"<Node {self.name}: {self.qualified_op}>"


class NodeList:
    """A graph's nodes in order: a doubly linked list (torch.fx's design), so that appending, removing a node
    and inserting one before or after another are O(1) however large the graph (a Python list made each
    removal a search: DCE of a 32k-node chain took 19 s). Iterating is in order and survives removing the
    node just yielded. Indexing (``nodes[i]``, ``nodes[-1]``, slices) is O(n), for tests and printing; passes
    edit through the Graph (``remove_node``, ``add_node(before=/after=)``, ``move_before``) or these methods.
    A node is in at most one list; adding it to another first takes it out of the one it is in.

    Each list also keeps the set of its nodes holding subgraphs (Graph-valued attributes, which are set when
    a node is created): :meth:`Graph.graphs_unordered` walks those instead of every node."""

    __slots__ = ("_head", "_tail", "_len", "holders")

    def __init__(self, nodes: Iterable[Node] = ()):
        self._head: Optional[Node] = None
        self._tail: Optional[Node] = None
        self._len = 0
        self.holders: dict[Node, None] = {}
        for n in nodes:
            self.append(n)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, node: object) -> bool:
        return isinstance(node, Node) and node._list is self

    def __iter__(self) -> Iterator[Node]:
        cur = self._head
        while cur is not None:
            nxt = cur._next
            yield cur
            if cur._list is self:  # still here: its successor now (a node may have been inserted after it)
                nxt = cur._next
            cur = nxt

    def __reversed__(self) -> Iterator[Node]:
        cur = self._tail
        while cur is not None:
            prv = cur._prev
            yield cur
            if cur._list is self:
                prv = cur._prev
            cur = prv

    def __getitem__(self, i):
        items = list(self)
        return items[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (NodeList, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"NodeList({list(self)!r})"

    def reverse(self) -> None:
        """Reverse the order in place (linear; tests use it to break topological order on purpose)."""
        for n in list(self)[::-1]:
            self.append(n)

    def index(self, node: Node) -> int:
        for i, n in enumerate(self):
            if n is node:
                return i
        raise ValueError(f"{node.describe()} is not in this node list")

    def _claim(self, node: Node) -> None:
        if node._list is not None:
            node._list.remove(node)
        node._list = self
        self._len += 1
        for a in node.attrs.values():
            if isinstance(a, Graph):
                self.holders[node] = None
                break

    def append(self, node: Node) -> None:
        self._claim(node)
        node._prev, node._next = self._tail, None
        if self._tail is None:
            self._head = node
        else:
            self._tail._next = node
        self._tail = node

    def extend(self, nodes: Iterable[Node]) -> None:
        for n in list(nodes):
            self.append(n)

    def insert_before(self, anchor: Node, node: Node) -> None:
        if anchor._list is not self:
            raise KilnError(f"{anchor.describe()} is not in this graph's nodes")
        if node is anchor:
            return
        self._claim(node)
        prev = anchor._prev
        node._prev, node._next = prev, anchor
        anchor._prev = node
        if prev is None:
            self._head = node
        else:
            prev._next = node

    def insert_after(self, anchor: Node, node: Node) -> None:
        if anchor._list is not self:
            raise KilnError(f"{anchor.describe()} is not in this graph's nodes")
        if node is anchor:
            return
        nxt = anchor._next
        if nxt is None:
            self.append(node)
        else:
            self.insert_before(nxt, node)

    def remove(self, node: Node) -> None:
        if node._list is not self:
            raise KilnError(f"{node.describe()} is not in this graph's nodes")
        prev, nxt = node._prev, node._next
        if prev is None:
            self._head = nxt
        else:
            prev._next = nxt
        if nxt is None:
            self._tail = prev
        else:
            nxt._prev = prev
        node._prev = node._next = None
        node._list = None
        self._len -= 1
        self.holders.pop(node, None)

    def clear(self) -> None:
        for n in list(self):
            self.remove(n)


@dataclass
class Metadata:
    """Where a graph came from, plus free string key/values (kept through save/load)."""

    producer_name: str = "kiln"
    producer_version: str = __version__
    doc_string: str = ""
    props: dict = field(default_factory=dict)


class _Namer:
    """Unique, stable names for one root graph and all its subgraphs."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.counters: dict[str, itertools.count] = {}

    def fresh(self, hint: str) -> str:
        hint = re.sub(r"\s+", "_", hint) or "v"
        if hint not in self.used:
            self.used.add(hint)
            return hint
        base = re.sub(r"_\d+$", "", hint)
        counter = self.counters.setdefault(base, itertools.count(1))
        while True:
            name = f"{base}_{next(counter)}"
            if name not in self.used:
                self.used.add(name)
                return name

    def claim(self, name: str) -> str:
        if name in self.used:
            raise KilnError(f"name '{name}' is already used in this graph")
        self.used.add(name)
        return name


class Graph:
    """A typed SSA graph: inputs, initializers, nodes in topological order, outputs."""

    def __init__(self, name: str = "main", *, parent: Optional["Graph"] = None,
                 opset_version: int = OPSET_VERSION):
        self.name = name
        self.parent = parent
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self._nodes = NodeList()
        self.initializers: dict[str, Value] = {}
        self.metadata = Metadata()
        self.ir_version = IR_VERSION
        self._opset_version = opset_version
        self._value_names = _Namer() if parent is None else parent.root._value_names
        self._node_names = _Namer() if parent is None else parent.root._node_names

    @property
    def nodes(self) -> NodeList:
        """The nodes in topological order (a :class:`NodeList`: O(1) edits)."""
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: Iterable[Node]) -> None:
        """Replace the order wholesale (linear): each node is taken out of the list it was in."""
        new = NodeList()
        for n in list(nodes):
            new.append(n)
            n.graph = self
        self._nodes.clear()
        self._nodes = new

    def graphs_unordered(self) -> Iterator["Graph"]:
        """This graph and every subgraph, without walking every node (through each list's subgraph
        holders); the order is not the nodes' order: for membership questions, not for output."""
        yield self
        for n in self._nodes.holders:
            for sg in n.subgraphs():
                yield from sg.graphs_unordered()

    # ---- scope
    @property
    def root(self) -> "Graph":
        g = self
        while g.parent is not None:
            g = g.parent
        return g

    @property
    def opset_version(self) -> int:
        return self.root._opset_version

    @opset_version.setter
    def opset_version(self, v: int) -> None:
        self.root._opset_version = v

    def subgraph(self, name: str = "body") -> "Graph":
        """A new empty graph nested in this one (for If branches and Loop bodies)."""
        return Graph(self._node_names.fresh(name), parent=self)

    def all_graphs(self) -> Iterator["Graph"]:
        """This graph and every subgraph, depth first (parents before children)."""
        yield self
        for n in self.nodes:
            for sg in n.subgraphs():
                yield from sg.all_graphs()

    def walk(self) -> Iterator[Node]:
        """Every node of this graph and its subgraphs, depth first."""
        for g in self.all_graphs():
            yield from g.nodes

    def is_ancestor_of(self, other: "Graph") -> bool:
        g: Optional[Graph] = other
        while g is not None:
            if g is self:
                return True
            g = g.parent
        return False

    # ---- names
    def fresh_name(self, hint: str) -> str:
        return self._value_names.fresh(hint)

    def _new_value(self, name: Optional[str], type: Optional[TensorType], hint: str) -> Value:
        name = self._value_names.claim(name) if name is not None else self._value_names.fresh(hint)
        return Value(name, type, self)

    # ---- building
    def add_input(self, name: str, dtype: "DType | str", shape: Optional[Iterable[Dim]] = None) -> Value:
        v = self._new_value(name, TensorType(dtype, shape), name)
        self.inputs.append(v)
        return v

    def add_initializer(self, name: str, array: Any) -> Value:
        """A named constant. ``array`` is kept as is when it is already a numpy array (no copy)."""
        return self._initializer(name, array, name)

    def add_constant(self, array: Any, hint: str = "const") -> Value:
        """An initializer with a fresh name derived from ``hint``."""
        return self._initializer(None, array, hint)

    def _initializer(self, name: Optional[str], array: Any, hint: str) -> Value:
        arr = array if isinstance(array, np.ndarray) else np.asarray(array)
        v = self._new_value(name, TensorType.of(arr), hint)
        v.const = arr
        self.initializers[v.name] = v
        return v

    def add_node(self, op: str, inputs: Sequence[Optional[Value]] = (), attrs: Optional[dict] = None, *,
                 domain: str = ONNX_DOMAIN, num_outputs: Optional[int] = None, name: Optional[str] = None,
                 output_names: Optional[Sequence[str]] = None, output_types: Optional[Sequence] = None,
                 before: Optional[Node] = None, after: Optional[Node] = None,
                 meta: Optional[dict] = None) -> Node:
        """Create a node, append it (or insert it before/after a node), return it.

        Attributes are checked against the op's schema and normalized (ints stay ints, lists
        become tuples, floats become float). Output types are left None unless given; run
        shape inference (or use :meth:`op`) to fill them.
        """
        schema = get_schema(op, domain, self.opset_version)
        node = Node(self, op, domain, self._node_names.fresh(name or op.lower()),
                    normalize_attrs(schema, attrs or {}, op))
        if meta:
            node.meta.update(meta)
        if output_names is not None:
            n_out = len(output_names)
        elif num_outputs is not None:
            n_out = num_outputs
        else:
            n_out = sum(1 for p in schema.outputs if not p.optional) or 1
        for i in range(n_out):
            t = output_types[i] if output_types is not None else None
            if output_names is not None:
                v = self._new_value(output_names[i], t, "")
            else:
                v = self._new_value(None, t, node.name if n_out == 1 else f"{node.name}_{i}")
            v.producer, v.index = node, i
            node.outputs.append(v)
        node.inputs = list(inputs)
        self._place(node, before, after)
        return node

    def _append_decoded(self, op: str, domain: str, name: Optional[str], attrs: dict, inputs: list,
                        outputs: Sequence[tuple]) -> Node:
        """Append a node read from a file (serializer/reader.py): ``attrs`` already of their
        canonical Python types, ``outputs`` (name, type) pairs. The schema-level checks that
        :meth:`add_node` makes here (op known, attribute names and kinds) are the verifier's,
        which every load runs; this path only keeps the structural invariants (unique names,
        producers, uses), at a fraction of add_node's cost per node (issue 16)."""
        node = Node(self, op, domain, self._node_names.fresh(name or op.lower()), attrs)
        claim = self._value_names.claim
        outs = node.outputs
        for i, (vname, t) in enumerate(outputs):
            v = Value(claim(vname), t, self)
            v.producer, v.index = node, i
            outs.append(v)
        node._inputs = tuple(inputs)
        for i, v in enumerate(node._inputs):
            if v is not None:
                v._uses[(node, i)] = None
        self._nodes.append(node)
        return node

    def op(self, op: str, *inputs: Optional[Value], domain: str = ONNX_DOMAIN, outputs: Optional[int] = None,
           name: Optional[str] = None, **attrs: Any) -> Any:
        """Builder shorthand: add a node, infer its output types, return its output value
        (or a tuple of them when it has several). ``g.op("Gemm", x, w, b, transB=1)``."""
        node = self.add_node(op, inputs, attrs, domain=domain, num_outputs=outputs, name=name)
        from kiln.ir.passes.shape_inference import infer_node
        infer_node(node)
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)

    def _place(self, node: Node, before: Optional[Node], after: Optional[Node]) -> None:
        for anchor in (before, after):
            if anchor is not None and anchor._list is not self._nodes:
                raise KilnError(f"{anchor.describe()} is not in graph '{self.name}'")
        if before is not None:
            self._nodes.insert_before(before, node)
        elif after is not None:
            self._nodes.insert_after(after, node)
        else:
            self._nodes.append(node)

    # ---- editing
    def replace_all_uses_with(self, old: Value, new: Value) -> int:
        """Make every reader of ``old`` (subgraphs and graph outputs too) read ``new``.
        Returns the number of uses rewired."""
        count = 0
        # Each reading node once (a node reading ``old`` k times is rewired in one step, not k
        # scans of its inputs: a Sum of 80k copies of one value stays linear).
        for node in old.users:
            node.replace_input(old, new)
            count += 1
        for g in self.root.graphs_unordered():
            for i, v in enumerate(g.outputs):
                if v is old:
                    g.outputs[i] = new
                    count += 1
        return count

    def remove_node(self, node: Node, *, force: bool = False) -> None:
        """Remove ``node``; unless ``force``, its outputs must be unused."""
        if not force:
            for v in node.outputs:
                if v._uses or self._is_any_output(v):
                    raise KilnError(f"cannot remove {node.describe()}: output '{v.name}' is still used")
        if node._list is not self._nodes:
            raise KilnError(f"{node.describe()} is not in graph '{self.name}'")
        self._nodes.remove(node)
        node._detach_inputs()
        node._inputs = ()
        for sg in node.subgraphs():
            for inner in list(sg.walk()):
                inner._detach_inputs()
                inner._inputs = ()

    def remove_initializer(self, value: Value) -> None:
        if value._uses or self._is_any_output(value):
            raise KilnError(f"cannot remove initializer '{value.name}': still used")
        del self.initializers[value.name]

    def _is_any_output(self, v: Value) -> bool:
        return any(v is o for g in self.root.graphs_unordered() for o in g.outputs)

    def move_before(self, node: Node, anchor: Node) -> None:
        if node._list is not self._nodes:
            raise KilnError(f"{node.describe()} is not in graph '{self.name}'")
        self._nodes.insert_before(anchor, node)

    # ---- queries
    def values(self) -> Iterator[Value]:
        """Every value defined in this graph (not subgraphs): inputs, initializers, outputs of nodes."""
        yield from self.inputs
        yield from self.initializers.values()
        for n in self.nodes:
            yield from n.outputs

    def find_value(self, name: str) -> Value:
        for g in self.all_graphs():
            for v in g.values():
                if v.name == name:
                    return v
        raise KilnError(f"no value named '{name}' in graph '{self.name}'")

    def find_node(self, name: str) -> Node:
        for n in self.walk():
            if n.name == name:
                return n
        raise KilnError(f"no node named '{name}' in graph '{self.name}'")

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.walk():
            counts[n.qualified_op] = counts.get(n.qualified_op, 0) + 1
        return counts

    # ---- copying and printing
    def copy(self) -> "Graph":
        """A structural deep copy; initializer arrays are shared, not copied."""
        new = Graph(self.name, opset_version=self.opset_version)
        new.metadata = Metadata(self.metadata.producer_name, self.metadata.producer_version,
                                self.metadata.doc_string, dict(self.metadata.props))
        new.ir_version = self.ir_version
        self._copy_body_into(new, {})
        return new

    def _copy_body_into(self, new: "Graph", vmap: dict) -> None:
        for v in self.inputs:
            nv = new._new_value(v.name, v.type, "")
            new.inputs.append(nv)
            vmap[v] = nv
        for v in self.initializers.values():
            nv = new.add_initializer(v.name, v.const)
            nv.type = v.type
            vmap[v] = nv
        for n in self.nodes:
            attrs = {}
            for k, a in n.attrs.items():
                if isinstance(a, Graph):
                    sub = Graph(new._node_names.claim(a.name), parent=new)
                    a._copy_body_into(sub, vmap)
                    attrs[k] = sub
                else:
                    attrs[k] = a
            nn = Node(new, n.op, n.domain, new._node_names.claim(n.name), attrs)
            nn.meta = dict(n.meta)
            for o in n.outputs:
                nv = new._new_value(o.name, o.type, "")
                nv.producer, nv.index = nn, o.index
                nn.outputs.append(nv)
                vmap[o] = nv
            nn.inputs = [None if v is None else vmap[v] for v in n.inputs]
            new._nodes.append(nn)
        new.outputs = [vmap[v] for v in self.outputs]

    def __str__(self) -> str:
        from kiln.ir.printer import format_graph
        return format_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes, {len(self.outputs)} outputs>"


def normalize_attrs(schema: OpSchema, attrs: dict, op: str) -> dict:
    """Check attribute names/kinds against the schema and coerce them to canonical Python types."""
    out = {}
    for k, v in attrs.items():
        spec = schema.attrs.get(k)
        if spec is None:
            known = ", ".join(sorted(schema.attrs)) or "none"
            raise KilnError(f"op {schema.qualified_name} has no attribute '{k}' (attributes: {known})")
        if v is None:
            continue
        out[k] = coerce_attr(spec.kind, v, f"{schema.qualified_name}.{k}")
    for k, spec in schema.attrs.items():
        if spec.required and k not in out:
            raise KilnError(f"op {schema.qualified_name} needs attribute '{k}'")
    return out


def coerce_attr(kind: AttrKind, v: Any, where: str) -> Any:
    try:
        if kind is AttrKind.INT:
            if isinstance(v, (float, np.floating)) and float(v) != int(v):
                raise TypeError
            return int(v)
        if kind is AttrKind.FLOAT:
            return float(v)
        if kind is AttrKind.STRING:
            if not isinstance(v, str):
                raise TypeError
            return v
        if kind is AttrKind.INTS:
            return tuple(int(x) for x in np.asarray(v).reshape(-1).tolist())
        if kind is AttrKind.FLOATS:
            return tuple(float(x) for x in np.asarray(v, dtype=np.float64).reshape(-1).tolist())
        if kind is AttrKind.STRINGS:
            if isinstance(v, str) or not all(isinstance(x, str) for x in v):
                raise TypeError
            return tuple(v)
        if kind is AttrKind.TENSOR:
            return v if isinstance(v, np.ndarray) else np.asarray(v)
        if kind is AttrKind.GRAPH:
            if not isinstance(v, Graph):
                raise TypeError
            return v
    except (TypeError, ValueError):
        pass
    raise KilnError(f"attribute {where} must be {kind.value}, got {type(v).__name__} {v!r:.60}")
