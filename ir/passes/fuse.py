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

Epilogues (``fuse_epilogues``, run after ``fuse_elementwise``): the elementwise tail of a
Conv/Gemm/MatMul joins it in one ``kiln.FusedEpilogue`` (kiln/ir/ops/fused.py gives its body's
layout). Why: fusing the tail alone still leaves the anchor's output making a round trip through
GPU memory (written by the convolution, read back by the elementwise kernel) and costs one more
launch per epilogue, while cuDNN and cuBLASLt can apply a bias, an activation and a residual add
inside the GEMM/convolution itself (the patterns of every ResNet block, ``Conv -> Relu``,
``Conv -> Add(residual) -> Relu``, and of every transformer projection, ``MatMul -> Add(bias)``,
``MatMul -> Add(bias) -> Gelu``); a backend that cannot still has one node to run as the anchor
plus one generated kernel. The rules:

- the consumer C is a FusedElementwise node (its body only default-domain elementwise ops, each
  of one output of the group's shape) or a single elementwise op that could join a group (its
  output shape fully known); C has a live output;
- the anchor A is a default-domain op of ``anchors`` (``ANCHOR_OPS`` by default) in the same
  graph with one output y; y is read only by C, at one position (not by a subgraph, not a graph
  output), so nothing else needs it materialized; y's type is fully known (ints and symbols),
  float (float16/32/64, bfloat16: what the GPU libraries' epilogues take) and has the shape of
  every output of C, so the epilogue never broadcasts the anchor's output into something larger;
- among C's inputs from such anchors the latest in node order is taken: in a ResNet
  downsample block ``Add(conv2(...), downsample_conv(x))`` that is the one computed last (the
  other must be ready anyway when the fused node runs, and stays its input).

A and C are rewritten by the same machinery as a group: A, then C move into the body of a new
node named ``epilogue``/``epilogue_<k>``, placed where C was (every input of the pair is
defined before C, and every reader of C's outputs comes after it, so no re-sort is needed),
carrying the anchor's meta (the layer's scope and source). A's inputs become the first
node inputs and body inputs, one per position and never pulled in (weights stay outer
constants, whatever their size: the GPU library reads them where they are); C's other inputs
follow, small constants pulled in as for a group. C's outer outputs stay the node's outputs
(names and readers unchanged). A FusedElementwise C is then flattened: its body's nodes,
values and initializers move into the epilogue body unchanged. A trailing omitted optional
input of the anchor (Conv's bias, Gemm's C) is dropped. If/Loop bodies are handled like the
main graph; FusedElementwise and FusedEpilogue bodies are not entered, and FusedEpilogue is
no consumer, so a second run finds nothing to do.

Attention (``fuse_attention``, run *before* the two above): scaled dot-product attention,
``MatMul(q, kt) -> [Mul|Div by a constant] -> [Add(mask)] -> Softmax(last axis) -> MatMul(., v)``,
becomes one ``kiln.FusedAttention`` (its body's layout: kiln/ir/ops/fused.py). Why: a GPU runs it
as one kernel that never materializes the [..., Lq, Lk] scores (at BERT-base's 12 heads and
sequence 512, 12 MiB per sequence and layer in float32, written and read back three times by the
unfused ops). Why first: fuse_epilogues would take the score MatMul and its scale as an epilogue,
and fuse_elementwise the scale and mask Add as a group, and the chain would be gone. The rules:

- the chain is read backwards from the final MatMul; each intermediate (the scores, scaled,
  masked, the probabilities) has exactly one use, by the next node of the chain in the same
  graph (so no subgraph reads it), and is no graph output: nothing else needs it materialized;
- the scale is a one-element float constant (``Mul`` in either operand order, ``Div`` only as
  s / c), pulled into the body as an initializer (the outer one is dropped once unread); the
  mask of an ``Add`` (either operand order) stays a node input, whatever it is;
- a bool mask as the tracer writes ``masked_fill(mask, -inf)`` and causal
  ``F.scaled_dot_product_attention`` (GPT's ``Where(cond, -inf, s)``, SDPA's
  ``Where(cond, s, -inf)``, the fill a one-element constant of -inf) is taken as an additive mask:
  the bool condition becomes a float mask of 0 and -inf, ``Where(cond, -inf, 0)`` (or the other
  way round) outside the node, a constant when the condition is one, with the condition's shape
  ([Lq, Lk] for a causal mask, not the scores'). For finite scores ``s + (-inf) = -inf`` and
  ``s + 0 = s`` exactly, so the results are the same (only an infinite or NaN score under the
  mask, which the Where hid, now spreads to its row; other fill values are left alone, as
  s + fill differs from fill);
- q, kt, v have one rank r >= 3, one float dtype and the same batch dims (the kernel does not
  broadcast among them), every value's shape is fully known (ints and symbols), and each
  intermediate has the scores' shape (a mask broadcasts into it without growing it).

The chain is rewritten into one node named ``attention``/``attention_<k>`` at the final MatMul's
place (every input of the chain is defined before it), carrying the first MatMul's meta (the
attention module's scope); the final MatMul's outer output Value stays (name, readers), now
produced by the node; the chain's nodes move into the body unchanged (names, meta). If/Loop
bodies are handled like the main graph; fused bodies are not entered, and FusedAttention is
neither elementwise, nor an anchor, nor a consumer for the other two passes, so they leave it
alone, and a second run of any of the three finds nothing to do.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import numpy as np

from kiln.ir.dtypes import FLOAT_TYPES, DType
from kiln.ir.graph import Graph, Node, Value
# ELEMENTWISE_OPS lives with the ops (FusedEpilogue's layout check needs it); exported here too.
from kiln.ir.ops.fused import ANCHOR_OPS, ATTENTION_OP, ELEMENTWISE_OPS, EPILOGUE_OP, FUSED_OP, attention_parts
from kiln.ir.passes._rewrite import graph_outputs
from kiln.ir.passes.shape_inference import infer_node
from kiln.ir.registry import KILN_DOMAIN, ONNX_DOMAIN

# kiln ops whose bodies the passes never enter
_FUSED_OPS = frozenset({FUSED_OP, EPILOGUE_OP, ATTENTION_OP})

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
    groups = _without_cycles(graph, groups, min_ops)
    return sorted(groups, key=lambda m: index[m[0]])


def _without_cycles(graph: Graph, groups: list, min_ops: int) -> list:
    """``groups`` with any group on a cycle of the fused graph split up, until there is none.

    The greedy growth above checks convexity against ``reach``, which it records per node when
    the node is visited; a group that later takes a member with new incoming paths makes the
    nodes already downstream of it depend on those too, which their records miss, and two groups
    can then each reach the other (hypothesis found one: relu = Relu(x); MatMul(relu) feeds the
    group {Relu(x), Add(matmul, .), Relu(.)}, whose output feeds Add(relu, .) joining relu's
    group). So the result is checked exactly: a DFS over the graph with each group as one vertex;
    a group on a cycle is dissolved (its members stay unfused) and the check repeats. Cycles are
    rare, so this costs one linear pass in the usual case."""
    while True:
        vertex: dict[Node, int] = {}
        for k, m in enumerate(groups):
            for n in m:
                vertex[n] = k
        nxt = len(groups)
        for n in graph.nodes:
            if n not in vertex:
                vertex[n] = nxt
                nxt += 1
        succ: dict[int, set] = {}
        for n in graph.nodes:
            for p in _producers(n, graph):
                a, b = vertex[p], vertex[n]
                if a != b:
                    succ.setdefault(a, set()).add(b)
        cycle_group = _group_on_cycle(succ, len(groups), nxt)
        if cycle_group is None:
            return groups
        groups = [m for k, m in enumerate(groups) if k != cycle_group and len(m) >= min_ops]


def _group_on_cycle(succ: dict, n_groups: int, n_vertices: int) -> Optional[int]:
    """A group vertex (< n_groups) on a cycle of ``succ``, or None (iterative DFS, three colours)."""
    colour = [0] * n_vertices  # 0 new, 1 on the stack, 2 done
    for start in range(n_vertices):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(succ.get(start, ()))))]
        colour[start] = 1
        path = [start]
        while stack:
            v, it = stack[-1]
            w = next(it, None)
            if w is None:
                colour[v] = 2
                stack.pop()
                path.pop()
            elif colour[w] == 1:
                on_cycle = path[path.index(w):]
                return next(u for u in on_cycle if u < n_groups)  # a cycle needs a group on it
            elif colour[w] == 0:
                colour[w] = 1
                stack.append((w, iter(sorted(succ.get(w, ())))))
                path.append(w)
    return None


