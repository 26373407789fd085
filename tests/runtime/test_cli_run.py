"""``kiln run`` / ``python -m kiln.runtime`` and ``kiln bench``: inputs, outputs, errors, timing, profile."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.cli import main
from kiln.ir import Graph
from kiln.runtime.profile import format_profile, profile_program

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODEL = str(FIXTURES / "mlp_runtime.kiln")
INPUTS = FIXTURES / "mlp_runtime_inputs.npz"
EXPECTED = FIXTURES / "mlp_runtime_expected.npz"


def x_input() -> np.ndarray:
    with np.load(INPUTS) as f:
        return f["x"]


def expected() -> dict:
    with np.load(EXPECTED) as f:
        return {k: f[k] for k in f.files}


def kiln_cmd(*args: str, module: str = "kiln") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)


def save_graph(g: Graph, tmp_path: Path, name: str) -> str:
    return str(kiln.save(g, tmp_path / name))


def single_output_model(tmp_path: Path) -> str:
    g = Graph("relu")
    g.outputs = [g.op("Relu", g.add_input("x", "float32", ("batch", 4)), name="y")]
    return save_graph(g, tmp_path, "relu.kiln")


def int_seq_model(tmp_path: Path) -> str:
    g = Graph("ids")
    ids = g.add_input("ids", "int64", ("batch", "seq"))
    g.outputs = [g.op("Add", ids, ids, name="twice")]
    return save_graph(g, tmp_path, "ids.kiln")


# ---------------------------------------------------------------------------- inputs and outputs
@pytest.mark.parametrize("module", ["kiln", "kiln.runtime"])
def test_run_writes_npz_matching_the_reference(tmp_path, module):
    out = tmp_path / "out.npz"
    args = ("run", MODEL) if module == "kiln" else (MODEL,)
    r = kiln_cmd(*args, "--input", f"x={INPUTS}", "-o", str(out), module=module)
    assert r.returncode == 0, r.stderr
    assert "wrote 2 output(s)" in r.stdout
    with np.load(out) as got:
        assert sorted(got.files) == ["logits", "probs"]
        for name, want in expected().items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)


def test_inputs_from_npy_npz_and_json_agree(tmp_path, capsys):
    x = x_input()
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "x.json").write_text(json.dumps(x.tolist()))
    sources = [f"x={tmp_path / 'x.npy'}", str(INPUTS), f"x={INPUTS}", f"x=@{tmp_path / 'x.json'}",
               f"x={json.dumps(x.tolist())}"]
    for i, spec in enumerate(sources):
        assert main(["run", MODEL, "--input", spec, "-o", str(tmp_path / f"o{i}.npz")]) == 0, spec
        with np.load(tmp_path / f"o{i}.npz") as got:
            np.testing.assert_allclose(got["probs"], expected()["probs"], rtol=1e-5, atol=1e-6, err_msg=spec)


def test_json_takes_the_input_dtype_only_where_nothing_is_lost(tmp_path, capsys):
    ints = [[1, 2, 3, 4]]
    assert main(["run", single_output_model(tmp_path), "--input", f"x={json.dumps(ints)}"]) == 0
    assert "y  float32[1,4]  min 1  mean 2.5  max 4" in capsys.readouterr().out
    ids_model = int_seq_model(tmp_path)
    assert main(["run", ids_model, "--input", "ids=[[1.5, 2]]"]) == 1
    assert "input 'ids': expected int64[batch,seq], got float64[1, 2]" in capsys.readouterr().err
    assert main(["run", ids_model, "--input", "ids=[[1, 2], [3]]"]) == 1
    assert "not a rectangular array" in capsys.readouterr().err


def test_npy_output_and_default_summary(tmp_path, capsys):
    model = single_output_model(tmp_path)
    x = np.array([[-1, 0, 2, 3]], np.float32)
    np.save(tmp_path / "x.npy", x)
    assert main(["run", model, "-i", f"x={tmp_path / 'x.npy'}", "-o", str(tmp_path / "y.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), np.maximum(x, 0))
    assert main(["run", model, "-i", f"x={tmp_path / 'x.npy'}"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "y  float32[1,4]  min 0  mean 1.25  max 3"


def test_an_output_named_like_a_savez_argument_is_written(tmp_path, capsys):
    g = Graph()
    g.outputs = [g.op("Neg", g.add_input("x", "float32", (2,)), name="file")]
    model = save_graph(g, tmp_path, "neg.kiln")
    assert main(["run", model, "-i", "x=[1, 2]", "-o", str(tmp_path / "o.npz")]) == 0
    with np.load(tmp_path / "o.npz") as got:
        np.testing.assert_array_equal(got["file"], [-1, -2])


def test_repeat_prints_latency_stats(capsys):
    assert main(["run", MODEL, "-i", str(INPUTS), "--repeat", "20", "--warmup", "2"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("latency over 20 runs (after 2 warm-up): median ")
    assert all(k in last for k in ("p90", "min", "mean", "max"))


def test_random_inputs_fill_float_inputs_only(tmp_path, capsys):
    assert main(["run", MODEL, "--random-inputs", "5"]) == 0
    assert "logits  float32[5,4]" in capsys.readouterr().out
    assert main(["run", int_seq_model(tmp_path), "--random-inputs", "2"]) == 1
    assert "fills float inputs only: give input 'ids'" in capsys.readouterr().err


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args, message", [
    (["missing.kiln", "-i", "x=[1]"], "no such file: missing.kiln"),
    ([MODEL, "-i", "x=nope.npy"], "no such file: nope.npy"),
    ([MODEL, "-i", "x"], "bad --input 'x': expected NAME=FILE.npy"),
    ([MODEL, "-i", "x=[[1,2"], "is not a .npy/.npz/.json file name nor valid JSON"),
    ([MODEL, "-i", "x=[[1, 2]]"], "input 'x': expected float32[batch,16], got float32[1, 2]"),
    ([MODEL, "-i", "x=" + json.dumps([[True] * 16])], "input 'x': expected float32[batch,16], got bool[1, 16]"),
    ([MODEL], "no data for input(s) x: float32[batch,16]: give each with --input NAME=..."),
    ([MODEL, "-i", "img=[[1]]"], "the model has no input 'img' (--input img=[[1]]); it takes x: float32[batch,16]. "
                                 "Did you mean --input x=[[1]]?"),
    ([MODEL, "-i", "img=[[1]]", "--random-inputs", "1"], "the model has no input 'img' (--input img=[[1]]); it takes"),
    ([MODEL, "-i", "x=[[1]]", "-i", "y=[2]", "-i", "z=[3]"],
     "the model has no inputs 'y' (--input y=[2]), 'z' (--input z=[3]); it takes x: float32[batch,16]"),
    ([MODEL, "-i", "x=[[1]]", "-i", "x=[[2]]"], "input 'x' is given twice"),
    ([MODEL, "--random-inputs", "1", "-o", "out.npy"], "the model has 2 outputs (logits, probs)"),
    ([MODEL, "--random-inputs", "1", "-o", "out.csv"], "-o takes a .npz file"),
])
def test_errors_are_one_line_exit_1(args, message, capsys):
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kiln run: error: ") and message in err, err


def test_an_npz_with_other_arrays_says_to_pick_by_name(tmp_path, capsys):
    np.savez(tmp_path / "all.npz", x=x_input(), probs=np.zeros(3))
    assert main(["run", MODEL, "-i", str(tmp_path / "all.npz")]) == 1
    err = capsys.readouterr().err
    assert f"the model has no input 'probs' (an array of {tmp_path / 'all.npz'}); it takes x: float32[batch,16]. " \
           f"Pick arrays by name from {tmp_path / 'all.npz'}: --input NAME=FILE.npz" in err, err
    assert main(["run", MODEL, "-i", f"x={tmp_path / 'all.npz'}"]) == 0


def test_input_names_are_checked_by_python_m_kiln_runtime_too():
    r = kiln_cmd(MODEL, "-i", "img=[[1]]", module="kiln.runtime")
    assert r.returncode == 1 and r.stderr.startswith("kiln run: error: the model has no input 'img'"), r.stderr


def test_wrong_dtype_in_a_real_process_has_no_traceback(tmp_path):
    np.save(tmp_path / "x64.npy", np.zeros((2, 16)))
    for module, args in (("kiln", ("run", MODEL)), ("kiln.runtime", (MODEL,))):
        r = kiln_cmd(*args, "--input", f"x={tmp_path / 'x64.npy'}", module=module)
        assert r.returncode == 1
        assert r.stderr.strip() == "kiln run: error: input 'x': expected float32[batch,16], got float64[2, 16]"


# ---------------------------------------------------------------------------- bench and profile
def test_bench_prints_latency_and_profile(capsys):
    assert main(["bench", MODEL, "--batch", "8", "--warmup", "1", "--repeat", "5", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "inputs   x: float32[8,16]" in out
    assert "latency over 5 runs (after 1 warm-up): median " in out
    ops = {}
    for ins in kiln.load(MODEL).plan.instructions:  # Gemm, Relu, Gemm, Relu, Gemm, Softmax: each Gemm and its Relu
        op = ("kiln." if ins.node.domain else "") + ins.node.op  # one FusedEpilogue where the sgemm runs them
        ops[op] = ops.get(op, 0) + 1
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in [[o] for o in ops]}
    assert {op: int(row[4]) for op, row in rows.items()} == ops  # calls per run


def test_bench_needs_sizes_of_symbols_other_than_batch(tmp_path, capsys):
    model = int_seq_model(tmp_path)
    assert main(["bench", model, "--repeat", "2"]) == 1
    assert "has the symbolic dim 'seq': give its size with --dim seq=SIZE" in capsys.readouterr().err
    assert main(["bench", model, "--batch", "2", "--dim", "seq=7", "--repeat", "2", "--warmup", "1"]) == 0
    assert "inputs   ids: int64[2,7]" in capsys.readouterr().out


def test_bench_threads_runs_in_a_child_with_blas_variables_set():
    r = kiln_cmd("bench", MODEL, "--threads", "1", "--repeat", "3", "--warmup", "1")
    assert r.returncode == 0, r.stderr
    assert "threads  1 (BLAS thread variables of this process)" in r.stdout  # printed by the child only


def test_profile_counts_every_instruction_and_names_kernels():
    program = kiln.load(MODEL)
    p = profile_program(program, {"x": x_input()}, runs=4)
    assert p.runs == 4
    counts = {}
    for ins in program.plan.instructions:
        op = ("kiln." if ins.node.domain else "") + ins.node.op
        counts[op] = counts.get(op, 0) + 4
    assert {s.op: s.calls for s in p.ops} == counts
    assert [s.seconds for s in p.ops] == sorted((s.seconds for s in p.ops), reverse=True)
    assert 0 < p.kernel_seconds <= p.wall_seconds
    assert {s.op: s.kernel for s in p.ops}["Softmax"] in ("fast", "reference")
    table = format_profile(p)
    assert "share %" in table and "mean µs" in table


# ---------------------------------------------------------------------------- an .onnx file kiln refuses
def unsupported_onnx(tmp_path: Path) -> str:
    """A model of one op kiln does not have (RandomUniformLike) and ONNX Runtime runs."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper
    node = helper.make_node("RandomUniformLike", ["x"], ["y"], seed=1.0)
    graph = helper.make_graph([node], "random", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    path = tmp_path / "random.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


ORT_HINT = "\nhint: ONNX Runtime is installed and may run this file: add --backend onnxruntime to the command\n"


@pytest.mark.parametrize("command", [["run", "--random-inputs", "1"], ["bench", "--repeat", "2"]])
def test_a_refused_onnx_file_points_to_the_op_list_and_onnxruntime(tmp_path, capsys, command):
    pytest.importorskip("onnxruntime")
    model = unsupported_onnx(tmp_path)
    assert main([command[0], model, *command[1:]]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"kiln {command[0]}: error: op 'RandomUniformLike' (domain ai.onnx, opset 17) in the unnamed "
                          "node writing 'y' is not supported by kiln (`kiln info --ops` lists the "), err
    assert err.endswith(ORT_HINT), err
    # The hint is right for this file: ONNX Runtime runs it.
    assert main([command[0], model, *command[1:], "--backend", "onnxruntime"]) == 0


def test_convert_and_serve_give_the_hint_too(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    model = unsupported_onnx(tmp_path)
    assert main(["convert", model, str(tmp_path / "random.kiln")]) == 1
    assert capsys.readouterr().err.endswith(
        f"\nhint: ONNX Runtime is installed and may run this file as it is: kiln run {model} --backend onnxruntime "
        "(kiln bench and kiln serve take --backend onnxruntime too)\n")
    # kiln serve wraps the load error ("loading models failed: ..."): the hint follows its cause.
    r = kiln_cmd("serve", model, "--port", "0", "--workers", "0")
    assert r.returncode == 1 and "kiln serve: error: loading models failed: op 'RandomUniformLike'" in r.stderr
    assert r.stderr.endswith(ORT_HINT), r.stderr
    from kiln.runtime.cli import with_hints
    from kiln.errors import KilnError, UnsupportedOpError

    def serve(args):
        try:
            raise UnsupportedOpError("op 'RandomUniformLike' ... is not supported by kiln")
        except UnsupportedOpError as e:
            raise KilnError(f"loading models failed: {e}") from e

    for path, says in ((model, "may run this file: add --backend onnxruntime"),
                       (str(tmp_path), 'or set "backend": "onnxruntime" in that model\'s config.json')):
        with pytest.raises(KilnError) as e:
            with_hints("serve", serve)(argparse.Namespace(path=path, backend=None))
        assert str(e.value).startswith("loading models failed: op 'RandomUniformLike'") and says in str(e.value)
    with pytest.raises(KilnError) as e:  # asked for ONNX Runtime already: no hint
        with_hints("serve", serve)(argparse.Namespace(path=model, backend="onnxruntime"))
    assert "hint" not in str(e.value)


def test_no_onnxruntime_hint_where_it_cannot_be_imported(tmp_path, capsys, monkeypatch):
    model = unsupported_onnx(tmp_path)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["run", model, "--random-inputs", "1"]) == 1
    err = capsys.readouterr().err
    assert "is not supported by kiln (`kiln info --ops` lists the " in err and "hint" not in err, err


def test_a_refused_kiln_file_gets_no_onnxruntime_hint(tmp_path, capsys):
    """Only .onnx files: a .kiln file's errors are kiln's own."""
    from kiln.runtime.cli import with_hints
    from kiln.errors import UnsupportedOpError

    def run(args):
        raise UnsupportedOpError("refused")

    with pytest.raises(UnsupportedOpError) as e:
        with_hints("run", run)(argparse.Namespace(model=str(tmp_path / "m.kiln"), backend="kiln"))
    assert str(e.value) == "refused"
