"""Versions written into every kiln graph and file, and the upgraders between opsets.

- ``IR_VERSION`` numbers the *structure* of graphs (what a Graph/Node/Value/attribute is).
  It changes when the serialized form of the IR changes.
- ``OPSET_VERSION`` numbers the *meaning* of ops. Ops named after ONNX ops follow the
  ONNX semantics of ai.onnx opset ``ONNX_OPSET_BASE`` (the newest version <= it of each op);
  kiln-domain ops have kiln's own semantics.

When an op's meaning changes: register a new schema with ``since_version=OPSET_VERSION + 1``,
bump ``OPSET_VERSION``, and register an upgrader here that rewrites a node of the old
version into the new one (``register_upgrader("Op", from_version=N)``). ``upgrade_graph``
then brings any older graph (e.g. one read from an old file) up to date.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.ir.graph import Graph, Node

IR_VERSION = 1
OPSET_VERSION = 1
ONNX_OPSET_BASE = 18

Upgrader = Callable[["Graph", "Node"], None]


@dataclass(frozen=True)
class _UpgraderEntry:
    op: str
    domain: str
    from_version: int
    fn: Upgrader


_UPGRADERS: dict[int, list[_UpgraderEntry]] = {}


def register_upgrader(op: str, *, from_version: int, domain: str = "") -> Callable[[Upgrader], Upgrader]:
    """Register ``fn(graph, node)`` that rewrites ``op`` nodes from opset ``from_version`` to
    ``from_version + 1`` semantics (in place: change attrs, or insert nodes and rewire)."""

    def deco(fn: Upgrader) -> Upgrader:
        _UPGRADERS.setdefault(from_version, []).append(_UpgraderEntry(op, domain, from_version, fn))
        return fn

    return deco


def upgrade_graph(graph: "Graph", to_version: Optional[int] = None) -> bool:
    """Upgrade ``graph`` (and its subgraphs) in place to opset ``to_version`` (default: this kiln's).

    Returns whether anything changed. Raises KilnError for a graph newer than this kiln.
    """
    if graph.opset_version > OPSET_VERSION:
        raise KilnError(
            f"graph uses kiln opset {graph.opset_version}, but this kiln ({_kiln_version()}) "
            f"supports opset <= {OPSET_VERSION}; upgrade kiln to load it")
    to_version = OPSET_VERSION if to_version is None else to_version
    changed = False
    while graph.opset_version < to_version:
        v = graph.opset_version
        for entry in _UPGRADERS.get(v, []):
            for g in graph.all_graphs():
                for node in list(g.nodes):
                    if node.op == entry.op and node.domain == entry.domain:
                        entry.fn(g, node)
                        changed = True
        for g in graph.all_graphs():
            g.opset_version = v + 1
    return changed


def _kiln_version() -> str:
    from kiln.version import __version__
    return __version__
