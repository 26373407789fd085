"""Elementwise fusion: connected groups of elementwise ops become one ``kiln.FusedElementwise``.

Why: on a GPU every op is a kernel launch and a round trip of its output through memory; a
chain such as ``Add -> Relu`` or the ops of a decomposed Gelu/LayerNorm costs one launch and
one read of each input when run as one kernel. The pass only rewrites the graph; a backend
(the CUDA code generator) compiles each body. It is not in the default CPU pipeline.

What forms a group (``fusion_groups``):

- members are ops of ``ops`` (ELEMENTWISE_OPS by default) in the default domain, with one
  output whose shape is fully known (ints and symbols, no unknown dim);
- every member's output has the same shape, the group's shape; so each member's inputs
  broadcast into it without growing it, and every group output (a member output) has the full
  shape. A smaller value feeding a group (a [1, C, 1, 1] bias, a LayerNorm's [B, S, 1] mean) is
  an input of the group, never a member: a kernel over the group's shape computes every member
  once per element, and reads its inputs through broadcast indexing;
- members are connected by producer -> consumer edges, and the group is convex: no path leaves
  the group and comes back (that would make the fused node depend on itself). Groups are grown
  greedily in topological order: a node joins (and may merge) the groups of its producers when
  no path from those groups reaches it through a non-member, else it starts a group of its own;
- shape computations (int64 values of rank <= 1) are left alone: shape inference tracks their
  values symbolically through the plain ops, which a fused node would hide, and they are host
  work anyway;
- ``Clip`` joins only with constant (or omitted) bounds;
- groups of fewer than ``min_ops`` members are left alone.

How a group is rewritten (``fuse_elementwise``): its members move, unchanged (names, attributes,
meta), into the body of a new FusedElementwise node. The node's inputs are the values the members
read from outside, in first-use order, except small constants (initializers of at most
``SMALL_CONSTANT`` elements), which become initializers of the body; large constants stay node
inputs. Its outputs are the member values read outside the group (by other nodes, by nodes of
subgraphs) or that are graph outputs, in member order: these Value objects stay where they are,
names and uses included, and are now produced by the fused node; the body gets its own copies.
The node is named ``fused``/``fused_<k>`` (the graph's namer: deterministic), and carries the first
member's meta (its module scope and source). The graph's nodes are then re-sorted stably into a
topological order. A dead group (nothing outside reads it) is left for DCE. If/Loop bodies are
fused too (recursively; a fused node there may read outer values as its inputs); FusedElementwise
bodies are not entered, and the op is not elementwise, so a second run finds nothing to do.
"""
from __future__ import annotations

import heapq
from typing import Iterable, Optional

from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.ops.fused import FUSED_OP
from kiln.ir.passes._rewrite import graph_outputs
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN

# Elementwise ops of the default domain: each output element depends only on the input elements
# at the same (broadcast) position.
ELEMENTWISE_OPS = frozenset("""
Abs Add And Cast Ceil Clip Cos Div Elu Equal Erf Exp Floor Gelu Greater GreaterOrEqual HardSigmoid
HardSwish IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mul Neg Not Or Pow PRelu Reciprocal
Relu Selu Sigmoid Sign Sin Softplus Softsign Sqrt Sub Sum Tanh Where Xor
""".split())

SMALL_CONSTANT = 64  # initializers of at most this many elements are copied into the body