def fuse_elementwise(graph: Graph, *, min_ops: int = 2, ops: Iterable[str] = ELEMENTWISE_OPS) -> int:
    """Replace each group of :func:`fusion_groups` in ``graph`` and its If/Loop bodies by one
    FusedElementwise node; returns the number of groups fused."""
    ops = frozenset(ops)
    outputs = graph_outputs(graph.root)
    made = 0
    for g in list(_graphs(graph)):
        # Rounds until nothing changes: a round fuses acyclic groups; members of a group that was
        # dissolved for a cycle (``_without_cycles``, rare) may group again in the next round,
        # now that the groups around them are single nodes (so a second run has nothing to do).
        changed = True
        while changed:
            groups = fusion_groups(g, min_ops=min_ops, ops=ops)
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


def fuse_epilogues(graph: Graph, *, anchors: Iterable[str] = ANCHOR_OPS,
                   accept: Optional[Callable[[Node, Node], bool]] = None) -> int:
    """Fuse each Conv/Gemm/MatMul of ``anchors`` with the elementwise consumer of its output (a
    FusedElementwise or a single elementwise op) into one FusedEpilogue node, in ``graph`` and
    its If/Loop bodies; returns the number of nodes made. Meant to run after
    :func:`fuse_elementwise` (module docstring: "Epilogues"). ``accept(anchor, consumer)``, where
    given, keeps only the pairs a backend can run fused (the CPU's native convolution takes a
    Conv with one activation op, runtime/kernels/cpu/native.py)."""
    anchors = frozenset(anchors)
    if not anchors <= ANCHOR_OPS:
        raise ValueError(f"anchors must be among {sorted(ANCHOR_OPS)} (FusedEpilogue's layout), "
                         f"not {sorted(anchors - ANCHOR_OPS)}")
    outputs = graph_outputs(graph.root)
    made = 0
    for g in list(_graphs(graph)):
        position = {n: i for i, n in enumerate(g.nodes)}
        for consumer in list(g.nodes):
            anchor = _epilogue_anchor(consumer, g, anchors, outputs, position)
            if anchor is None or (accept is not None and not accept(anchor, consumer)):
                continue
            anchor.inputs = _present_inputs(anchor)
            fused = _fuse(g, [anchor, consumer], outputs, op=EPILOGUE_OP, name="epilogue",
                          anchored=True, at=consumer)
            assert fused is not None, "a live consumer makes a live epilogue"
            if _is_group(consumer):
                _inline(consumer)
            made += 1
    return made


