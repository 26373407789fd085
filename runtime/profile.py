"""Per-op profiling for ``kiln bench --profile``: time every instruction of a program's plan, add
the times up by op, and optionally keep each instruction's times as a trace (``--trace``).

The timing loop is a copy of ``plan.execute`` with a clock read around each kernel, so the plan
and its run loop stay free of instrumentation. In the per-op table, nested plans (If/Loop bodies,
fused bodies) count as their owning instruction. The wall time of an instrumented run minus the
kernel times is what the loop itself (and the clock, and a trace's bookkeeping) cost.

The trace (``chrome_trace``/``write_trace``) is what torch.profiler and onnxruntime's profiler
write: the Trace Event Format's JSON object, which Perfetto (ui.perfetto.dev) and chrome://tracing
open. Each traced run is one complete event (``"ph": "X"``, ``ts`` and ``dur`` in microseconds
from the first traced run's start) named ``run N``; inside it, one complete event per executed
instruction named by its op, with the node, its module path (the ``scope``/``source`` the tracer
recorded), the input and output value names and their run-time shapes and dtypes in ``args``.
While a run is traced, kernels running a nested plan run it through this module's loop too
(``plan.NESTED_EXECUTOR``), so an If branch, each Loop iteration's body and a fused group's body
show up as events nested inside their instruction's event (``args.depth`` > 0). Metadata events
(``"ph": "M"``) name the process and the thread.

On the GPU (a ``CudaProgram``, ``kiln bench --device cuda``) the runs are eager: the plan runs
kernel by kernel from Python through ``CudaProgram._execute`` with this module's loop as its
executor, never as a CUDA-graph replay (a replay is one launch, with nothing to time per
instruction). The loop records a pair of CUDA events on the current stream around each kernel call
and synchronizes once, at the end of the run; each instruction's GPU start and duration are then
read as times since the run's start event. A kernel call's host time is its launch (or a host
fallback's work); its GPU time is what the table adds up per op. The trace has the host's spans on
the thread's track and the GPU's on a second track ("GPU stream", tid ``GPU_TID``), as
torch.profiler shows CPU ops and CUDA kernels; the GPU track is placed on the host's clock at the
moment the run's start event was recorded (the GPU is idle then: the run before was waited for).
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

from kiln.errors import KilnError
from kiln.runtime.kernels import cpu
from kiln.runtime.plan import NESTED_EXECUTOR, Plan
from kiln.runtime.specialize import RECORD_AT

_CONTROL_OPS = ("If", "Loop")
# The trace's GPU track: a tid above any Linux thread id (pid_max is at most 2**22), so it is never
# the host thread's.
GPU_TID = 1 << 28
EAGER_NOTE = ("eager: the plan's kernels launched one by one from Python, not a CUDA-graph replay "
              "(the timed runs replay a graph where the program captures one)")


@dataclass
class OpStat:
    op: str
    kernel: str       # 'fast' (a CPU kernel), 'reference' (the IR reference) or 'control';
    #                   on the GPU 'cuda', 'host' (shape arithmetic), 'fallback' or 'control'
    seconds: float    # over all profiled runs (on the GPU: GPU time, from CUDA events)
    calls: int        # over all profiled runs
    host_seconds: Optional[float] = None  # on the GPU: the host's time in the kernel calls (launches)


@dataclass
class TracedRun:
    """One traced run: its clock readings (``time.perf_counter_ns``) and its instructions' events,
    ``(depth, instruction, start_ns, end_ns, inputs, outputs)`` in the order they ended (a nested
    body's before its owner's); ``inputs``/``outputs`` are ``(shape, dtype)`` per value.
    On the GPU, ``gpu`` holds ``(start_ns, end_ns, kernel kind)`` per event (the same order), and
    ``gpu_span`` the run's start and end events, on the host's clock (see the module docstring)."""
    start_ns: int
    end_ns: int
    events: list
    gpu: Optional[list] = None
    gpu_span: Optional[tuple] = None


@dataclass
class Profile:
    runs: int
    wall_seconds: float  # all instrumented runs, loop and clock included
    ops: list            # OpStat, most expensive first
    trace: list = field(default_factory=list)  # TracedRun per traced run (the first ``trace_runs`` runs)
    pid: int = 0         # where the runs ran, for the trace
    tid: int = 0
    device: str = "cpu"  # 'cuda': a CudaProgram's eager runs, timed by CUDA events
    gpu: dict = field(default_factory=dict)  # on the GPU: its name and the stream the runs used

    @property
    def kernel_seconds(self) -> float:
        return sum(s.seconds for s in self.ops)


def profile_program(program: Any, inputs: Union[Mapping[str, Any], list], runs: int = 20, *,
                    trace_runs: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> Profile:
    """Run ``program`` ``runs`` times (after one untimed run) timing every instruction; the first
    ``trace_runs`` of them are traced too (``Profile.trace``). ``progress(done, runs)`` is called
    after each run, outside the timed code. A ``CudaProgram`` is timed on the GPU (``profile_cuda``)."""
    from kiln.runtime.program import Program
    if getattr(program, "backend", None) == "kiln-cuda":
        return profile_cuda(program, inputs, runs, trace_runs=trace_runs, progress=progress)
    if not isinstance(program, Program):
        raise KilnError(f"profile_program times the instructions of kiln's own runtimes (a Program, or a "
                        f"CudaProgram from kiln.load(..., device='cuda')); a {type(program).__name__} is not one")
    arrays = program._check_inputs(inputs)
    seconds: dict = {}
    calls: dict = {}
    # The BLAS thread count program.run would use, set before each run as it does (one thread while the
    # host is busy: runtime/threads.py).
    apply_threads = getattr(getattr(program, "threads", None), "apply", None) or (lambda: None)
    apply_threads()
    # Warm-up: first-touch costs are not per-op costs; and runs through run() let a signature's specialized plan
    # be made (runtime/specialize.py), which is then what is timed, as it is what runs.
    for _ in range(RECORD_AT):
        program.run(arrays)
    traced: list = []
    clock = time.perf_counter_ns
    wall = 0
    for r in range(runs):
        events = [] if r < trace_runs else None
        apply_threads()
        start = clock()
        _timed_run(program, arrays, seconds, calls, events)
        end = clock()
        wall += end - start
        if events is not None:
            traced.append(TracedRun(start, end, events))
        if progress is not None:
            progress(r + 1, runs)
    ops = [OpStat(_op_name(key), _kernel_kind(key), t / 1e9, calls[key]) for key, t in seconds.items()]
    ops.sort(key=lambda s: s.seconds, reverse=True)
    return Profile(runs, wall / 1e9, ops, traced, os.getpid(), threading.get_native_id())


def _timed_run(program: Any, arrays: list, seconds: dict, calls: dict, events: Optional[list]) -> None:
    plan, template = program._plan_for(arrays)
    slots = list(template)
    for s, a in zip(plan.input_slots, arrays):
        slots[s] = a
    if events is None:
        _timed_execute(plan, slots, seconds, calls, None, 0)
        return
    token = NESTED_EXECUTOR.set(_NestedTracer(events))
    try:
        _timed_execute(plan, slots, seconds, calls, events, 0)
    finally:
        NESTED_EXECUTOR.reset(token)


class _NestedTracer:
    """What nested plans run through while a run is traced: this module's loop one level deeper."""

    def __init__(self, events: list):
        self.events = events
        self.depth = 0

    def __call__(self, plan: Plan, slots: list) -> None:
        self.depth += 1
        try:
            _timed_execute(plan, slots, None, None, self.events, self.depth)
        finally:
            self.depth -= 1


