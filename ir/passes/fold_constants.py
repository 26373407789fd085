"""Constant folding: evaluate at compile time what does not depend on the model's inputs.

A node is folded when its op is foldable, it has no subgraph, and its result is known:
- every input is a constant (an initializer): it is evaluated with the op's reference
  implementation, the same code that defines the op's meaning;
- or only the shape of an input matters and that shape is static (``Shape``, ``Size``);
- or shape inference tracked its value symbolically and every element is a known int
  (``Gather(Shape(x), 1)`` when dim 1 of ``x`` is static, even if dim 0 is ``batch``).
The outputs become initializers named after them. A size cap keeps folding from blowing a
file up: outputs over ``max_bytes`` are folded only when they are no larger than the
constants the node reads (``ConstantOfShape`` to 1 GB, no); a Transpose of a weight is left
as it is (see ``LAYOUT_OPS``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from kiln.errors import KilnError
from kiln.ir.evaluator import run_node
from kiln.ir.graph import Graph, Node, Value
from kiln.ir.passes._rewrite import Editor, redirect_uses, rename_initializer, tensor_attr_bytes
from kiln.ir.passes.shape_inference import SymbolTable, infer_node
from kiln.ir.types import TensorType

DEFAULT_MAX_BYTES = 1 << 20

# Inputs whose values an op never reads, only their dtype and shape.
SHAPE_ONLY_INPUTS = {"Shape": (0,), "Size": (0,)}

# Layout ops left unfolded on constants above this size: at run time a Transpose of a weight is
# a free view (BLAS takes transposed operands), while folding it copies the weight, replaces its
# module-path name by the node's, and stores a weight shared by several nodes (tied embeddings)
# twice.
LAYOUT_OPS = {"Transpose"}
LAYOUT_FOLD_MAX_BYTES = 256


def fold_constants(graph: Graph, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bool:
    """Fold every node of ``graph`` (and its subgraphs) whose result is known; returns whether
    anything was folded."""
    return _fold_graph(graph, Editor(graph), {}, max_bytes)


def _fold_graph(graph: Graph, ed: Editor, symbols: SymbolTable, max_bytes: int) -> bool:
    changed = False
    for node in list(graph.nodes):
        for sg in node.subgraphs():
            changed |= _fold_graph(sg, ed, symbols, max_bytes)
        _track_symbols(node, symbols)
        changed |= _fold_node(node, ed, symbols, max_bytes)
    return changed


def _track_symbols(node: Node, symbols: SymbolTable) -> None:
    # Re-running inference here (instead of reading a table from an earlier run) sees the
    # constants this pass has just made, so folding goes all the way down a chain in one run.
    try:
        infer_node(node, symbols)
    except KilnError:
        # Not lost: infer_shapes runs after every pass that changed the graph and reports it with the node;
        # folding just learns no symbols from this node.
        pass


def _fold_node(node: Node, ed: Editor, symbols: SymbolTable, max_bytes: int) -> bool:
    schema = node.schema
    if schema.has_subgraphs or not schema.foldable or _is_folded_output(node, ed):
        return False
    known = _known_args(node)
    if known is None:
        results = _symbolic_results(node, symbols)
    else:
        results = _evaluate(node, known[0], known[1], max_bytes)
    if results is None:
        return False
    return _replace_with_constants(node, ed, results)


def _is_folded_output(node: Node, ed: Editor) -> bool:
    """``Identity(constant)`` producing a graph output is what folding leaves for a constant
    graph output (an output cannot be an initializer: it would lose its name)."""
    return node.op == "Identity" and node.domain == "" and ed.is_output(node.outputs[0])


def _known_args(node: Node) -> Optional[tuple[list, int]]:
    """The node's arguments if all are known (None for an omitted optional input), with the
    bytes of real constant data among them; None if an argument is unknown."""
    shape_only = SHAPE_ONLY_INPUTS.get(node.op, ()) if node.domain == "" else ()
    args: list = []
    const_bytes = tensor_attr_bytes(node)
    for i, v in enumerate(node.inputs):
        if v is None:
            args.append(None)
        elif v.const is not None:
            args.append(v.const)
            const_bytes += v.const.nbytes
        elif i in shape_only and v.type is not None and v.type.is_static:
            # A zero-strided view: the shape of a 1 GB tensor costs no memory.
            args.append(np.broadcast_to(np.zeros((), v.type.dtype.numpy), v.type.shape))
        else:
            return None
    return args, const_bytes


def _evaluate(node: Node, args: list, const_bytes: int, max_bytes: int) -> Optional[list]:
    if node.op in LAYOUT_OPS and node.domain == "" and const_bytes > LAYOUT_FOLD_MAX_BYTES:
        return None
    budget = max(max_bytes, const_bytes)
    static_bytes = _static_output_bytes(node)
    if static_bytes is not None and static_bytes > budget:
        return None
    try:
        # Overflow or division by zero gives the same inf/nan the runtime would give.
        with np.errstate(all="ignore"):
            results = run_node(node, args)
    except KilnError:
        # Leave the node for run time, where the same failure is reported with real inputs.
        return None
    # Initializers are stored densely: materialize views (a folded Transpose is one).
    results = [r if r.flags.c_contiguous else r.copy(order="C") for r in results]
    if sum(r.nbytes for r in results) > budget:
        return None
    if not all(v.type is None or v.type.matches(r) for v, r in zip(node.outputs, results)):
        return None
    return results


def _static_output_bytes(node: Node) -> Optional[int]:
    total = 0
    for v in node.outputs:
        if v.type is None or not v.type.is_static:
            return None
        total += v.type.numel() * v.type.dtype.itemsize
    return total


def _symbolic_results(node: Node, symbols: SymbolTable) -> Optional[list]:
    """The value of a single-output node when shape inference knows every element."""
    if len(node.outputs) != 1:
        return None
    out = node.outputs[0]
    dims = symbols.get(out)
    t = out.type
    if dims is None or t is None or not t.is_static or t.numel() != len(dims):
        return None
    if not all(isinstance(d, int) for d in dims) or not t.dtype.is_int:
        return None
    return [np.array(dims, dtype=t.dtype.numpy).reshape(t.shape)]


def _replace_with_constants(node: Node, ed: Editor, results: list) -> bool:
    """Make every reader of the node's outputs read new initializers, then remove the node."""
    graph = node.graph
    renames: list[tuple[Value, str]] = []
    for out, arr in zip(node.outputs, results):
        if not out.uses and not ed.is_output(out):
            continue
        const = graph.add_constant(arr, hint=f"{out.name}_const")
        if ed.is_output(out):
            # Readers read the constant; the output, which cannot be an initializer (it would
            # lose its name), becomes Identity(constant).
            redirect_uses(out, const)
            ident = graph.add_node("Identity", [const], before=node, output_types=[TensorType.of(arr)])
            ed.replace_value(out, ident.outputs[0])
        else:
            redirect_uses(out, const)
            renames.append((const, out.name))
    ed.remove_node(node)
    for const, name in renames:
        # The folded value keeps the name readers knew it by.
        rename_initializer(const, name)
    return True