def fuse_attention(graph: Graph) -> int:
    """Replace each attention chain (``MatMul(q, kt) -> [Mul|Div] -> [Add|Where mask] -> Softmax
    -> MatMul(., v)``) of ``graph`` and its If/Loop bodies by one FusedAttention node; returns
    the number of nodes made. Meant to run before :func:`fuse_elementwise` and
    :func:`fuse_epilogues` (module docstring: "Attention")."""
    outputs = graph_outputs(graph.root)
    made = 0
    for g in list(_graphs(graph)):
        for node in list(g.nodes):
            chain = _attention_chain(node, g, outputs)
            if chain is not None:
                _fuse_attention(g, chain, outputs)
                made += 1
    return made


@dataclass
class _Attention:
    """A chain found by :func:`_attention_chain`; None fields are the parts it lacks."""
    first: Node                        # MatMul(q, kt)
    scaler: Optional[Node]             # Mul(s, c) / Mul(c, s) / Div(s, c)
    scale_at: int                      # the scaler's input position of c
    masker: Optional[Node]             # Add(s, mask) / Add(mask, s) / Where(cond, -inf, s) / Where(cond, s, -inf)
    mask_at: int                       # the masker's input position of the mask (Add) or the fill (Where)
    softmax: Node
    final: Node                        # MatMul(p, v)
    safe: tuple = ()                   # the safe-softmax tail: (ReduceMax, Equal, Where), or ()

    @property
    def nodes(self) -> list:
        return [n for n in (self.first, self.scaler, self.masker, self.softmax, *self.safe, self.final)
                if n is not None]


