"""The optimization pipeline: a named list of passes run to a fixed point.

    report = optimize(graph, level=2)
    print(report)

Levels: 0 runs shape inference only; 1 adds constant folding, inlining of If nodes whose
condition folded to a constant, simplification, CSE and DCE; 2 adds BatchNorm folding. Each step is a ``(name, fn)`` pair where ``fn(graph) -> bool`` edits
the graph in place and says whether it changed it; ``pipeline(level)`` gives the list, and
``optimize(graph, passes=[...])`` runs any other (names from ``PASSES`` or pairs). Shape
inference runs first and again after every pass that changed the graph, so the next pass
sees types for the nodes just made. The report counts, per pass, its runs, the runs that
changed the graph, the nodes it removed and its time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from kiln.errors import VerifyError
from kiln.ir.graph import Graph
from kiln.ir.passes.control_flow import inline_constant_branches
from kiln.ir.passes.cse import cse
from kiln.ir.passes.dce import dce
from kiln.ir.passes.fold_batchnorm import fold_batchnorm
from kiln.ir.passes.fold_constants import fold_constants
from kiln.ir.passes.shape_inference import infer_shapes
from kiln.ir.passes.simplify import simplify
from kiln.ir.verifier import verify

Pass = Callable[[Graph], bool]
Step = tuple[str, Pass]

PASSES: dict[str, Pass] = {
    "fold_constants": fold_constants,
    "inline_constant_branches": inline_constant_branches,
    "simplify": simplify,
    "fold_batchnorm": fold_batchnorm,
    "cse": cse,
    "dce": dce,
}

# Inlining right after folding: the condition it needs is what folding just made constant.
# Simplify before BN folding: it removes the Identity/Dropout that may sit between a Conv
# and its BN. DCE last: it sweeps up what the others left unused.
LEVELS: dict[int, tuple[str, ...]] = {
    0: (),
    1: ("fold_constants", "inline_constant_branches", "simplify", "cse", "dce"),
    2: ("fold_constants", "inline_constant_branches", "simplify", "fold_batchnorm", "cse", "dce"),
}

INFER = "infer_shapes"


def pipeline(level: int = 2) -> list[Step]:
    """The steps of an optimization level, in order."""
    if level not in LEVELS:
        raise ValueError(f"optimization level must be one of {sorted(LEVELS)}, not {level!r}")
    return [(name, PASSES[name]) for name in LEVELS[level]]


@dataclass
class PassStats:
    name: str
    runs: int = 0
    changed: int = 0
    nodes_removed: int = 0
    seconds: float = 0.0


@dataclass
class OptimizeReport:
    level: int
    nodes_before: int
    nodes_after: int = 0
    iterations: int = 0
    converged: bool = False
    passes: dict[str, PassStats] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"{'pass':<18}{'runs':>6}{'changed':>9}{'removed':>9}{'ms':>9}"]
        for s in self.passes.values():
            lines.append(f"{s.name:<18}{s.runs:>6}{s.changed:>9}{s.nodes_removed:>9}{s.seconds * 1e3:>9.1f}")
        end = "fixed point" if self.converged else "stopped before a fixed point"
        lines.append(f"nodes {self.nodes_before} -> {self.nodes_after} at level {self.level}, "
                     f"{self.iterations} iteration(s), {end}")
        return "\n".join(lines)


def optimize(graph: Graph, level: int = 2, *, passes: Optional[Sequence[Union[str, Step]]] = None,
             verify_each: bool = False, max_iterations: int = 8) -> OptimizeReport:
    """Optimize ``graph`` in place; ``passes`` replaces the level's list of steps.

    With ``verify_each``, :func:`kiln.ir.verify` runs after every pass and its error names
    the pass. Stops at a fixed point or after ``max_iterations`` rounds of all the steps.
    """
    if passes is None and is_optimized(graph, level):  # nothing changed since this pipeline converged on it
        report = OptimizeReport(level, _count_nodes(graph))
        report.converged, report.nodes_after = True, report.nodes_before
        return report
    steps = pipeline(level) if passes is None else [_as_step(p) for p in passes]
    runner = _Runner(graph, verify_each, OptimizeReport(level, _count_nodes(graph)))
    runner.run(INFER, infer_shapes)
    for i in range(max_iterations):
        runner.report.iterations = i + 1
        changed = False
        for name, fn in steps:
            if runner.run(name, fn):
                changed = True
                runner.run(INFER, infer_shapes)
        if not changed:
            runner.report.converged = True
            break
    runner.report.nodes_after = _count_nodes(graph)
    if passes is None and runner.report.converged:
        graph.metadata.props[OPTIMIZED_PROP] = _optimized_mark(graph, level)
    return runner.report


# A graph the level's pipeline converged on carries this metadata (kept through save/load): the level, kiln's
# version and a fingerprint of the graph's structure then. optimize() of a graph whose mark still matches
# returns at once: kiln.load of a file exported optimized skips the passes (at 32k nodes, 1.9 s of the first
# run). Any edit since (a precision conversion, a node added) changes the fingerprint, so it runs again. A
# forged mark can only skip optimization, never verification.
OPTIMIZED_PROP = "kiln.optimized"


def fingerprint(graph: Graph) -> str:
    """A hash of what the passes act on: every node's op, attributes and input/output names, in order, and
    the graph inputs, outputs and initializers (name, dtype, shape)."""
    try:  # the built-in module hashlib's blake2b is: importing hashlib loads OpenSSL (3 ms of a cold start)
        from _blake2 import blake2b
    except ImportError:  # pragma: no cover - a Python built without it
        from hashlib import blake2b
    h = blake2b(digest_size=16)
    for g in graph.all_graphs():
        h.update(repr([(v.name, str(v.type)) for v in g.inputs]).encode())
        h.update(repr([(v.name, str(v.type)) for v in g.initializers.values()]).encode())
        lines = []
        for n in g.nodes:
            attrs = sorted((k, repr(a)) for k, a in n.attrs.items() if not isinstance(a, Graph)) if n.attrs else []
            inputs = [None if v is None else v.name for v in n.inputs]
            lines.append(f"{n.domain}.{n.op}|{inputs}|{[v.name for v in n.outputs]}|{attrs}\n")
        h.update("".join(lines).encode())
        h.update(repr([v.name for v in g.outputs]).encode())
    return h.hexdigest()


def _optimized_mark(graph: Graph, level: int) -> str:
    from kiln.version import __version__
    return f"{level}:{__version__}:{fingerprint(graph)}"


def is_optimized(graph: Graph, level: int = 2) -> bool:
    """Whether optimize(graph, level) converged on this very graph (see OPTIMIZED_PROP)."""
    mark = graph.metadata.props.get(OPTIMIZED_PROP)
    return mark is not None and mark == _optimized_mark(graph, level)


def _as_step(p: Union[str, Step]) -> Step:
    if isinstance(p, str):
        if p not in PASSES:
            raise ValueError(f"unknown pass '{p}'; passes: {', '.join(PASSES)}")
        return p, PASSES[p]
    name, fn = p
    return name, fn


class _Runner:
    """Runs one step at a time, timing it and verifying after it when asked."""

    def __init__(self, graph: Graph, verify_each: bool, report: OptimizeReport):
        self.graph = graph
        self.verify_each = verify_each
        self.report = report

    def run(self, name: str, fn: Pass) -> bool:
        stats = self.report.passes.setdefault(name, PassStats(name))
        before = _count_nodes(self.graph)
        start = time.perf_counter()
        changed = bool(fn(self.graph))
        stats.seconds += time.perf_counter() - start
        stats.runs += 1
        stats.changed += changed
        stats.nodes_removed += before - _count_nodes(self.graph)
        if self.verify_each:
            try:
                verify(self.graph)
            except VerifyError as e:
                raise VerifyError(f"after pass '{name}': {e}") from e
        return changed


def _count_nodes(graph: Graph) -> int:
    return sum(1 for _ in graph.walk())
