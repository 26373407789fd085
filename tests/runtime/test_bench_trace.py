"""``kiln bench --trace`` (a Chrome trace / Perfetto file of the instrumented runs) and ``kiln bench``'s
progress line. Every trace written here goes through ``check_trace``: the Trace Event Format's rules
(complete events with ts/dur in microseconds, pid/tid, metadata events naming process and thread) and
proper nesting within a thread, as Perfetto's importer needs."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.cli import main
from kiln.ir import Graph
from kiln.ir.passes import infer_shapes
from kiln.ir.passes.fuse import fuse_elementwise
from kiln.runtime.plan import NESTED_EXECUTOR, execute
from kiln.runtime.profile import chrome_trace, profile_program, write_trace
from sample_graphs import loop_block

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = str(FIXTURES / "mlp_runtime.kiln")   # Gemm, Relu, Gemm, Relu, Gemm, Softmax (6 instructions)
# The instructions kiln.load makes of it: 6, or 4 where the extension's sgemm runs a Gemm and its Relu as one
# (runtime/kernels/cpu/native.py, fusable)
MLP_OPS = [("kiln." if ins.node.domain else "") + ins.node.op for ins in kiln.load(MODEL).plan.instructions]
N_OPS = len(MLP_OPS)


def check_trace(trace: dict) -> list:
    """Assert the Trace Event Format's rules and proper nesting; returns the complete events."""
    json.loads(json.dumps(trace))  # plain JSON values only
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["displayTimeUnit"] in ("ms", "ns")
    meta = [e for e in events if e["ph"] == "M"]
    xs = [e for e in events if e["ph"] == "X"]
    assert len(meta) + len(xs) == len(events)
    assert {e["name"] for e in meta} == {"process_name", "thread_name"}
    for e in meta:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and isinstance(e["args"]["name"], str)
    for e in xs:
        assert isinstance(e["name"], str) and e["name"] and isinstance(e["cat"], str)
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["ts"] >= 0 and e["dur"] >= 0
        assert isinstance(e["args"], dict)
    threads = {(e["pid"], e["tid"]) for e in xs}
    assert threads <= {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    # Within a thread, complete events nest or follow each other, never overlap partly (in whole ns).
    for thread in threads:
        mine = sorted((round(e["ts"] * 1000), -round(e["dur"] * 1000)) for e in xs if (e["pid"], e["tid"]) == thread)
        open_ends: list = []
        for start, neg_dur in mine:
            while open_ends and start >= open_ends[-1]:
                open_ends.pop()
            end = start - neg_dur
            assert not open_ends or end <= open_ends[-1], "an event ends after the event it starts in"
            open_ends.append(end)
    return xs


def runs_and_ops(xs: list) -> tuple:
    runs = sorted((e for e in xs if e["cat"] == "run"), key=lambda e: e["ts"])
    ops = [e for e in xs if e["cat"] == "op"]
    return runs, ops


def inside(e: dict, outer: dict) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1e-3


# ---------------------------------------------------------------------------- the trace itself
def test_trace_has_one_event_per_instruction_and_run_with_shapes_and_dtypes():
    program = kiln.load(MODEL)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    p = profile_program(program, {"x": x}, runs=5, trace_runs=3)
    assert p.runs == 5 and len(p.trace) == 3
    assert sum(s.calls for s in p.ops) == N_OPS * 5  # the table still counts every instrumented run
    xs = check_trace(chrome_trace(p, process_name="kiln bench mlp"))
    runs, ops = runs_and_ops(xs)
    assert [r["name"] for r in runs] == ["run 0", "run 1", "run 2"]
    assert len(ops) == len(program.plan.instructions) * 3
    for n, run in enumerate(runs):
        mine = sorted((e for e in ops if e["args"]["run"] == n), key=lambda e: e["ts"])
        assert [e["name"] for e in mine] == MLP_OPS
        assert [e["args"]["node"] for e in mine] == [ins.node.name for ins in program.plan.instructions]
        assert all(inside(e, run) for e in mine)
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(mine, mine[1:]))  # one after another
        assert run["args"]["instructions"] == N_OPS
    gemm = next(e for e in ops if e["args"]["inputs"][:1] == ["x"])["args"]  # the first Gemm (with its Relu)
    assert gemm["inputs"] == ["x", "fc0.weight", "fc0.bias"]
    assert gemm["input_shapes"] == [[8, 16], [32, 16], [32]] and gemm["output_shapes"] == [[8, 32]]
    assert gemm["input_dtypes"] == ["float32"] * 3 and gemm["output_dtypes"] == ["float32"]
    assert gemm["kernel"] in ("fast", "reference") and "depth" not in gemm
    names = {e["name"]: e["args"]["name"] for e in chrome_trace(p)["traceEvents"] if e["ph"] == "M"}
    assert names["process_name"] == "kiln" and names["thread_name"] == "kiln run loop"