def _attention_chain(final: Node, graph: Graph, outputs: set) -> Optional[_Attention]:
    """The attention chain ending in ``final`` (a MatMul of ``graph``), or None (module docstring:
    "Attention")."""
    if not _plain(final, ("MatMul",)):
        return None
    safe = _safe_softmax_tail(final, graph, outputs) or []
    softmax = safe[0] if safe else _link(final.inputs[0], final, graph, outputs, ("Softmax",))
    if softmax is None:
        return None
    safe = safe[1:]
    node = _link(softmax.inputs[0], softmax, graph, outputs, ("Add", "Where", "Mul", "Div", "MatMul"),
                 also=safe[:1])
    masker, mask_at = None, 0
    if node is not None and node.op in ("Add", "Where"):
        masker, node = node, None
        # Add: either operand is the scores; Where: the scores are the branch that is not the fill.
        sides = [(0, 1), (1, 0)] if masker.op == "Add" else [(2, 1), (1, 2)]
        for s_at, mask_at in sides:
            if masker.op == "Where" and not _neg_inf(masker.inputs[mask_at]):
                continue
            node = _link(masker.inputs[s_at], masker, graph, outputs, ("Mul", "Div", "MatMul"))
            if node is not None:
                break
    scaler, scale_at = None, 0
    if node is not None and node.op in ("Mul", "Div"):
        scaler, node = node, None
        for s_at, scale_at in [(0, 1)] if scaler.op == "Div" else [(0, 1), (1, 0)]:
            c = scaler.inputs[scale_at]
            if c is not None and c.const is not None and c.const.size == 1:
                node = _link(scaler.inputs[s_at], scaler, graph, outputs, ("MatMul",))
                if node is not None:
                    break
    if node is None or node.op != "MatMul":
        return None
    chain = _Attention(node, scaler, scale_at, masker, mask_at, softmax, final, tuple(safe))
    return chain if _attention_types_fit(chain) else None


def _safe_softmax_tail(final: Node, graph: Graph, outputs: set) -> Optional[list]:
    """``[Softmax, ReduceMax, Equal, Where]`` when ``final`` reads torch's safe softmax,
    ``Where(Equal(ReduceMax(s, -1, keepdims), -inf), 0, Softmax(s))`` (each value read once by the
    next, ``s`` by the Softmax and the ReduceMax only), else None. The constants are checked by the
    body layout (ir/ops/fused.py), which the fused node must pass anyway."""
    where = _link(final.inputs[0], final, graph, outputs, ("Where",))
    if where is None or len(where.inputs) != 3:
        return None
    zero = where.inputs[1]
    if zero is None or zero.const is None or zero.const.size != 1 or not np.all(zero.const == 0):
        return None
    softmax = _link(where.inputs[2], where, graph, outputs, ("Softmax",))
    equal = _link(where.inputs[0], where, graph, outputs, ("Equal",))
    if softmax is None or equal is None:
        return None
    mx = [x for x in equal.inputs if x is not None and x.producer is not None and x.producer.op == "ReduceMax"]
    ninf = [x for x in equal.inputs if _neg_inf(x)]
    if len(mx) != 1 or len(ninf) != 1:
        return None
    reducemax = _link(mx[0], equal, graph, outputs, ("ReduceMax",))
    s = softmax.inputs[0]
    if reducemax is None or reducemax.inputs[0] is not s or s in outputs \
            or sorted(id(u) for u, _ in s.uses) != sorted((id(softmax), id(reducemax))):
        return None
    axes = reducemax.attrs.get("axes")
    if len(reducemax.inputs) > 1 and reducemax.inputs[1] is not None:
        a = reducemax.inputs[1]
        axes = None if a.const is None else a.const.reshape(-1).tolist()
    rank = s.type.rank if s.type is not None else None
    if axes is None or len(axes) != 1 or axes[0] not in (-1, None if rank is None else rank - 1) \
            or not reducemax.schema.fill_attrs(reducemax.attrs).get("keepdims", 1):
        return None
    return [softmax, reducemax, equal, where]


