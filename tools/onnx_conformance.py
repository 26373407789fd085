"""The ONNX backend node-test conformance runner: how much of ONNX does kiln actually run right?

The ONNX project ships, for every operator, a set of small test cases (one model, its inputs and
the expected outputs). Current onnx releases generate them in Python rather than shipping files, so
the cases come from ``onnx.backend.test.case.node.collect_testcases()`` (about 1,900 cases over
about 200 ops in onnx 1.23). Each case goes through the path a user's model takes:
``import_onnx(model)`` -> ``kiln.load(graph)`` (the CPU runtime, optimized as users run it) -> run on
the case's inputs -> compare every output with the expected one the way the ONNX backend test runner
does (same shape, same dtype, ``assert_allclose`` at the case's ``rtol``/``atol``, NaN positions equal).

Each case ends in one of three outcomes:

* ``pass``;
* ``unsupported``: kiln says it cannot represent the case (the importer raises
  ``UnsupportedOpError``/``UnknownOpError``, or the case feeds sequences/optional values, which
  kiln's tensor-only IR has no type for);
* ``fail``: a wrong result or a crash anywhere on the way, or a case that ran past its time limit.
  The message is kept: it is the lead's to-do list.

The same cases also run through onnxruntime (CPU) so the report can put kiln's pass rate next to
the reference runtime's on exactly the same cases.

Two products come from a run (``python -m kiln.tools.onnx_conformance``):

* ``--report bench/CONFORMANCE.md``: totals, a per-op table, and every non-passing case of every
  op kiln registers with its reason (the issue's goal is that this last section be empty);
* ``--write-expected``: ``tests/fixtures/onnx_conformance_expected_failures.txt``, the committed list
  of cases that do not pass yet. ``tests/serializer/test_onnx_conformance.py`` fails CI when a case
  outside it stops passing, and when a listed case passes or changes outcome, so the list can only
  shrink.

Expanded cases (``test_x_expanded``, the same test with the op replaced by its ONNX function body)
count under the op they test, so an op's row says how kiln does on the op and on its decomposition.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import re
import signal
import sys
import threading
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from kiln.errors import UnknownOpError, UnsupportedOpError

PASS, FAIL, UNSUPPORTED = "pass", "fail", "unsupported"
STATUSES = (PASS, FAIL, UNSUPPORTED)

#: Seconds one case may take (import + load + run) before it counts as a failure. The cases are
#: tiny (the slowest take well under a second), so this only catches hangs and runaway loops.
DEFAULT_TIMEOUT_S = 20.0

#: Where ``--write-expected`` writes when given no path: the repository root is the package root.
EXPECTED_FAILURES_PATH = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / \
    "onnx_conformance_expected_failures.txt"

_EXPANDED = re.compile(r"_expanded(_ver\d+)?$")
_VERSION_LINE = re.compile(r"^#\s*onnx-version:\s*(\S+)\s*$")
_REASON_CHARS = 160
_ORT_BINDING = re.compile(r"can't be converted to MLDataType|No corresponding Numpy type")


# ----------------------------------------------------------------------------- the cases

@dataclass
class Case:
    """One ONNX backend node test: a model, its inputs and its expected outputs.

    ``inputs``/``outputs`` hold numpy arrays, or a list of arrays for a sequence value, or ``None``
    for an absent optional value (as the ONNX test generators write them). ``op`` is the operator the
    case tests (for an expanded case, the op whose function body it runs)."""

    name: str
    op: str
    model: Any  # onnx.ModelProto
    inputs: list
    outputs: list
    rtol: float = 1e-3
    atol: float = 1e-7

    @property
    def tensors_only(self) -> bool:
        """Whether every input and output is a plain tensor (kiln has no sequence/optional type)."""
        return all(isinstance(v, np.ndarray) for v in (*self.inputs, *self.outputs))


def _normalize(value: Any) -> Any:
    """A test value as an array, a list of arrays (a sequence) or None (an absent optional)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    import onnx

    if isinstance(value, onnx.TensorProto):
        from onnx import numpy_helper
        return numpy_helper.to_array(value)
    return np.asarray(value)  # numpy scalars (np.float32(1.0)) become 0-d arrays


def _qualified(domain: str, op_type: str) -> str:
    return f"{domain}.{op_type}" if domain not in ("", "ai.onnx") else op_type