def test_trace_names_module_paths_and_source_lines(monkeypatch):
    from kiln.runtime.kernels.cpu import native
    monkeypatch.setattr(native, "fusable", lambda anchor, consumer: False)  # the MatMul and the Relu as they are
    g = Graph("scoped")
    x = g.add_input("x", "float32", ("batch", 4))
    w = g.add_initializer("encoder.fc.weight", np.eye(4, dtype=np.float32))
    h = g.op("MatMul", x, w, name="fc")
    h.producer.meta.update({"scope": "encoder.fc", "source": "model.py:12"})
    g.outputs = [g.op("Relu", h, name="act")]
    infer_shapes(g)
    p = profile_program(kiln.load(g), [np.ones((2, 4), np.float32)], runs=1, trace_runs=1)
    _, ops = runs_and_ops(check_trace(chrome_trace(p)))
    by_node = {e["args"]["node"]: e["args"] for e in ops}
    assert by_node["fc"]["module"] == "encoder.fc" and by_node["fc"]["source"] == "model.py:12"
    assert "module" not in by_node["act"] and "source" not in by_node["act"]  # nothing recorded: nothing made up


def test_loop_iterations_and_if_branches_are_nested_events(monkeypatch):
    """Loop(3 trips) whose body runs an If: each iteration's body instructions inside the Loop's event
    (depth 1), the branch's instructions inside the If's (depth 2); the table counts the Loop once. (The
    native extension's load-time fusion is off here: the events are checked against the body's own ops.)"""
    from kiln.runtime.kernels.cpu import native
    monkeypatch.setattr(native, "_native", None)
    g = Graph("looped")
    x = g.add_input("x", "float32", (2, 4))
    g.outputs = [loop_block(g, g.op("Relu", x), 3)]
    program = kiln.load(g, optimize=False)
    body = next(n for n in g.nodes if n.op == "Loop").attrs["body"]
    p = profile_program(program, [np.ones((2, 4), np.float32)], runs=2, trace_runs=2)
    assert NESTED_EXECUTOR.get() is None  # the tracer is gone once the runs are
    assert {s.op: s.calls for s in p.ops} == {"Relu": 2, "Loop": 2}
    runs, ops = runs_and_ops(check_trace(chrome_trace(p)))
    assert sum(1 for e in ops if "depth" not in e["args"]) == len(program.plan.instructions) * 2
    for n, run in enumerate(runs):
        loop = next(e for e in ops if e["name"] == "Loop" and e["args"]["run"] == n)
        level1 = [e for e in ops if e["args"]["run"] == n and e["args"].get("depth") == 1]
        assert len(level1) == 3 * len(body.nodes) and all(inside(e, loop) for e in level1)
        assert [e["name"] for e in sorted(level1, key=lambda e: e["ts"])] == [m.op for m in body.nodes] * 3
        ifs = [e for e in level1 if e["name"] == "If"]
        level2 = [e for e in ops if e["args"]["run"] == n and e["args"].get("depth") == 2]
        # x = ones: every iteration's value is positive, so each If runs its then branch (Relu, Mul).
        assert sorted(e["name"] for e in level2) == sorted(["Relu", "Mul"] * 3)
        assert all(any(inside(e, i) for i in ifs) for e in level2)
        assert loop["args"]["input_shapes"][2] == [2, 4] and loop["args"]["output_shapes"] == [[2, 4]]
    # A plain run afterwards goes through plan.execute again, and agrees with the profiled program.
    out = program.run([np.ones((2, 4), np.float32)], as_list=True)[0]
    assert out.shape == (2, 4)


def test_nested_tracer_is_seen_by_its_own_thread_only():
    """The hook bodies run through is a context variable: a server thread running the same program while
    another thread traces it runs its bodies through plan.execute, untimed."""
    g = Graph("looped")
    x = g.add_input("x", "float32", (2, 4))
    g.outputs = [loop_block(g, x, 2)]
    program = kiln.load(g, optimize=False)
    seen: list = []

    def recorder(plan, slots):
        seen.append(threading.current_thread().name)
        execute(plan, slots)

    token = NESTED_EXECUTOR.set(recorder)
    try:
        worker = threading.Thread(target=program.run, args=([np.ones((2, 4), np.float32)],), name="other")
        worker.start()
        worker.join()
        assert seen == []
        program.run([np.ones((2, 4), np.float32)])
        assert seen and set(seen) == {threading.current_thread().name}
    finally:
        NESTED_EXECUTOR.reset(token)