def _attention_types_fit(chain: _Attention) -> bool:
    """Whether the types of a chain of the right ops fit FusedAttention's layout (ranks, dtypes,
    batch dims, fully known shapes, the scores' shape kept, the softmax over the last axis)."""
    q, kt = chain.first.inputs
    v = chain.final.inputs[1]
    types = [None if x is None else x.type for x in (q, kt, v)]
    if any(t is None or t.shape is None or any(d is None for d in t.shape) for t in types):
        return False
    tq, tk, tv = types
    r = len(tq.shape)
    if (r < 3 or len(tk.shape) != r or len(tv.shape) != r or tq.dtype not in FLOAT_TYPES
            or tk.dtype is not tq.dtype or tv.dtype is not tq.dtype
            or not tq.shape[:-2] == tk.shape[:-2] == tv.shape[:-2]
            or tq.shape[-1] != tk.shape[-2] or tk.shape[-1] != tv.shape[-2]):
        return False
    scores = tq.shape[:-1] + tk.shape[-1:]
    for n in chain.nodes[:-1]:
        if n in chain.safe[:2]:  # ReduceMax and Equal: one value a row
            t = n.outputs[0].type
            if t is None or t.shape is None or t.shape[:-1] != scores[:-1]:
                return False
            continue
        t = n.outputs[0].type
        if t is None or t.shape != scores or t.dtype is not tq.dtype:
            return False
    out = chain.final.outputs[0].type
    if out is None or out.shape is None or any(d is None for d in out.shape):
        return False
    extra = []  # the mask (Add) or the condition (Where), which must have a fully known shape
    if chain.scaler is not None:
        c = chain.scaler.inputs[chain.scale_at]
        if c.type is None or c.type.dtype is not tq.dtype:
            return False
    if chain.masker is not None:
        m = chain.masker.inputs[chain.mask_at] if chain.masker.op == "Add" else chain.masker.inputs[0]
        want = tq.dtype if chain.masker.op == "Add" else DType.BOOL
        if m is None or m.type is None or m.type.dtype is not want:
            return False
        extra.append(m)
        if chain.masker.op == "Where" and chain.masker.inputs[chain.mask_at].type.dtype is not tq.dtype:
            return False
    for x in extra:
        if x.type.shape is None or any(d is None for d in x.type.shape) or len(x.type.shape) > r:
            return False
    axis = chain.softmax.schema.fill_attrs(chain.softmax.attrs).get("axis", -1)
    return axis in (-1, r - 1)


def _fuse_attention(graph: Graph, chain: _Attention, outputs: set) -> Node:
    """Rewrite ``chain`` into one FusedAttention node of ``graph`` (module docstring: "Attention")."""
    first, scaler, masker, softmax, final = chain.first, chain.scaler, chain.masker, chain.softmax, chain.final
    q, kt = first.inputs
    v = final.inputs[1]
    dropped: list[Value] = []  # outer constants the chain read, removed below once nothing reads them
    where = None
    if masker is not None and masker.op == "Where":
        where, masker = masker, None
        mask = _additive_mask(graph, where, chain.mask_at, before=final)
        dropped += [where.inputs[0], where.inputs[chain.mask_at]]
    else:
        mask = None if masker is None else masker.inputs[chain.mask_at]
    outer = [q, kt, v] + ([mask] if mask is not None else [])
    body = graph.subgraph("attention_body")
    for x in outer:
        body.inputs.append(body._new_value(None, x.type, x.name))
    bq, bk, bv = body.inputs[:3]
    node = graph.add_node(ATTENTION_OP, outer, {"body": body}, domain=KILN_DOMAIN, num_outputs=0,
                          name="attention", meta=dict(first.meta), before=final)
    for m in [n for n in (first, scaler, masker, softmax, *chain.safe, final) if n is not None]:
        body.nodes.append(m)  # out of graph's node list, into the body's
        m.graph = body
        for o in m.outputs:
            o.graph = body
        if m is scaler:
            c = scaler.inputs[chain.scale_at]
            scaler.set_input(chain.scale_at, body.add_constant(c.const, c.name))
            dropped.append(c)
        if m in chain.safe:  # the safe-softmax tail's constants (-inf, 0, the axes) move in as the scale does
            for i, c in enumerate(m.inputs):
                if c is not None and c.const is not None and c.producer is None:
                    m.set_input(i, body.add_constant(c.const, c.name))
                    dropped.append(c)
        if where is not None and m is (first if scaler is None else scaler):
            # A Where mask's Add(s, mask) takes the Where's place: right after the scores' last node.
            s = m.outputs[0]
            add = body.add_node("Add", [s, body.inputs[3]], name="add", meta=dict(where.meta),
                                output_types=[where.outputs[0].type])
            softmax.set_input(0, add.outputs[0])
            if chain.safe:  # the safe softmax's ReduceMax reads the masked scores too
                chain.safe[0].set_input(0, add.outputs[0])
            graph.remove_node(where)
    first.inputs = [bq, bk]
    if masker is not None:
        masker.set_input(chain.mask_at, body.inputs[3])
    final.set_input(1, bv)
    out = final.outputs[0]
    inner = body._new_value(None, out.type, out.name)
    inner.producer, inner.index = final, 0
    final.outputs[0] = inner
    out.producer, out.index, out.graph = node, 0, graph
    node.outputs = [out]
    body.outputs = [inner]
    for c in dropped:
        if not c.uses and c not in outputs and c.graph.initializers.get(c.name) is c:
            c.graph.remove_initializer(c)
    attention_parts(body)  # the layout the backends rely on; a failure here is a bug of this pass
    return node


