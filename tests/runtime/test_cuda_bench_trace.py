"""``kiln bench --device cuda --profile/--trace``: a CudaProgram's instructions timed by CUDA events
(runtime/profile.py's GPU loop, run through ``CudaProgram._execute``'s executor). Each trace goes
through test_bench_trace.py's ``check_trace`` (the Trace Event Format's rules, proper nesting on each
track): the host's launch spans on the thread's track, the GPU's times on the "GPU stream" track.

Runs only where CuPy and an NVIDIA GPU are present (CI skips the module)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from cuda_helpers import require_gpu

cp, pytestmark = require_gpu()

import kiln  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.ir.passes import infer_shapes  # noqa: E402
from kiln.runtime.plan import NESTED_EXECUTOR  # noqa: E402
from kiln.runtime.profile import (EAGER_NOTE, GPU_TID, chrome_trace, format_profile,  # noqa: E402
                                  profile_program)
from sample_graphs import loop_block  # noqa: E402


def _cpu_tests():
    spec = importlib.util.spec_from_file_location("bench_trace_checks", Path(__file__).with_name("test_bench_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CPU = _cpu_tests()
check_trace, MODEL = _CPU.check_trace, _CPU.MODEL


def tracks(trace: dict) -> tuple:
    """(host op events, host run events, GPU kernel events, GPU run events), after check_trace."""
    xs = check_trace(trace)
    host = [e for e in xs if e["tid"] != GPU_TID]
    gpu = [e for e in xs if e["tid"] == GPU_TID]
    return ([e for e in host if e["cat"] == "op"], [e for e in host if e["cat"] == "run"],
            [e for e in gpu if e["cat"] == "kernel"], [e for e in gpu if e["cat"] == "gpu_run"])


def inside(e: dict, outer: dict) -> bool:
    return outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_gpu_trace_has_a_host_and_a_gpu_event_per_instruction():
    program = kiln.load(MODEL, device="cuda")
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    p = profile_program(program, {"x": x}, runs=4, trace_runs=2)
    assert p.device == "cuda" and p.runs == 4 and len(p.trace) == 2 and NESTED_EXECUTOR.get() is None
    n_ins = len(program.plan.instructions)
    assert sum(s.calls for s in p.ops) == n_ins * 4 and all(s.host_seconds > 0 for s in p.ops)
    assert {s.kernel for s in p.ops} <= {"cuda", "host", "fallback"}
    trace = chrome_trace(p, process_name="kiln bench mlp")
    ops, runs, kernels, gpu_runs = tracks(trace)
    assert len(runs) == len(gpu_runs) == 2 and len(ops) == n_ins * 2
    names = {(e["tid"], e["name"]): e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names[(GPU_TID, "thread_name")].startswith("GPU stream ") and names[(GPU_TID, "thread_name")].endswith(
        "(CUDA events)")
    assert trace["otherData"]["execution"] == EAGER_NOTE and trace["otherData"]["device"] == "cuda"
    on_gpu = [e for e in ops if e["args"]["kernel"] != "host"]
    assert len(kernels) == len(on_gpu)  # shape arithmetic on the host has no GPU event
    for n in range(2):
        mine = sorted((e for e in kernels if e["args"]["run"] == n), key=lambda e: e["ts"])
        host_mine = sorted((e for e in on_gpu if e["args"]["run"] == n), key=lambda e: e["ts"])
        gpu_run = next(e for e in gpu_runs if e["args"]["run"] == n)
        assert [e["args"]["node"] for e in mine] == [e["args"]["node"] for e in host_mine]  # stream order
        assert all(inside(e, gpu_run) for e in mine)
        assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(mine, mine[1:]))  # one stream: in turn
    first = next(e for e in kernels if e["args"]["node"] == program.plan.instructions[0].node.name)
    assert first["args"]["input_shapes"][0] == [8, 16] and first["args"]["input_dtypes"][0] == "float32"
    assert first["args"]["launch_us"] > 0
    table = format_profile(p)
    assert table.startswith("per-op GPU time (CUDA events), per run (mean of 4 eager instrumented runs on ")
    assert "not a CUDA-graph replay" in table
    # The program runs as before afterwards (a graph replay where it captures one) and answers as the CPU does.
    got = program.run({"x": x}, as_list=True)[0].get()
    np.testing.assert_allclose(got, kiln.load(MODEL).run({"x": x}, as_list=True)[0], rtol=1e-4, atol=1e-5)


def test_gpu_time_is_the_kernels_not_the_launch():
    """A 4096^3 float32 MatMul: its GPU event (CUDA events) is milliseconds while its launch on the host is
    microseconds, and it agrees with CuPy's own product timed by events."""
    n = 4096
    g = Graph("big")
    a = g.add_input("a", "float32", (n, n))
    b = g.add_input("b", "float32", (n, n))
    g.outputs = [g.op("Relu", g.op("MatMul", a, b, name="mm"), name="act")]
    infer_shapes(g)
    program = kiln.load(g, device="cuda", fuse=False)
    rng = np.random.default_rng(1)
    feeds = [cp.asarray(rng.standard_normal((n, n)).astype(np.float32)) for _ in range(2)]
    p = profile_program(program, feeds, runs=3, trace_runs=3)
    _, _, kernels, _ = tracks(chrome_trace(p))
    mm = [e for e in kernels if e["args"]["node"] == "mm"]
    assert len(mm) == 3
    start, end = cp.cuda.Event(), cp.cuda.Event()
    cp.matmul(*feeds)
    start.record()
    for _ in range(3):
        cp.matmul(*feeds)
    end.record()
    end.synchronize()
    reference_us = cp.cuda.get_elapsed_time(start, end) * 1e3 / 3
    gpu_us = float(np.median([e["dur"] for e in mm]))
    assert 0.5 * reference_us < gpu_us < 2.0 * reference_us, (gpu_us, reference_us)
    assert gpu_us > 5 * float(np.median([e["args"]["launch_us"] for e in mm]))
    stat = next(s for s in p.ops if s.op == "MatMul")
    assert stat.kernel == "cuda" and stat.seconds / stat.calls * 1e6 == pytest.approx(gpu_us, rel=0.5)