def test_fused_group_body_is_nested_in_its_event():
    g = Graph("chain")
    x = g.add_input("x", "float32", ("batch", 8))
    g.outputs = [g.op("Erf", g.op("Neg", g.op("Relu", x)))]
    infer_shapes(g)
    assert fuse_elementwise(g) == 1
    program = kiln.load(g, optimize=False)
    assert [ins.node.qualified_op for ins in program.plan.instructions] == ["kiln.FusedElementwise"]
    p = profile_program(program, [np.ones((3, 8), np.float32)], runs=1, trace_runs=1)
    _, ops = runs_and_ops(check_trace(chrome_trace(p)))
    fused = next(e for e in ops if e["name"] == "kiln.FusedElementwise")
    body = sorted((e for e in ops if e["args"].get("depth") == 1), key=lambda e: e["ts"])
    assert [e["name"] for e in body] == ["Relu", "Neg", "Erf"] and all(inside(e, fused) for e in body)
    assert body[0]["args"]["input_shapes"] == [[3, 8]]


def test_without_trace_runs_nothing_is_kept_and_chrome_trace_says_why():
    p = profile_program(kiln.load(MODEL), {"x": np.ones((1, 16), np.float32)}, runs=2)
    assert p.trace == []
    with pytest.raises(kiln.KilnError, match="no traced runs: profile with trace_runs >= 1"):
        chrome_trace(p)


def test_write_trace_reports_an_unwritable_path(tmp_path):
    p = profile_program(kiln.load(MODEL), {"x": np.ones((1, 16), np.float32)}, runs=1, trace_runs=1)
    assert write_trace(p, tmp_path / "t.json") == 2 + 1 + N_OPS  # metadata, the run, its instructions
    with pytest.raises(kiln.KilnError, match=r"cannot write .*missing/t.json: No such file or directory"):
        write_trace(p, tmp_path / "missing" / "t.json")


def test_profile_refuses_what_is_not_the_cpu_runtime():
    class Other:
        plan, _template = None, []
    with pytest.raises(kiln.KilnError, match=r"times the instructions of kiln's own runtimes \(a Program, or a "
                                             r"CudaProgram from kiln.load\(..., device='cuda'\)\); a Other is not one"):
        profile_program(Other(), {})