def _additive_mask(graph: Graph, where: Node, fill_at: int, *, before: Node) -> Value:
    """The float mask equal to ``where``'s masking of the scores: ``Where(cond, -inf, 0)`` for
    ``Where(cond, -inf, s)`` (``Where(cond, 0, -inf)`` for ``Where(cond, s, -inf)``), computed by
    a new node placed before ``before``, or a constant when the condition is one."""
    cond, fill = where.inputs[0], where.inputs[fill_at]
    zero = np.zeros_like(fill.const)
    if cond.const is not None:
        picks = (fill.const, zero) if fill_at == 1 else (zero, fill.const)
        return graph.add_constant(np.where(cond.const, *picks), "attention_mask")
    zero_v = graph.add_constant(zero, "zero")
    picks = [fill, zero_v] if fill_at == 1 else [zero_v, fill]
    node = graph.add_node("Where", [cond] + picks, name="attention_mask", meta=dict(where.meta), before=before)
    infer_node(node)
    return node.outputs[0]


def _plain(node: Node, ops: tuple) -> bool:
    return node.domain == ONNX_DOMAIN and node.op in ops and len(node.outputs) == 1


def _link(value: Optional[Value], reader: Node, graph: Graph, outputs: set, ops: tuple,
          also: Iterable = ()) -> Optional[Node]:
    """The producer of ``value`` if it is a default-domain node of ``ops`` in ``graph`` with one
    output, and ``value`` is read once, by ``reader`` (and once by each node of ``also``), and is no
    graph output; else None."""
    readers = [reader, *also]
    if value is None or value in outputs or sorted(id(u) for u, _ in value.uses) != sorted(map(id, readers)):
        return None
    p = _producer_in(value, graph)
    return p if p is not None and _plain(p, ops) else None


def _neg_inf(value: Optional[Value]) -> bool:
    """Whether ``value`` is a one-element float constant holding -inf."""
    return (value is not None and value.const is not None and value.const.size == 1
            and _float_array(value.const) and bool(np.isneginf(value.const.astype(np.float32)).all()))


def _float_array(a: np.ndarray) -> bool:
    """numpy floats, and bfloat16 (ml_dtypes' is no np.floating subtype)."""
    return np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16"


# --------------------------------------------------------------------------- analysis helpers


def _graphs(graph: Graph):
    """``graph`` and the bodies of its If/Loop nodes, recursively; not the bodies of fused nodes
    (FusedElementwise, FusedEpilogue, FusedAttention)."""
    yield graph
    for n in graph.nodes:
        if n.domain == KILN_DOMAIN and n.op in _FUSED_OPS:
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


def _present_inputs(node: Node) -> list:
    """``node``'s inputs without the trailing omitted (None) ones."""
    inputs = list(node.inputs)
    while inputs and inputs[-1] is None:
        inputs.pop()
    return inputs


def _epilogue_anchor(consumer: Node, graph: Graph, anchors: frozenset, outputs: set,
                     position: dict) -> Optional[Node]:
    """The anchor ``fuse_epilogues`` absorbs into ``consumer``, or None: among the nodes of
    ``anchors`` producing an input of the consumer, with an output of the consumer's shape that
    only the consumer reads, the latest in ``position`` (the graph's node order)."""
    group = _is_group(consumer)
    if not group and _fusable_shape(consumer, ELEMENTWISE_OPS) is None:
        return None
    shapes = {None if v.type is None else v.type.shape for v in consumer.outputs}
    if len(shapes) != 1 or None in shapes or not any(v in outputs or v.uses for v in consumer.outputs):
        return None
    (shape,) = shapes
    if group and not _plain_body(consumer.attrs["body"], shape):
        return None
    best = None
    for v in consumer.inputs:
        a = None if v is None else _producer_in(v, graph)
        if a is None or a.domain != ONNX_DOMAIN or a.op not in anchors or len(a.outputs) != 1:
            continue
        t = v.type
        if (v in outputs or len(v.uses) != 1 or t is None or t.dtype not in FLOAT_TYPES or t.shape != shape
                or any(d is None for d in shape) or None in _present_inputs(a)):
            continue
        if best is None or position[a] > position[best]:
            best = a
    return best