def collect_cases(pattern: Optional[str] = None) -> list[Case]:
    """The ONNX backend node test cases of the installed onnx, sorted by name.

    ``pattern`` (a regular expression, searched in the case name) keeps only the matching cases."""
    raw = _raw_testcases()
    ops = {}
    for tc in raw:
        if not _EXPANDED.search(tc.name) and tc.model is not None and len(tc.model.graph.node) == 1:
            node = tc.model.graph.node[0]
            ops[tc.name] = _qualified(node.domain, node.op_type)
    cases = []
    rx = re.compile(pattern) if pattern else None
    for tc in raw:
        if rx is not None and not rx.search(tc.name):
            continue
        if tc.model is None or not tc.data_sets:
            continue  # model-zoo style cases (a URL to download): not node tests
        op = ops.get(_EXPANDED.sub("", tc.name))
        if op is None:  # not a one-node case and no one-node sibling: name it after its first node
            node = tc.model.graph.node[0]
            op = _qualified(node.domain, node.op_type)
        for k, (ins, outs) in enumerate(tc.data_sets):
            cases.append(Case(tc.name if len(tc.data_sets) == 1 else f"{tc.name}[{k}]", op, tc.model,
                              [_normalize(v) for v in ins], [_normalize(v) for v in outs],
                              float(tc.rtol), float(tc.atol)))
    cases.sort(key=lambda c: c.name)
    return cases


@functools.cache
def _raw_testcases() -> tuple:
    """onnx's generated cases, made once per process (generating them takes seconds). The runner
    never writes into their arrays: kiln and onnxruntime get copies of the inputs."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():  # the generators overflow and divide by zero on purpose
        warnings.simplefilter("ignore")
        return tuple(collect_testcases())


def kiln_registered_ops() -> set[str]:
    """The ai.onnx ops kiln's registry defines (kiln-domain fused ops are not ONNX ops)."""
    import kiln.ir.ops  # noqa: F401 - registers the ops
    from kiln.ir.registry import ONNX_DOMAIN, all_schemas

    return {s.name for s in all_schemas() if s.domain == ONNX_DOMAIN}


# ----------------------------------------------------------------------------- comparing outputs

def compare_outputs(expected: Sequence[Any], actual: Sequence[Any], rtol: float, atol: float) -> Optional[str]:
    """None when ``actual`` matches ``expected`` as the ONNX backend test runner requires, else why not.

    Per output: the same shape, the same dtype, and ``np.testing.assert_allclose(rtol, atol)``
    (which treats NaNs in the same positions as equal); strings compare exactly; bfloat16 gets two
    bfloat16 ULPs of relative tolerance, as in onnx's runner. Sequences compare element-wise."""
    if len(actual) != len(expected):
        return f"{len(actual)} outputs, expected {len(expected)}"
    for i, (exp, act) in enumerate(zip(expected, actual)):
        why = _compare_one(exp, act, rtol, atol)
        if why is not None:
            return f"output {i}: {why}"
    return None


def _compare_one(exp: Any, act: Any, rtol: float, atol: float) -> Optional[str]:
    if exp is None or act is None:
        return None if exp is None and act is None else f"got {_kind(act)}, expected {_kind(exp)}"
    if isinstance(exp, list):
        if not isinstance(act, (list, tuple)):
            return f"got {_kind(act)}, expected a sequence"
        return compare_outputs(exp, list(act), rtol, atol)
    if isinstance(act, (list, tuple)):
        return f"got a sequence, expected {_kind(exp)}"
    act = np.asarray(act)
    if act.shape != exp.shape:
        return f"shape {act.shape}, expected {exp.shape}"
    if exp.dtype == object:
        return None if np.array_equal(act, exp) else "strings differ"
    if act.dtype != exp.dtype:
        return f"dtype {act.dtype}, expected {exp.dtype}"
    if exp.dtype.name == "bfloat16":
        act, exp, rtol = act.astype(np.float32), exp.astype(np.float32), max(rtol, 2.0 ** -6)
    try:
        np.testing.assert_allclose(act, exp, rtol=rtol, atol=atol)
    except AssertionError as e:
        return _mismatch_summary(str(e), act, exp)
    return None


def _kind(v: Any) -> str:
    if v is None:
        return "nothing (absent optional)"
    if isinstance(v, (list, tuple)):
        return "a sequence"
    return "a tensor"