def test_loop_and_if_bodies_nest_on_both_tracks():
    g = Graph("looped")
    x = g.add_input("x", "float32", (2, 4))
    g.outputs = [loop_block(g, g.op("Relu", x), 3)]
    program = kiln.load(g, device="cuda", optimize=False, fuse=False)
    p = profile_program(program, [np.ones((2, 4), np.float32)], runs=2, trace_runs=1)
    assert NESTED_EXECUTOR.get() is None
    assert {s.op for s in p.ops if s.kernel == "control"} == {"Loop"}
    ops, _, kernels, _ = tracks(chrome_trace(p))  # check_trace: proper nesting on each track
    for events in (ops, kernels):
        loop = next(e for e in events if e["name"] == "Loop")
        level1 = [e for e in events if e["args"].get("depth") == 1]
        level2 = [e for e in events if e["args"].get("depth") == 2]
        assert level1 and all(inside(e, loop) for e in level1)
        ifs = [e for e in level1 if e["name"] == "If"]
        assert len(ifs) == 3 and level2 and all(any(inside(e, i) for i in ifs) for e in level2)
    # x = ones: every iteration takes the then branch (Relu, Mul), on the device.
    assert sorted(e["name"] for e in kernels if e["args"].get("depth") == 2) == sorted(["Relu", "Mul"] * 3)
    assert {e["args"]["kernel"] for e in ops if e["name"] == "Identity"} == {"host"}  # the Loop's cond: host
    assert not any(e["name"] == "Identity" for e in kernels)
    out = program.run([np.ones((2, 4), np.float32)], as_list=True)[0]
    np.testing.assert_allclose(out.get(), kiln.load(g, optimize=False).run([np.ones((2, 4), np.float32)],
                                                                           as_list=True)[0], rtol=1e-6)


def test_bench_device_cuda_writes_the_gpu_trace(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert main(["bench", MODEL, "--device", "cuda", "--batch", "8", "--warmup", "2", "--repeat", "5",
                 "--trace", str(out), "--trace-runs", "2"]) == 0
    printed, err = capsys.readouterr()
    assert err == ""
    lines = printed.splitlines()
    device = next(line for line in lines if line.startswith("device   "))
    assert "(cuda:" in device and device.endswith("inputs uploaded once, outputs left on the device, each run waited for")
    assert not any(line.startswith("threads  ") for line in lines)
    runs_line = next(line for line in lines if line.startswith("runs     "))
    program = kiln.load(MODEL, device="cuda")
    assert runs_line == ("runs     CUDA-graph replay (one launch per run)" if program.cuda_graphs
                         else f"runs     eager (CUDA graphs off: cuda_graphs='auto' captures plans of at least 4 "
                              f"instructions, this one has {len(program.plan.instructions)})")
    assert "per-op GPU time (CUDA events), per run (mean of 5 eager instrumented runs" in printed
    assert "the GPU's CUDA-event times are on the 'GPU stream' track" in printed
    trace = json.loads(out.read_text())
    ops, runs, kernels, gpu_runs = tracks(trace)
    assert len(runs) == len(gpu_runs) == 2 and kernels
    assert {o["args"]["input_shapes"][0][0] for o in kernels} == {8}  # --batch 8
    assert trace["otherData"]["model"] == MODEL and trace["otherData"]["execution"] == EAGER_NOTE
    assert trace["otherData"]["gpu"] and "CUDA events" in trace["otherData"]["gpu_clock"]


def test_bench_device_cuda_without_trace_keeps_the_timed_path(capsys):
    assert main(["bench", MODEL, "--device", "cuda", "--warmup", "1", "--repeat", "3"]) == 0
    printed = capsys.readouterr().out
    assert "latency over 3 runs" in printed and "per-op" not in printed