# ---------------------------------------------------------------------------- the command
def test_bench_trace_writes_the_file_and_implies_profile(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert main(["bench", MODEL, "--batch", "8", "--warmup", "1", "--repeat", "5", "--trace", str(out),
                 "--trace-runs", "2"]) == 0
    printed, err = capsys.readouterr()
    assert err == ""  # not a terminal: no progress line
    assert "per-op time, per run (mean of 5 instrumented runs)" in printed  # the table, without --profile
    assert (f"trace    {out}: 2 runs, {2 * N_OPS + 4} events; open it at https://ui.perfetto.dev or chrome://tracing"
            in printed)
    trace = json.loads(out.read_text())
    runs, ops = runs_and_ops(check_trace(trace))
    assert len(runs) == 2 and len(ops) == N_OPS * 2
    assert {o["args"]["input_shapes"][0][0] for o in ops if o["args"]["inputs"][:1] == ["x"]} == {8}  # --batch 8
    assert trace["otherData"]["model"] == MODEL and trace["otherData"]["inputs"] == "x: float32[8,16]"
    meta = {e["name"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta["process_name"] == "kiln bench mlp_runtime.kiln"


def test_bench_trace_runs_default_and_more_than_repeat(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", MODEL, "--warmup", "1", "--repeat", "3", "--trace", str(out)]) == 0
    assert "mean of 10 instrumented runs" in capsys.readouterr().out  # the 10 traced runs, though --repeat 3
    runs, ops = runs_and_ops(check_trace(json.loads(out.read_text())))
    assert len(runs) == 10 and len(ops) == 10 * N_OPS


@pytest.mark.parametrize("argv, message", [
    (["--trace-runs", "3"], "--trace-runs sets how many runs --trace writes: give --trace FILE.json too"),
    (["--trace", "{tmp}/t.json", "--backend", "onnxruntime"],
     "--trace times kiln's own instructions: it works with --backend kiln only (ONNX Runtime has its own "
     "profiler: SessionOptions.enable_profiling, which writes the same trace format)"),
    (["--trace", "{tmp}/nowhere/t.json"], "cannot write the trace to {tmp}/nowhere/t.json: no such directory "
                                          "{tmp}/nowhere"),
    (["--trace", "{tmp}"], "cannot write the trace to {tmp}: it is a directory (give a file name, e.g. {tmp}/trace.json)"),
])
def test_bench_trace_mistakes_are_said_before_any_run(tmp_path, capsys, argv, message):
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["bench", MODEL, "--repeat", "2", *argv]) == 1
    out, err = capsys.readouterr()
    assert out == ""  # refused before loading or timing anything
    assert err.strip() == "kiln bench: error: " + message.format(tmp=tmp_path)


def test_bench_device_cuda_without_cupy_is_refused_by_name(tmp_path, capsys, monkeypatch):
    """No CuPy (CI, a CPU-only install): said before the model is read or anything timed, naming the
    package to install; --threads (the CPU's BLAS threads) is refused with --device cuda by name too."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # what `import cupy` meets where CuPy is not installed
    assert main(["bench", str(tmp_path / "not-read.kiln"), "--device", "cuda", "--trace", str(tmp_path / "t.json")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and not (tmp_path / "t.json").exists()
    assert err.startswith("kiln bench: error: --device cuda needs CuPy (pip install 'kiln-compiler[gpu]'): ")
    assert main(["bench", MODEL, "--device", "cuda", "--threads", "2"]) == 1
    assert capsys.readouterr().err.strip() == ("kiln bench: error: --threads sets the CPU runtime's BLAS threads: "
                                               "--device cuda does not take it")


def test_bench_help_says_instrumented_gpu_runs_are_eager(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--device {cpu,cuda}" in text and "timed runs replay a CUDA graph where the model can be captured" in text
    assert ("With --device cuda these runs are eager (each kernel launched on its own, not a replay of a CUDA "
            "graph)") in text
    assert "a second track (GPU stream) holds each instruction's GPU time from CUDA events" in text


def test_bench_trace_runs_must_be_positive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", MODEL, "--trace", "t.json", "--trace-runs", "0"])
    assert e.value.code == 2
    assert "argument --trace-runs: expected a positive integer, not '0'" in capsys.readouterr().err


def test_bench_help_documents_trace_and_progress(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--trace FILE.json" in text and "Implies --profile; kiln backend only" in text
    assert "https://ui.perfetto.dev" in text and "--trace-runs N" in text
    assert "progress (loading, warm-up, timed and instrumented runs) is shown on one line of stderr" in text


def test_bench_threads_child_writes_the_trace(tmp_path):
    out = tmp_path / "child.json"
    r = subprocess.run([sys.executable, "-m", "kiln", "bench", MODEL, "--threads", "1", "--repeat", "2",
                        "--warmup", "1", "--trace", str(out), "--trace-runs", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # piped: no progress line
    assert "threads  1 (BLAS thread variables of this process)" in r.stdout
    runs, ops = runs_and_ops(check_trace(json.loads(out.read_text())))
    assert len(runs) == 1 and len(ops) == N_OPS


# ---------------------------------------------------------------------------- progress
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def screen(text: str) -> list:
    """What a terminal shows for ``text``: each line after its carriage returns overwrote it."""
    lines = []
    for raw in text.split("\n"):
        shown: list = []
        for part in raw.split("\r"):
            shown[:len(part)] = part
        lines.append("".join(shown).rstrip())
    return lines


def test_bench_progress_on_a_terminal_is_erased_before_each_print(monkeypatch):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stdout", term)
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["bench", MODEL, "--warmup", "2", "--repeat", "4", "--profile"]) == 0
    raw = term.getvalue()
    for shown in (f"\rloading {MODEL}", "\rwarm-up 2/2", "\rtimed runs 4/4", "\rinstrumented runs 4/4"):
        assert shown in raw
    lines = screen(raw)
    assert lines[0].startswith("model    ") and lines[1].startswith("inputs   ")
    assert any(line.startswith("latency over 4 runs") for line in lines)
    assert not any(re.search(r"^loading |(warm-up|timed runs|instrumented runs) \d+/\d+", line) for line in lines)
    assert lines[-1] == ""  # the last status line erased


def test_bench_progress_line_is_cleared_when_the_run_fails(monkeypatch, tmp_path):
    term = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main(["bench", str(tmp_path / "missing.kiln")]) == 1
    assert screen(term.getvalue()) == [f"kiln bench: error: no such file: {tmp_path / 'missing.kiln'}", ""]