def fusion_groups(graph: Graph, *, min_ops: int = 2, ops: Iterable[str] = ELEMENTWISE_OPS) -> list:
    """The groups ``fuse_elementwise`` would make in ``graph`` (not its subgraphs): a list of
    member lists, each in the graph's node order, groups ordered by their first member."""
    ops = frozenset(ops)
    index = {n: i for i, n in enumerate(graph.nodes)}
    group_of: dict[Node, int] = {}   # member -> group id (after merges: find())
    parent: dict[int, int] = {}      # union-find over group ids
    bits: dict[int, int] = {}        # root id -> bitmask of the ids merged into it
    members: dict[int, list] = {}    # root id -> members
    shape_of: dict[int, tuple] = {}  # root id -> the group's shape
    into: dict[int, int] = {}        # root id -> bits of groups with a path into the group
    reach: dict[Node, int] = {}      # node -> bits of the groups with a path to it

    def find(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    for node in graph.nodes:
        producers = _producers(node, graph)
        r = 0
        for q in producers:
            r |= reach.get(q, 0)
            if q in group_of:
                r |= bits[find(group_of[q])]
        reach[node] = r
        shape = _fusable_shape(node, ops)
        if shape is None:
            continue
        candidates = list(dict.fromkeys(find(group_of[q]) for q in producers
                                        if q in group_of and shape_of[find(group_of[q])] == shape))
        chosen: list[int] = []
        for g in candidates:
            trial = chosen + [g]
            if _convex_with(node, trial, producers, group_of, find, bits, reach, into):
                chosen = trial
        if chosen:
            root = chosen[0]
            for g in chosen[1:]:
                parent[g] = root
                bits[root] |= bits.pop(g)
                members[root] += members.pop(g)
                into[root] |= into.pop(g)
                shape_of.pop(g)
        else:
            root = len(parent)
            parent[root] = root
            bits[root] = 1 << root
            members[root] = []
            shape_of[root] = shape
            into[root] = 0
        members[root].append(node)
        group_of[node] = root
        into[root] = (into[root] | r) & ~bits[root]
        reach[node] = r | bits[root]
    groups = [sorted(m, key=index.__getitem__) for m in members.values() if len(m) >= min_ops]
    return sorted(groups, key=lambda m: index[m[0]])


def fuse_elementwise(graph: Graph, *, min_ops: int = 2, ops: Iterable[str] = ELEMENTWISE_OPS) -> int:
    """Replace each group of :func:`fusion_groups` in ``graph`` and its If/Loop bodies by one
    FusedElementwise node; returns the number of groups fused."""
    ops = frozenset(ops)
    outputs = graph_outputs(graph.root)
    made = 0
    for g in list(_graphs(graph)):
        groups = fusion_groups(g, min_ops=min_ops, ops=ops)
        if not groups:
            continue
        order_key: dict[Node, int] = {n: i for i, n in enumerate(g.nodes)}
        changed = False
        for members in groups:
            fused = _fuse(g, members, outputs)
            if fused is not None:
                order_key[fused] = max(order_key[m] for m in members)
                made += 1
                changed = True
        if changed:
            _stable_toposort(g, order_key)
    return made


# --------------------------------------------------------------------------- analysis helpers


def _graphs(graph: Graph):
    """``graph`` and the bodies of its If/Loop nodes, recursively; not FusedElementwise bodies."""
    yield graph
    for n in graph.nodes:
        if n.domain == KILN_DOMAIN and n.op == FUSED_OP:
            continue
        for sg in n.subgraphs():
            yield from _graphs(sg)


def _producers(node: Node, graph: Graph) -> list:
    """Nodes of ``graph`` whose outputs ``node`` reads (its subgraphs' reads included)."""
    out = []
    for v in _reads(node):
        p = _producer_in(v, graph)
        if p is not None:
            out.append(p)
    return list(dict.fromkeys(out))


def _reads(node: Node) -> list:
    """Values ``node`` reads: its inputs and, for If/Loop, what their bodies read."""
    vals = [v for v in node.inputs if v is not None]
    for sg in node.subgraphs():
        for inner in sg.walk():
            vals.extend(v for v in inner.inputs if v is not None)
        for sub in sg.all_graphs():
            vals.extend(sub.outputs)
    return vals


def _producer_in(v: Value, graph: Graph) -> Optional[Node]:
    p = v.producer
    return p if p is not None and p.graph is graph else None


def _fusable_shape(node: Node, ops: frozenset) -> Optional[tuple]:
    """The node's output shape if it may be a member, else None."""
    if node.domain != ONNX_DOMAIN or node.op not in ops or len(node.outputs) != 1:
        return None
    t = node.outputs[0].type
    if t is None or t.shape is None or any(d is None for d in t.shape):
        return None
    if t.dtype is DType.INT64 and len(t.shape) <= 1:
        return None
    if any(v is not None and (v.type is None or v.type.shape is None) for v in node.inputs):
        return None
    if node.op == "Clip" and any(v is not None and v.const is None for v in node.inputs[1:]):
        return None
    return t.shape


def _convex_with(node: Node, chosen: list, producers: list, group_of: dict, find, bits: dict,
                 reach: dict, into: dict) -> bool:
    """Whether ``node`` may join the union of the groups ``chosen``: no producer outside them is
    reachable from them, and none of them has a path into another (conservative)."""
    mask = 0
    for g in chosen:
        mask |= bits[g]
    for q in producers:
        if q in group_of and find(group_of[q]) in chosen:
            continue
        if reach.get(q, 0) & mask:
            return False
    for g in chosen:
        if into[g] & (mask & ~bits[g]):
            return False
    return True


# --------------------------------------------------------------------------- rewriting


def _fuse(graph: Graph, members: list, outputs: set) -> Optional[Node]:
    """Move ``members`` into the body of a new FusedElementwise node of ``graph``; a dead group
    (nothing outside reads it) is left for DCE and gives None."""
    inside = set(members)
    exported = [v for m in members for v in m.outputs
                if v in outputs or any(u not in inside for u in v.users)]
    if not exported:
        return None
    body = graph.subgraph("fused_body")
    external: dict[Value, Value] = {}   # outer value -> body input or initializer
    node_inputs: list[Value] = []
    pulled: list[Value] = []
    for m in members:
        for v in m.inputs:
            if v is None or v in external or (v.producer is not None and v.producer in inside):
                continue
            if v.const is not None and v.const.size <= SMALL_CONSTANT:
                external[v] = body.add_constant(v.const, v.name)
                pulled.append(v)
            else:
                inp = body._new_value(None, v.type, v.name)
                body.inputs.append(inp)
                external[v] = inp
                node_inputs.append(v)
    fused = graph.add_node(FUSED_OP, node_inputs, {"body": body}, domain=KILN_DOMAIN, num_outputs=0,
                           name="fused", meta=dict(members[0].meta), before=members[0])
    # Body copies of the exported values; the outer Values stay (names, uses) and change producer.
    copies: dict[Value, Value] = {}
    for v in exported:
        copies[v] = body._new_value(None, v.type, v.name)
    for m in members:
        graph.nodes.remove(m)
        m.graph = body
        body.nodes.append(m)
        m.inputs = [None if v is None else copies.get(v) or external.get(v) or v for v in m.inputs]
        for i, v in enumerate(m.outputs):
            if v in copies:
                c = copies[v]
                c.producer, c.index = m, i
                m.outputs[i] = c
            else:
                v.graph = body
    for k, v in enumerate(exported):
        v.producer, v.index = fused, k
    fused.outputs = list(exported)
    body.outputs = [copies[v] for v in exported]
    for v in pulled:
        if not v.uses and v not in outputs and v.graph.initializers.get(v.name) is v:
            v.graph.remove_initializer(v)
    return fused


def _stable_toposort(graph: Graph, key: dict) -> None:
    """Reorder ``graph.nodes`` topologically, keeping the order given by ``key`` where possible."""
    nodes = list(graph.nodes)
    waiting: dict[Node, int] = {}
    users: dict[Node, list] = {n: [] for n in nodes}
    for n in nodes:
        prods = _producers(n, graph)
        waiting[n] = len(prods)
        for p in prods:
            users[p].append(n)
    ready = [(key[n], i, n) for i, n in enumerate(nodes) if waiting[n] == 0]
    heapq.heapify(ready)
    pos = {n: i for i, n in enumerate(nodes)}
    out = []
    while ready:
        _, _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key[u], pos[u], u))
    assert len(out) == len(nodes), "fusion made a cycle"  # convexity rules this out
    graph.nodes = out