def _is_group(node: Node) -> bool:
    return node.domain == KILN_DOMAIN and node.op == FUSED_OP


def _plain_body(body: Graph, shape: tuple) -> bool:
    """Whether a FusedElementwise body may become an epilogue: only default-domain elementwise
    ops of one output of ``shape``, and each body output computed by one of them."""
    return (all(n.domain == ONNX_DOMAIN and n.op in ELEMENTWISE_OPS and len(n.outputs) == 1
                and n.outputs[0].type is not None and n.outputs[0].type.shape == shape for n in body.nodes)
            and all(v.producer is not None and v.producer.graph is body for v in body.outputs))


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


def _fuse(graph: Graph, members: list, outputs: set, *, op: str = FUSED_OP, name: str = "fused",
          anchored: bool = False, at: Optional[Node] = None) -> Optional[Node]:
    """Move ``members`` into the body of a new ``op`` node (named from ``name``) of ``graph``,
    placed before ``at`` (default: the first member); a dead group (nothing outside reads it) is
    left for DCE and gives None. With ``anchored``, ``members[0]`` is a FusedEpilogue's anchor:
    each of its inputs becomes a body input of its own, first and in order, never a pulled-in
    constant, and no other member reads those body inputs (an outer value both read gets a
    second body input)."""
    inside = set(members)
    exported = [v for m in members for v in m.outputs
                if v in outputs or any(u not in inside for u in v.users)]
    if not exported:
        return None
    body = graph.subgraph(f"{name}_body")
    external: dict[Value, Value] = {}   # outer value -> body input or initializer
    node_inputs: list[Value] = []
    pulled: list[Value] = []
    anchor_inputs: list[Value] = []
    if anchored:
        for v in members[0].inputs:
            inp = body._new_value(None, v.type, v.name)
            body.inputs.append(inp)
            anchor_inputs.append(inp)
            node_inputs.append(v)
    for m in members[1:] if anchored else members:
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
    fused = graph.add_node(op, node_inputs, {"body": body}, domain=KILN_DOMAIN, num_outputs=0,
                           name=name, meta=dict(members[0].meta), before=at or members[0])
    # Body copies of the exported values; the outer Values stay (names, uses) and change producer.
    copies: dict[Value, Value] = {}
    for v in exported:
        copies[v] = body._new_value(None, v.type, v.name)
    for m in members:
        graph.nodes.remove(m)
        m.graph = body
        body.nodes.append(m)
        if anchored and m is members[0]:
            m.inputs = anchor_inputs
        else:
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


def _inline(node: Node) -> None:
    """Replace the FusedElementwise ``node`` by the nodes of its body, in its place in its graph
    (how ``fuse_epilogues`` flattens a group into an epilogue body). The body's nodes, values and
    initializers move unchanged (names included): body inputs read the node's inputs, and
    readers of the node's outputs read the body's outputs."""
    graph = node.graph
    body: Graph = node.attrs["body"]
    vmap: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    for v in body.initializers.values():
        v.graph = graph
        graph.initializers[v.name] = v
    moved = list(body.nodes)
    for m in moved:  # the body's nodes take the node's place
        graph.nodes.insert_before(node, m)
    graph.nodes.remove(node)
    for m in moved:
        m.graph = graph
        m.inputs = [None if v is None else vmap.get(v, v) for v in m.inputs]
        for v in m.outputs:
            v.graph = graph
    node.inputs = []
    for out, v in zip(node.outputs, body.outputs):
        for user, i in out.uses:
            user.set_input(i, v)
        graph.outputs = [v if o is out else o for o in graph.outputs]
    node.outputs = []
    body.nodes, body.inputs, body.outputs, body.initializers = [], [], [], {}


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