def _mismatch_summary(message: str, act: np.ndarray, exp: np.ndarray) -> str:
    """assert_allclose's verdict, without its array dumps, and the first mismatching element."""
    keep = [ln.strip() for ln in message.splitlines()
            if ln.strip().startswith(("Mismatched elements", "Max absolute", "Max relative", "x and y nan",
                                      "inf values", "+inf", "-inf", "nan location"))]
    text = "; ".join(keep) or "values differ"
    with np.errstate(all="ignore"):
        try:
            bad = ~np.isclose(act.astype(np.float64), exp.astype(np.float64), equal_nan=True)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                text += f"; first at {list(idx)}: got {act[idx]!r}, expected {exp[idx]!r}"
        except (TypeError, ValueError):
            pass
    return text


# ----------------------------------------------------------------------------- running one case

@dataclass
class Outcome:
    """How one case went on one runtime."""

    status: str
    reason: str = ""
    seconds: float = 0.0


class CaseTimeout(BaseException):
    """Raised by the per-case alarm. A BaseException, so kiln's ``except Exception`` wrappers let it
    through instead of reporting it as a kernel error."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block with :class:`CaseTimeout` after ``seconds`` (a SIGALRM timer, where the
    platform has one, this is the main thread and no one else's timer is running, e.g.
    pytest-timeout's; elsewhere the caller's elapsed-time check is the only guard)."""
    usable = (seconds > 0 and hasattr(signal, "setitimer")
              and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return

    def on_alarm(signum, frame):  # noqa: ARG001 - signal handler signature
        raise CaseTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _short(e: BaseException) -> str:
    """One line naming the exception: its type and its message with whitespace runs collapsed
    (a multi-line message such as a VerifyError's list of problems stays readable), truncated."""
    msg = " ".join(str(e).split())
    text = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


def default_importer() -> Callable[[Any], Any]:
    """``kiln.serializer.onnx_import.import_onnx``, imported when first needed."""
    from kiln.serializer.onnx_import import import_onnx
    return import_onnx


def run_kiln(case: Case, importer: Optional[Callable[[Any], Any]] = None, *,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """Run one case through kiln: import -> ``kiln.load`` (optimized) -> run -> compare."""
    if not case.tensors_only:
        return Outcome(UNSUPPORTED, "sequence/optional values (kiln's IR has tensors only)")
    from kiln.runtime import load

    importer = importer or default_importer()
    stage = "import"
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"), _deadline(timeout_s):
            warnings.simplefilter("ignore")
            graph = importer(case.model)
            stage = "load"
            program = load(graph)
            stage = "run"
            actual = program.run([np.array(x, copy=True) for x in case.inputs], as_list=True)
    except (UnsupportedOpError, UnknownOpError) as e:
        return Outcome(UNSUPPORTED, f"{stage}: {_short(e)}", time.perf_counter() - t0)
    except CaseTimeout:
        secs = time.perf_counter() - t0
        return Outcome(FAIL, f"{stage}: timed out after {secs:.1f} s (limit {timeout_s:g} s)", secs)
    except Exception as e:  # noqa: BLE001 - any crash is a failed case, with its message kept
        return Outcome(FAIL, f"{stage}: {_short(e)}", time.perf_counter() - t0)
    secs = time.perf_counter() - t0
    if timeout_s > 0 and secs > timeout_s:
        return Outcome(FAIL, f"took {secs:.1f} s (limit {timeout_s:g} s)", secs)
    why = compare_outputs(case.outputs, actual, case.rtol, case.atol)
    return Outcome(PASS, "", secs) if why is None else Outcome(FAIL, f"wrong result: {why}", secs)


def run_ort(case: Case, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Outcome:
    """Run one case through onnxruntime's CPU provider (one thread), compared the same way."""
    import onnxruntime as ort

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings(), _deadline(timeout_s):
            warnings.simplefilter("ignore")
            opts = ort.SessionOptions()
            opts.log_severity_level = 4  # the cases exercise edge cases ORT warns about
            opts.intra_op_num_threads = 1
            opts.inter_op_num_threads = 1
            sess = ort.InferenceSession(case.model.SerializeToString(), opts,
                                        providers=["CPUExecutionProvider"])
            names = [i.name for i in case.model.graph.input]
            feeds = {n: _copy(v) for n, v in zip(names, case.inputs) if v is not None}
            actual = sess.run(None, feeds)
    except CaseTimeout:
        secs = time.perf_counter() - t0
        return Outcome(FAIL, f"timed out after {secs:.1f} s", secs)
    except Exception as e:  # noqa: BLE001 - ORT's errors are many types; all mean "did not pass"
        return Outcome(FAIL, _short(e), time.perf_counter() - t0)
    secs = time.perf_counter() - t0
    why = compare_outputs(case.outputs, actual, case.rtol, case.atol)
    return Outcome(PASS, "", secs) if why is None else Outcome(FAIL, f"wrong result: {why}", secs)


def _copy(v: Any) -> Any:
    return [_copy(x) for x in v] if isinstance(v, list) else np.array(v, copy=True)


# ----------------------------------------------------------------------------- running the suite

@dataclass
class Results:
    """Outcomes of a run: per case, kiln's and (when run) onnxruntime's."""

    cases: list[Case]
    kiln: dict[str, Outcome]
    ort: dict[str, Outcome] = field(default_factory=dict)
    registered: set[str] = field(default_factory=set)
    seconds: float = 0.0

    def kiln_counts(self, names: Optional[Iterable[str]] = None) -> Counter:
        names = self.kiln if names is None else names
        return Counter(self.kiln[n].status for n in names)

    def ort_passed(self, names: Optional[Iterable[str]] = None) -> int:
        names = self.ort if names is None else names
        return sum(self.ort[n].status == PASS for n in names if n in self.ort)

    def by_op(self) -> dict[str, list[Case]]:
        groups: dict[str, list[Case]] = defaultdict(list)
        for c in self.cases:
            groups[c.op].append(c)
        return dict(sorted(groups.items(), key=lambda kv: kv[0].lower()))

    def not_passing(self) -> dict[str, Outcome]:
        """kiln's non-passing cases by name (failed or unsupported): the expected-failures list."""
        return {n: o for n, o in sorted(self.kiln.items()) if o.status != PASS}


def run_suite(cases: Sequence[Case], *, importer: Optional[Callable[[Any], Any]] = None, ort: bool = True,
              timeout_s: float = DEFAULT_TIMEOUT_S,
              progress: Optional[Callable[[int, int, Case], None]] = None) -> Results:
    """Run every case through kiln (and onnxruntime when ``ort``)."""
    importer = importer or default_importer()
    t0 = time.perf_counter()
    res = Results(list(cases), {}, registered=kiln_registered_ops())
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case)
        res.kiln[case.name] = run_kiln(case, importer, timeout_s=timeout_s)
        if ort:
            res.ort[case.name] = run_ort(case, timeout_s=timeout_s)
    res.seconds = time.perf_counter() - t0
    return res


# ----------------------------------------------------------------------------- expected failures

@dataclass(frozen=True)
class Expected:
    """A committed expected-failures list: per case its outcome (fail or unsupported) and why."""

    onnx_version: Optional[str]
    cases: dict  # name -> (status, reason)


def onnx_minor_version() -> str:
    """``major.minor`` of the installed onnx: the node-test cases change between minor releases."""
    import onnx
    return ".".join(onnx.__version__.split(".")[:2])


def format_expected(results: Results) -> str:
    lines = [
        "# ONNX backend node-test cases that do not pass in kiln, one per line: name, outcome (fail or",
        "# unsupported) and why. tests/serializer/test_onnx_conformance.py fails when a case missing",
        "# from this list stops passing, and when a listed case passes or changes outcome: the list only",
        "# shrinks. Regenerate with `python -m kiln.tools.onnx_conformance --write-expected`.",
        f"# onnx-version: {onnx_minor_version()}",
    ]
    width = max((len(n) for n in results.not_passing()), default=0)
    for name, o in results.not_passing().items():
        lines.append(f"{name.ljust(width)}  {o.status.ljust(len(UNSUPPORTED))}  # {o.reason}")
    return "\n".join(lines) + "\n"


def parse_expected(text: str) -> Expected:
    version, cases = None, {}
    for n, raw in enumerate(text.splitlines(), 1):
        m = _VERSION_LINE.match(raw)
        if m:
            version = m.group(1)
            continue
        body, _, reason = raw.partition("#")
        fields = body.split()
        if not fields:
            continue
        if len(fields) != 2 or fields[1] not in (FAIL, UNSUPPORTED):
            raise ValueError(f"line {n}: expected '<case> fail|unsupported  # reason', got {raw!r}")
        cases[fields[0]] = (fields[1], reason.strip())
    return Expected(version, cases)


def read_expected(path: "str | os.PathLike" = EXPECTED_FAILURES_PATH) -> Expected:
    return parse_expected(Path(path).read_text())


@dataclass
class Drift:
    """How a run differs from the committed list."""

    regressions: dict = field(default_factory=dict)  # name -> Outcome: not listed, did not pass
    now_passing: list = field(default_factory=list)  # listed, passes now
    changed: dict = field(default_factory=dict)  # name -> (listed status, Outcome): other outcome
    stale: list = field(default_factory=list)  # listed, no such case in this onnx

    @property
    def clean(self) -> bool:
        return not (self.regressions or self.now_passing or self.changed or self.stale)


def compare_with_expected(results: Results, expected: Expected) -> Drift:
    drift = Drift()
    for name, o in sorted(results.kiln.items()):
        listed = expected.cases.get(name)
        if listed is None:
            if o.status != PASS:
                drift.regressions[name] = o
        elif o.status == PASS:
            drift.now_passing.append(name)
        elif o.status != listed[0]:
            drift.changed[name] = (listed[0], o)
    drift.stale = sorted(set(expected.cases) - set(results.kiln))
    return drift


# ----------------------------------------------------------------------------- the report

def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    versions = ", ".join(f"{p} {_version(p)}" for p in ("kiln", "numpy", "onnx", "onnxruntime"))
    return (f"{cpu}, nproc {os.cpu_count()}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; {versions}; "
            f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")


def _pct(k: int, n: int) -> str:
    return f"{100.0 * k / n:.1f}%" if n else "-"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def format_report(results: Results) -> str:
    n = len(results.cases)
    kc = results.kiln_counts()
    has_ort = bool(results.ort)
    reg_names = [c.name for c in results.cases if c.op in results.registered]
    rc = results.kiln_counts(reg_names)
    groups = results.by_op()
    tols = Counter((c.rtol, c.atol) for c in results.cases)
    tolerances = ", ".join(f"rtol {r:g}, atol {a:g}" + ("" if len(tols) == 1 else f" for {k} cases")
                           for (r, a), k in tols.most_common()) or "none"
    out = [
        "# ONNX backend node-test conformance",
        "",
        "Generated by `python -m kiln.tools.onnx_conformance --report bench/CONFORMANCE.md`; do not "
        "edit by hand.",
        "",
        "Cases: `onnx.backend.test.case.node.collect_testcases()` of the installed onnx (expanded cases, "
        "which run an op's ONNX function body instead of the op, count under the op). Each case goes "
        "`import_onnx(model)` -> `kiln.load(graph)` (CPU runtime, optimized) -> run -> compare each output "
        "as onnx's backend runner does: same shape and dtype, `assert_allclose` at the case's rtol/atol "
        f"({tolerances}), NaNs in the same places. *unsupported*: the "
        "importer raised `UnsupportedOpError`/`UnknownOpError`, or the case passes sequences or optional "
        "values, which kiln's IR has no type for. *failed*: a wrong result, a crash, or over "
        f"{DEFAULT_TIMEOUT_S:g} s. The onnxruntime column runs the same models and data through an "
        "`InferenceSession` (CPUExecutionProvider) with the same comparison.",
        "",
        f"Machine: {machine_line()}",
        "",
        "## Totals",
        "",
        "| runtime | cases | passed | failed | unsupported | pass rate |",
        "|---|---:|---:|---:|---:|---:|",
        f"| kiln | {n} | {kc[PASS]} | {kc[FAIL]} | {kc[UNSUPPORTED]} | {_pct(kc[PASS], n)} |",
    ]
    if has_ort:
        op_ = results.ort_passed()
        out.append(f"| onnxruntime {_version('onnxruntime')} (CPU) | {n} | {op_} | {n - op_} | - | {_pct(op_, n)} |")
        binding = sum(1 for o in results.ort.values() if _ORT_BINDING.search(o.reason))
        if binding:
            out += ["", f"{binding} of onnxruntime's failures are cases whose tensors its Python binding cannot "
                    "pass as numpy arrays (float8, int4/uint4, int2, float4 and the like from ml_dtypes), not "
                    "necessarily missing kernels."]
    reg_ops = [op for op in groups if op in results.registered]
    out += [
        "",
        f"Ops: {len(groups)} in the suite, {len(reg_ops)} of them registered in kiln. On the "
        f"{len(reg_names)} cases of those ops kiln passes {rc[PASS]} ({_pct(rc[PASS], len(reg_names))}), fails "
        f"{rc[FAIL]}, and reports {rc[UNSUPPORTED]} unsupported"
        + (f"; onnxruntime passes {results.ort_passed(reg_names)}." if has_ort else "."),
        "",
        f"Run time: {results.seconds:.0f} s for both runtimes." if has_ort else
        f"Run time: {results.seconds:.0f} s.",
        "",
        "## Per op",
        "",
        "| op | in kiln | cases | kiln passed | kiln failed | kiln unsupported |"
        + (" ORT passed |" if has_ort else ""),
        "|---|:-:|---:|---:|---:|---:|" + ("---:|" if has_ort else ""),
    ]
    for op, cases in groups.items():
        names = [c.name for c in cases]
        c = results.kiln_counts(names)
        row = (f"| {op} | {'yes' if op in results.registered else ''} | {len(cases)} | {c[PASS]} | {c[FAIL]} | "
               f"{c[UNSUPPORTED]} |")
        if has_ort:
            row += f" {results.ort_passed(names)} |"
        out.append(row)
    out += ["", "## Ops kiln registers with failing cases", ""]
    failing = [(op, cases) for op, cases in groups.items() if op in results.registered
               and any(results.kiln[c.name].status != PASS for c in cases)]
    if not failing:
        out.append("None: every case of every op kiln registers passes.")
    for op, cases in failing:
        bad = [c for c in cases if results.kiln[c.name].status != PASS]
        out += [f"### {op} ({len(bad)} of {len(cases)} cases do not pass)", ""]
        for c in bad:
            o = results.kiln[c.name]
            out.append(f"- `{c.name}`: {o.status}: {_cell(o.reason)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def summary_line(results: Results) -> str:
    n = len(results.cases)
    kc = results.kiln_counts()
    text = (f"kiln: {kc[PASS]} passed, {kc[FAIL]} failed, {kc[UNSUPPORTED]} unsupported of {n} "
            f"({_pct(kc[PASS], n)})")
    if results.ort:
        text += f"; onnxruntime: {results.ort_passed()} passed of {n} ({_pct(results.ort_passed(), n)})"
    return text + f"; {results.seconds:.1f} s"


# ----------------------------------------------------------------------------- command line

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kiln.tools.onnx_conformance",
                                description="Run the ONNX backend node tests through kiln (and onnxruntime).")
    p.add_argument("--report", metavar="PATH", help="write the Markdown report (bench/CONFORMANCE.md)")
    p.add_argument("--write-expected", metavar="PATH", nargs="?", const=str(EXPECTED_FAILURES_PATH),
                   help="write the expected-failures list (default: %(const)s)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the run differs from the expected-failures list (what CI's test checks)")
    p.add_argument("-k", "--filter", metavar="REGEX", help="only the cases whose name matches")
    p.add_argument("--no-ort", action="store_true", help="skip onnxruntime")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case (default %(default)s)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every non-passing case")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.filter and (args.write_expected or args.check):
        print("--write-expected and --check need the whole suite (no -k)", file=sys.stderr)
        return 2
    cases = collect_cases(args.filter)
    results = run_suite(cases, ort=not args.no_ort, timeout_s=args.timeout)
    print(summary_line(results))
    if args.verbose:
        for name, o in results.not_passing().items():
            print(f"  {name}: {o.status}: {o.reason}")
    if args.report:
        Path(args.report).write_text(format_report(results))
        print(f"wrote {args.report}")
    if args.write_expected:
        Path(args.write_expected).write_text(format_expected(results))
        print(f"wrote {args.write_expected} ({len(results.not_passing())} cases)")
    if args.check:
        drift = compare_with_expected(results, read_expected())
        print(describe_drift(drift))
        return 0 if drift.clean else 1
    return 0


def describe_drift(drift: Drift) -> str:
    """What changed against the expected-failures list, and what the developer should do."""
    if drift.clean:
        return "matches the expected-failures list"
    parts = []
    if drift.regressions:
        parts.append(f"{len(drift.regressions)} case(s) not in the expected-failures list no longer pass "
                     "(regressions; fix them):\n" + "\n".join(f"  {n}: {o.status}: {o.reason}"
                                                            for n, o in drift.regressions.items()))
    if drift.now_passing:
        parts.append(f"{len(drift.now_passing)} listed case(s) pass now: remove them from the list "
                     "(it must shrink; `python -m kiln.tools.onnx_conformance --write-expected`):\n"
                     + "\n".join(f"  {n}" for n in drift.now_passing))
    if drift.changed:
        parts.append(f"{len(drift.changed)} listed case(s) changed outcome; regenerate the list if intended:\n"
                     + "\n".join(f"  {n}: listed {was}, now {o.status}: {o.reason}"
                                 for n, (was, o) in drift.changed.items()))
    if drift.stale:
        parts.append(f"{len(drift.stale)} listed case(s) are not in this onnx's suite: regenerate the list:\n"
                     + "\n".join(f"  {n}" for n in drift.stale))
    return "\n\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