def _timed_execute(plan: Plan, slots: list, seconds: Optional[dict], calls: Optional[dict],
                   events: Optional[list], depth: int) -> None:
    """``plan.execute`` with each kernel call timed into ``seconds``/``calls`` by (domain, op) (when
    given: the top level) and, when tracing, appended to ``events`` with its values' shapes."""
    clock = time.perf_counter_ns
    for ins in plan.instructions:
        args = [None if s < 0 else slots[s] for s in ins.inputs]
        start = clock()
        result = ins.kernel(slots, *args) if ins.with_slots else ins.kernel(*args)
        end = clock()
        if seconds is not None:
            key = (ins.node.domain, ins.node.op)
            seconds[key] = seconds.get(key, 0) + (end - start)
            calls[key] = calls.get(key, 0) + 1
        if events is not None:
            outs = (result,) if ins.single else result
            events.append((depth, ins, start, end, [_describe(a) for a in args], [_describe(a) for a in outs]))
        _store(ins, slots, result)


# ---------------------------------------------------------------------------- the GPU
def profile_cuda(program: Any, inputs: Union[Mapping[str, Any], list], runs: int = 20, *,
                 trace_runs: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> Profile:
    """``profile_program`` for a ``CudaProgram``: ``runs`` eager runs (after one untimed run), each
    kernel call between two CUDA events on the current stream, one synchronize per run (see the module
    docstring). The table's times are GPU times; ``OpStat.host_seconds`` the host's time in the calls.
    Numpy inputs are uploaded once, before the runs."""
    import cupy as cp

    arrays = [a if isinstance(a, cp.ndarray) else cp.asarray(a) for a in program._check_inputs(inputs)]
    loop = _GpuLoop(cp, _cuda_kinds(program))
    seconds: dict = {}
    host: dict = {}
    calls: dict = {}
    traced: list = []
    wall = 0
    token = NESTED_EXECUTOR.set(loop)  # If/Loop bodies run through the same loop, one level deeper
    try:
        loop.run(program, arrays, trace=False)  # warm-up: compiles, plans, pool blocks
        for r in range(runs):
            run = loop.run(program, arrays, trace=r < trace_runs)
            wall += run.end_ns - run.start_ns
            for i, (depth, ins, start, end, _, _) in enumerate(run.events):
                if depth == 0:
                    key = (ins.node.domain, ins.node.op, run.gpu[i][2])
                    seconds[key] = seconds.get(key, 0) + (run.gpu[i][1] - run.gpu[i][0])
                    host[key] = host.get(key, 0) + (end - start)
                    calls[key] = calls.get(key, 0) + 1
            if r < trace_runs:
                traced.append(run)
            if progress is not None:
                progress(r + 1, runs)
    finally:
        NESTED_EXECUTOR.reset(token)
    ops = [OpStat(_op_name(key), key[2], t / 1e9, calls[key], host[key] / 1e9) for key, t in seconds.items()]
    ops.sort(key=lambda s: s.seconds, reverse=True)
    device = cp.cuda.Device()
    name = cp.cuda.runtime.getDeviceProperties(device.id)["name"]
    gpu = {"name": name.decode() if isinstance(name, bytes) else str(name), "device": device.id,
           "stream": loop.stream_name}
    return Profile(runs, wall / 1e9, ops, traced, os.getpid(), threading.get_native_id(), "cuda", gpu)


def _cuda_kinds(program: Any) -> dict:
    """id(node) -> how a CudaProgram runs it: 'cuda' (a device kernel), 'host' (shape arithmetic,
    on the host by design), 'fallback' (a CPU kernel on host copies) or 'control' (If/Loop)."""
    from kiln.runtime.cuda_program import _is_fallback
    on_host = set(map(id, program._host_nodes))
    kinds = {}
    for node, kernel in program._kernels:
        if node.domain == "" and node.op in _CONTROL_OPS:
            kinds[id(node)] = "control"
        elif id(node) in on_host:
            kinds[id(node)] = "host"
        else:
            kinds[id(node)] = "fallback" if _is_fallback(kernel) else "cuda"
    return kinds


class _GpuLoop:
    """The executor of an instrumented GPU run (``CudaProgram._execute(..., executor=loop)``) and of
    its nested plans (``plan.NESTED_EXECUTOR``): ``plan.execute`` with a pair of CUDA events recorded
    around each kernel call on the current stream and the host clock read inside them. Events are
    reused from run to run (each run is waited for before its events are read)."""

    def __init__(self, cp: Any, kinds: dict):
        self.cp = cp
        self.kinds = kinds
        self.pool: list = []
        self.used = 0
        self.depth = 0
        self.stream = None
        self.stream_name = ""
        self.records: list = []
        self.trace = False

    def _event(self) -> Any:
        if self.used == len(self.pool):
            self.pool.append(self.cp.cuda.Event())
        self.used += 1
        return self.pool[self.used - 1]

    def run(self, program: Any, arrays: list, trace: bool) -> TracedRun:
        """One run: its host span, its events (as ``TracedRun``; the shapes only when ``trace``) and
        each event's GPU span."""
        cp = self.cp
        self.stream = stream = cp.cuda.get_current_stream()
        self.stream_name = "default" if stream.ptr == 0 else hex(stream.ptr)
        self.used, self.depth, self.records, self.trace = 0, 0, [], trace
        first, last = self._event(), self._event()
        clock = time.perf_counter_ns
        start = clock()
        first.record(stream)
        _, guards = program._execute(arrays, executor=self)
        last.record(stream)
        last.synchronize()
        end = clock()
        guards.raise_first_failure()  # as run() does: a failed guard is an error, not a timing
        elapsed = cp.cuda.get_elapsed_time
        events, gpu = [], []
        for depth, ins, s, e, a, b, ins_desc, outs_desc in self.records:
            events.append((depth, ins, s, e, ins_desc, outs_desc))
            # Both ends from the run's start event: in stream order, so an event never starts before
            # the one before it ends (two separate elapsed times could round into each other).
            gpu.append((start + int(elapsed(first, a) * 1e6), start + int(elapsed(first, b) * 1e6),
                        self.kinds.get(id(ins.node), "cuda")))
        return TracedRun(start, end, events, gpu, (start, start + int(elapsed(first, last) * 1e6)))

    def __call__(self, plan: Plan, slots: list) -> None:
        depth = self.depth
        self.depth += 1
        try:
            self._execute(plan, slots, depth)
        finally:
            self.depth -= 1

    def _execute(self, plan: Plan, slots: list, depth: int) -> None:
        clock = time.perf_counter_ns
        stream, records, trace = self.stream, self.records, self.trace
        for ins in plan.instructions:
            args = [None if s < 0 else slots[s] for s in ins.inputs]
            a, b = self._event(), self._event()
            a.record(stream)
            start = clock()
            result = ins.kernel(slots, *args) if ins.with_slots else ins.kernel(*args)
            end = clock()
            b.record(stream)
            if trace:
                outs = (result,) if ins.single else result
                records.append((depth, ins, start, end, a, b, [_describe(x) for x in args],
                                [_describe(x) for x in outs]))
            else:
                records.append((depth, ins, start, end, a, b, None, None))
            _store(ins, slots, result)


def _describe(a: Any) -> tuple:
    """(shape, dtype) of a run-time value as they are (an array's own tuple and dtype object: a
    ``str(dtype)`` costs microseconds, so ``_json_type`` formats them when the trace is written); a
    sequence's length; (None, None) for an omitted optional input."""
    if a is None:
        return None, None
    shape, dtype = getattr(a, "shape", None), getattr(a, "dtype", None)
    if shape is not None and dtype is not None:
        return shape, dtype
    if isinstance(a, (list, tuple)):
        return (len(a),), "sequence"
    return None, type(a).__name__


def _json_type(desc: tuple, names: dict) -> tuple:
    """``_describe``'s (shape, dtype) as JSON values: a list of ints (or None) and a dtype name
    (``names`` caches the names of the dtypes seen)."""
    shape, dtype = desc
    if dtype is not None and not isinstance(dtype, str):
        name = names.get(dtype)
        if name is None:
            name = names[dtype] = str(dtype)
        dtype = name
    return (None if shape is None else [int(d) for d in shape]), dtype


def _store(ins, slots: list, result) -> None:
    """What the plan's own loop does after a kernel (kiln.runtime.plan.execute, kept inline there, a hot path):
    the result(s) into their slots, the values that die here released."""
    if ins.single:
        slots[ins.outputs[0]] = result
    else:
        for s, r in zip(ins.outputs, result):
            slots[s] = r
    for s in ins.release:
        slots[s] = None


def _op_name(key: tuple) -> str:
    return f"{key[0]}.{key[1]}" if key[0] else key[1]


def _kernel_kind(key: tuple) -> str:
    if key[0] == "" and key[1] in _CONTROL_OPS:
        return "control"
    return "fast" if key in cpu.KERNELS else "reference"


def format_profile(p: Profile) -> str:
    """A table per op, per run: total ms, share of kernel time, calls, mean µs per call."""
    if p.device == "cuda":
        return _format_cuda(p)
    kernel_total = p.kernel_seconds or 1e-12
    width = max([len(s.op) for s in p.ops] + [len("op")])
    lines = [f"per-op time, per run (mean of {p.runs} instrumented runs)",
             f"{'op':<{width}}  {'kernel':<9}  {'total ms':>9}  {'share %':>7}  {'calls':>6}  {'mean µs':>9}"]
    for s in p.ops:
        lines.append(f"{s.op:<{width}}  {s.kernel:<9}  "
                     f"{s.seconds / p.runs * 1e3:>9.4f}  {100 * s.seconds / kernel_total:>7.1f}  "
                     f"{s.calls // p.runs:>6}  {s.seconds / s.calls * 1e6:>9.2f}")
    per_run = p.wall_seconds / p.runs * 1e3
    kernels = p.kernel_seconds / p.runs * 1e3
    lines.append(f"kernels {kernels:.4f} ms of {per_run:.4f} ms per instrumented run; the rest "
                 f"({per_run - kernels:.4f} ms) is the run loop and the clock itself"
                 + (" (and the trace's bookkeeping)" if p.trace else ""))
    return "\n".join(lines)


def _format_cuda(p: Profile) -> str:
    """The GPU's table: GPU ms per op and per run (CUDA events), its share, calls, mean GPU µs per
    call, and the host's ms in the calls (launches; a fallback's whole work)."""
    gpu_total = p.kernel_seconds or 1e-12
    width = max([len(s.op) for s in p.ops] + [len("op")])
    lines = [f"per-op GPU time (CUDA events), per run (mean of {p.runs} eager instrumented runs on "
             f"{p.gpu.get('name', 'the GPU')})",
             f"{'op':<{width}}  {'kernel':<9}  {'GPU ms':>9}  {'share %':>7}  {'calls':>6}  {'mean µs':>9}  "
             f"{'host ms':>9}"]
    for s in p.ops:
        lines.append(f"{s.op:<{width}}  {s.kernel:<9}  "
                     f"{s.seconds / p.runs * 1e3:>9.4f}  {100 * s.seconds / gpu_total:>7.1f}  "
                     f"{s.calls // p.runs:>6}  {s.seconds / s.calls * 1e6:>9.2f}  {s.host_seconds / p.runs * 1e3:>9.4f}")
    per_run = p.wall_seconds / p.runs * 1e3
    gpu = p.kernel_seconds / p.runs * 1e3
    host = sum(s.host_seconds for s in p.ops) / p.runs * 1e3
    lines.append(f"GPU {gpu:.4f} ms in instructions of {per_run:.4f} ms per instrumented run (wall, one "
                 f"synchronize per run); the host spent {host:.4f} ms in the kernel calls. The runs are "
                 "eager (one launch per kernel, not a CUDA-graph replay): where the host is slower than the "
                 "GPU, an instruction's GPU time includes its wait for the launch")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the trace
def chrome_trace(p: Profile, *, process_name: str = "kiln", metadata: Optional[dict] = None) -> dict:
    """``p``'s traced runs in the Trace Event Format (a JSON object: ``traceEvents``,
    ``displayTimeUnit``, ``otherData``; see the module docstring). ``process_name`` names the
    process in the viewer; ``metadata`` goes to ``otherData``."""
    if not p.trace:
        raise KilnError("the profile holds no traced runs: profile with trace_runs >= 1")
    pid, tid = p.pid, p.tid
    base = p.trace[0].start_ns
    names: dict = {}  # dtype -> its name
    events: list = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": process_name}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": "kiln run loop"}},
    ]
    on_gpu = p.device == "cuda"
    if on_gpu:
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": GPU_TID,
                       "args": {"name": f"GPU stream {p.gpu.get('stream', '')} (CUDA events)"}})
    for n, run in enumerate(p.trace):
        top = sum(1 for e in run.events if e[0] == 0)
        events.append({"name": f"run {n}", "cat": "run", "ph": "X", "ts": _us(run.start_ns - base),
                       "dur": _us(run.end_ns - run.start_ns), "pid": pid, "tid": tid,
                       "args": {"run": n, "instructions": top, "events": len(run.events)}})
        # Start order, an owner before its nested body's events (it starts first; at an equal clock
        # reading the shallower one first).
        order = sorted(range(len(run.events)), key=lambda i: (run.events[i][2], run.events[i][0]))
        gpu_events = []
        for i in order:
            depth, ins, start, end, ins_desc, outs_desc = run.events[i]
            args = _event_args(n, depth, ins, ins_desc, outs_desc, names, run.gpu[i][2] if on_gpu else None)
            events.append({"name": ins.node.qualified_op, "cat": "op", "ph": "X", "ts": _us(start - base),
                           "dur": _us(end - start), "pid": pid, "tid": tid, "args": args})
            if on_gpu and run.gpu[i][2] != "host":  # shape arithmetic does nothing on the GPU
                gpu_start, gpu_end, _ = run.gpu[i]
                gpu_events.append((gpu_start, depth, {
                    "name": ins.node.qualified_op, "cat": "kernel", "ph": "X", "ts": _us(gpu_start - base),
                    "dur": _us(gpu_end - gpu_start), "pid": pid, "tid": GPU_TID,
                    "args": dict(args, launch_us=_us(end - start))}))
        if on_gpu:
            gpu_start, gpu_end = run.gpu_span
            events.append({"name": f"run {n}", "cat": "gpu_run", "ph": "X", "ts": _us(gpu_start - base),
                           "dur": _us(gpu_end - gpu_start), "pid": pid, "tid": GPU_TID,
                           "args": {"run": n, "events": len(gpu_events)}})
            events.extend(e for _, _, e in sorted(gpu_events, key=lambda g: (g[0], g[1])))
    other = {"producer": "kiln bench --trace", "runs": len(p.trace), "clock": "time.perf_counter_ns"}
    if on_gpu:
        other.update(device="cuda", gpu=p.gpu.get("name"), execution=EAGER_NOTE,
                     gpu_clock="CUDA events on the run's stream, each instruction's start and end read "
                               "from the run's start event; the GPU track starts at the host time that "
                               "event was recorded")
    other.update(metadata or {})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def _event_args(run: int, depth: int, ins: Any, ins_desc: list, outs_desc: list, names: dict,
                kind: Optional[str] = None) -> dict:
    """An op event's ``args``; ``kind`` is the GPU program's kernel kind (None: the CPU's, by op)."""
    node = ins.node
    args: dict = {"node": node.name, "run": run}
    if node.meta.get("scope"):
        args["module"] = node.meta["scope"]
    if node.meta.get("source"):
        args["source"] = node.meta["source"]
    if depth:
        args["depth"] = depth  # inside an If/Loop body or a fused group's body
    args["kernel"] = kind or _kernel_kind((node.domain, node.op))
    # A control-flow kernel also reads outer values through the slots: those are not listed.
    ins_json = [_json_type(d, names) for d in ins_desc]
    outs_json = [_json_type(d, names) for d in outs_desc]
    args["inputs"] = [None if v is None else v.name for v in node.inputs]
    args["input_shapes"] = [d[0] for d in ins_json]
    args["input_dtypes"] = [d[1] for d in ins_json]
    args["outputs"] = [v.name for v in node.outputs]
    args["output_shapes"] = [d[0] for d in outs_json]
    args["output_dtypes"] = [d[1] for d in outs_json]
    return args


def write_trace(p: Profile, path: Union[str, os.PathLike], **options: Any) -> int:
    """Write ``chrome_trace(p, **options)`` to ``path`` as JSON; returns the number of events."""
    trace = chrome_trace(p, **options)
    try:
        with open(path, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
    except OSError as e:
        raise KilnError(f"cannot write {os.fspath(path)}: {e.strerror or e}") from None
    return len(trace["traceEvents"])
