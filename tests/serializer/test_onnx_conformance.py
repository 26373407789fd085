"""The ONNX conformance runner and the CI gate built on it.

The runner's parts are checked on small hand-made cases (how outputs compare, how a case is classed,
the per-case time limit, the expected-failures file). The gate runs every ONNX backend node-test case
through kiln and compares the outcomes with tests/fixtures/onnx_conformance_expected_failures.txt:
a case outside the list that does not pass is a regression, and a listed case that passes (or
changes outcome) means the list must be regenerated, so it only ever shrinks.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from kiln.errors import UnsupportedOpError  # noqa: E402
from kiln.ir import Graph  # noqa: E402
from kiln.tools import onnx_conformance as oc  # noqa: E402

EXPECTED = Path(__file__).resolve().parents[1] / "fixtures" / "onnx_conformance_expected_failures.txt"


# ----------------------------------------------------------------------------- small cases

def relu_model():
    node = helper.make_node("Relu", ["x"], ["y"])
    graph = helper.make_graph([node], "relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def relu_case(name="test_relu_small"):
    x = np.array([[-1.0, 0.5, 2.0], [3.0, -0.25, 0.0]], np.float32)
    return oc.Case(name, "Relu", relu_model(), [x], [np.maximum(x, 0)])


def kiln_graph(op):
    """A stand-in importer's result: x -> op -> y, built with kiln's own graph API."""
    g = Graph("relu")
    x = g.add_input("x", "float32", (2, 3))
    g.outputs = [g.op(op, x)]
    return g


def test_compare_outputs_follows_the_onnx_runner():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    assert oc.compare_outputs([a], [a.copy()], 1e-3, 1e-7) is None  # NaNs in the same place are equal
    assert oc.compare_outputs([a], [a * (1 + 5e-4)], 1e-3, 1e-7) is None  # within rtol
    why = oc.compare_outputs([a], [a * 1.01], 1e-3, 1e-7)
    assert why.startswith("output 0: Mismatched elements: 2 / 3") and "first at [0]" in why
    assert oc.compare_outputs([a], [a.astype(np.float64)], 1e-3, 1e-7) == "output 0: dtype float64, expected float32"
    assert oc.compare_outputs([a], [a[None]], 1e-3, 1e-7) == "output 0: shape (1, 3), expected (3,)"
    assert oc.compare_outputs([a, a], [a], 1e-3, 1e-7) == "1 outputs, expected 2"
    assert oc.compare_outputs([[a, a]], [[a, a]], 1e-3, 1e-7) is None  # sequences compare element-wise
    assert "expected a sequence" in oc.compare_outputs([[a]], [a], 1e-3, 1e-7)
    b = np.array([True, False])
    assert "Mismatched elements: 1 / 2" in oc.compare_outputs([b], [~b | b], 1e-3, 1e-7)
    s = np.array(["a", "b"], dtype=object)
    assert oc.compare_outputs([s], [s.copy()], 1e-3, 1e-7) is None
    assert oc.compare_outputs([s], [np.array(["a", "c"], dtype=object)], 1e-3, 1e-7) == "output 0: strings differ"


def test_a_case_passes_fails_or_is_unsupported():
    case = relu_case()
    assert oc.run_kiln(case, lambda m: kiln_graph("Relu")).status == oc.PASS

    wrong = oc.run_kiln(case, lambda m: kiln_graph("Abs"))
    assert wrong.status == oc.FAIL and wrong.reason.startswith("wrong result: output 0: Mismatched")

    def unsupported(model):
        raise UnsupportedOpError("op 'Relu' (node 'n0', domain '', opset 18) has no kiln mapping")

    o = oc.run_kiln(case, unsupported)
    assert o.status == oc.UNSUPPORTED and o.reason == ("import: UnsupportedOpError: op 'Relu' (node 'n0', "
                                                       "domain '', opset 18) has no kiln mapping")

    def crashes(model):
        raise IndexError("list index out of range")

    assert oc.run_kiln(case, crashes).reason == "import: IndexError: list index out of range"

    seq = oc.Case("test_seq", "SequenceAt", case.model, [[case.inputs[0]]], case.outputs)
    o = oc.run_kiln(seq, lambda m: pytest.fail("a sequence case must not reach the importer"))
    assert o.status == oc.UNSUPPORTED and "sequence/optional" in o.reason


def test_the_runner_does_not_let_kiln_write_into_the_case_inputs():
    case = relu_case()
    before = case.inputs[0].copy()
    assert oc.run_kiln(case, lambda m: kiln_graph("Relu")).status == oc.PASS
    np.testing.assert_array_equal(case.inputs[0], before)


def test_a_case_over_its_time_limit_fails_instead_of_hanging():
    def slow(model):
        time.sleep(5)
        return kiln_graph("Relu")

    t0 = time.perf_counter()
    o = oc.run_kiln(relu_case(), slow, timeout_s=0.2)
    assert time.perf_counter() - t0 < 2
    assert o.status == oc.FAIL and o.reason.startswith("import: timed out after")


def test_onnxruntime_runs_the_same_case():
    pytest.importorskip("onnxruntime")
    case = relu_case()
    assert oc.run_ort(case).status == oc.PASS
    bad = oc.Case("test_relu_bad", "Relu", case.model, case.inputs, [case.outputs[0] + 1])
    o = oc.run_ort(bad)
    assert o.status == oc.FAIL and o.reason.startswith("wrong result:")


def results_of(outcomes):
    cases = [oc.Case(n, "Relu", None, [], []) for n in outcomes]
    return oc.Results(cases, {n: oc.Outcome(s, f"why {n}") for n, s in outcomes.items()}, registered={"Relu"})


def test_expected_failures_file_round_trips_and_drift_is_classified():
    before = results_of({"test_a": oc.PASS, "test_b": oc.FAIL, "test_c": oc.UNSUPPORTED, "test_d": oc.FAIL})
    expected = oc.parse_expected(oc.format_expected(before))
    assert expected.onnx_version == oc.onnx_minor_version()
    assert expected.cases == {"test_b": ("fail", "why test_b"), "test_c": ("unsupported", "why test_c"),
                              "test_d": ("fail", "why test_d")}
    assert oc.compare_with_expected(before, expected).clean

    after = results_of({"test_a": oc.FAIL, "test_b": oc.PASS, "test_c": oc.FAIL})
    drift = oc.compare_with_expected(after, expected)
    assert list(drift.regressions) == ["test_a"]
    assert drift.now_passing == ["test_b"]
    assert {n: (was, o.status) for n, (was, o) in drift.changed.items()} == {"test_c": ("unsupported", "fail")}
    assert drift.stale == ["test_d"]
    text = oc.describe_drift(drift)
    assert "no longer pass" in text and "remove them from the list" in text and "changed outcome" in text

    with pytest.raises(ValueError, match="line 1"):
        oc.parse_expected("test_x  broken  # no such outcome\n")


def test_report_lists_every_failing_case_of_a_registered_op():
    res = results_of({"test_relu_a": oc.PASS, "test_relu_b": oc.FAIL})
    res.ort = {"test_relu_a": oc.Outcome(oc.PASS), "test_relu_b": oc.Outcome(oc.PASS)}
    text = oc.format_report(res)
    assert "| kiln | 2 | 1 | 1 | 0 | 50.0% |" in text
    assert "| Relu | yes | 2 | 1 | 1 | 0 | 2 |" in text
    assert "### Relu (1 of 2 cases do not pass)\n\n- `test_relu_b`: fail: why test_relu_b" in text


# ----------------------------------------------------------------------------- the real suite

@pytest.fixture(scope="module")
def cases():
    return oc.collect_cases()


def test_expanded_cases_count_under_the_op_they_test(cases):
    by_name = {c.name: c for c in cases}
    assert len(cases) > 1000
    assert by_name["test_softmax_axis_0"].op == by_name["test_softmax_axis_0_expanded"].op == "Softmax"
    assert by_name["test_adagrad"].op == "ai.onnx.preview.training.Adagrad"
    assert not by_name["test_sequence_insert_at_back"].tensors_only


@pytest.fixture(scope="module")
def expected():
    exp = oc.read_expected(EXPECTED)
    if exp.onnx_version != oc.onnx_minor_version():
        pytest.skip(f"{EXPECTED.name} lists the cases of onnx {exp.onnx_version}; onnx "
                    f"{oc.onnx_minor_version()} is installed and generates other cases (regenerate the list "
                    "with `python -m kiln.tools.onnx_conformance --write-expected` when moving onnx)")
    return exp


@pytest.fixture(scope="module")
def kiln_results(cases, expected):  # noqa: ARG001 - skips first when the list is for another onnx
    return oc.run_suite(cases, ort=False)


def test_no_case_outside_the_expected_failures_regresses(kiln_results, expected):
    drift = oc.compare_with_expected(kiln_results, expected)
    assert not drift.regressions, oc.describe_drift(oc.Drift(regressions=drift.regressions))


def test_expected_failures_list_only_shrinks(kiln_results, expected):
    drift = oc.compare_with_expected(kiln_results, expected)
    drift.regressions = {}  # the test above reports those
    assert drift.clean, oc.describe_drift(drift)


def test_command_line_writes_a_report_for_the_selected_cases(tmp_path, capsys):
    report = tmp_path / "CONFORMANCE.md"
    assert oc.main(["-k", "^test_relu$", "--no-ort", "--report", str(report)]) == 0
    assert capsys.readouterr().out.startswith("kiln: 1 passed, 0 failed, 0 unsupported of 1 (100.0%)")
    text = report.read_text()
    assert "| Relu | yes | 1 | 1 | 0 | 0 |" in text
    assert "None: every case of every op kiln registers passes." in text
    # the committed list describes the whole suite: it is never written from a subset
    assert oc.main(["-k", "^test_relu$", "--write-expected", str(tmp_path / "list.txt")]) == 2
    assert not (tmp_path / "list.txt").exists()
