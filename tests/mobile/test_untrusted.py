"""Untrusted packed files (issue 16, item 10): the mobile metadata is checked before anything is
allocated, by ``kiln mobile bundle`` and by the stub runtime, with one-line kiln errors; a kernel
meeting attributes it cannot take fails with the node's name; and mutated packed files (the fuzzer of
tools/mobile_fuzz.py, a short run here, the long one by ``python -m kiln.tools.mobile_fuzz``) give
nothing but kiln errors, in bounded time and memory."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

import kiln
from kiln.cli import main
from kiln.errors import ExecutionError, FormatError
from kiln.mobile_stub import packed, runtime
from kiln.tools import mobile_fuzz as fuzz
from kiln.mobile_stub.pack import lifetimes, pack, read_arena

ARENA = packed.PROP_ARENA


@pytest.fixture(scope="module")
def seeds():
    return {name: pack(g) for name, g in fuzz.seed_graphs().items()}


def _write(graph, tmp_path, name="m", **props):
    g = graph.copy()
    for k, v in props.items():
        g.metadata.props[k] = v if isinstance(v, str) else json.dumps(v)
    return str(kiln.save(g, tmp_path / f"{name}.kiln"))


def _plan(graph) -> dict:
    return json.loads(graph.metadata.props[ARENA])


def _refused(path, match, max_arena_bytes=packed.MAX_ARENA_BYTES):
    """The stub refuses ``path`` with a one-line FormatError matching ``match``, allocating < 16 MiB."""
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match=match) as info:
            runtime.load(path, max_arena_bytes=max_arena_bytes)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and "\n" not in str(info.value)
    return info.value


def test_the_seeds_load_and_run(seeds, tmp_path):
    for name, g in seeds.items():
        stub = runtime.load(_write(g, tmp_path, name))
        x = np.ones(stub.infos[stub.inputs[0]][2], np.float32)
        want = kiln.load(g).run([x], as_list=True)
        for got, w in zip(stub.run(x), want):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_an_8_gib_arena_is_refused_before_allocation(seeds, tmp_path):
    plan = _plan(seeds["chain"])
    plan["size"] = 8 << 30
    _refused(_write(seeds["chain"], tmp_path, **{ARENA: plan}), r"size 8,589,934,592 is more than its slots need")
    name = next(iter(plan["values"]))  # a slot out at the end, so the size is "needed": still refused
    plan["values"][name][0] = (8 << 30) - 64
    _refused(_write(seeds["chain"], tmp_path, **{ARENA: plan}), r"over the 1,073,741,824-byte limit")


def test_arena_size_is_bounded_by_the_plan_and_slots_lie_inside_it(seeds, tmp_path):
    plan = _plan(seeds["chain"])
    plan["size"] -= 64
    _refused(_write(seeds["chain"], tmp_path, **{ARENA: plan}), r"lies outside the .*-byte arena")


@pytest.mark.parametrize("offset, match", [(-64, "non-negative integer"), (32, "not 64-aligned"),
                                           (1.5, "non-negative integer"), (True, "non-negative integer"),
                                           ("0", "non-negative integer"), (None, "non-negative integer")])
def test_bad_offsets_are_refused(seeds, tmp_path, offset, match):
    plan = _plan(seeds["chain"])
    plan["values"][next(iter(plan["values"]))][0] = offset
    _refused(_write(seeds["chain"], tmp_path, **{ARENA: plan}), match)


def test_overlapping_live_values_are_refused_but_reuse_of_dead_ones_is_not(seeds, tmp_path):
    g = seeds["chain"]
    plan = read_arena(g)
    life = {v.name: span for v, span in lifetimes(g).items()}
    names = [n for n in plan.values if plan.values[n][1]]
    pairs = [(a, b) for a in names for b in names if a < b]
    live = [(a, b) for a, b in pairs if life[a][0] <= life[b][1] and life[b][0] <= life[a][1]]
    assert live and len(live) < len(pairs)  # the chain has values live together and values that are not
    a, b = live[0]
    bad = _plan(g)
    bad["values"][b][0] = bad["values"][a][0]
    _refused(_write(g, tmp_path, **{ARENA: bad}), "overlaps .* while both are live")
    # Two values never live together may share bytes (the packer's reuse): put them at one offset.
    a, b = next((a, b) for a, b in pairs if (a, b) not in live)
    reuse = _plan(g)
    reuse["values"][b][0] = reuse["values"][a][0]
    end = max(o + n for o, n in reuse["values"].values())
    if reuse["size"] > (end + 63) // 64 * 64:
        reuse["size"] = (end + 63) // 64 * 64
    runtime.load(_write(g, tmp_path, "reuse", **{ARENA: reuse}))


def test_a_slot_for_a_graph_input_or_a_constant_is_refused(seeds, tmp_path):
    g = seeds["chain"]
    for name in ("x", "w"):
        plan = _plan(g)
        plan["values"][name] = [0, 64]
        plan["size"] = max(plan["size"], 64)
        _refused(_write(g, tmp_path, **{ARENA: plan}), "which no node writes")


@pytest.mark.parametrize("text, match", [("{", "not valid JSON"), ("[" * 100000 + "]" * 100000, "not valid JSON"),
                                         ("[]", "must be an object"), ('{"size": 0}', "must be an object"),
                                         ('{"size": 0, "alignment": 3, "values": {}}', "not a power of two"),
                                         ('{"size": 1e999, "alignment": 64, "values": {}}', "non-negative integer")])
def test_malformed_arena_json_is_refused(seeds, tmp_path, text, match):
    _refused(_write(seeds["chain"], tmp_path, **{ARENA: text}), match)


@pytest.mark.parametrize("ops", ['{"ops": []}', "[1, 2]", '["Conv"]', "nul", "[" * 5000])
def test_bundle_refuses_a_bad_manifest_with_one_line(seeds, tmp_path, capsys, ops):
    path = _write(seeds["chain"], tmp_path, **{packed.PROP_OPS: ops})
    assert main(["mobile", "bundle", path, "-o", str(tmp_path / "app.pyz")]) == 1
    err = capsys.readouterr().err.strip()
    assert "kiln.mobile.ops" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "app.pyz").exists()


def test_bundle_refuses_a_bad_arena_before_building(seeds, tmp_path, capsys):
    plan = _plan(seeds["chain"])
    plan["size"] = 8 << 30
    path = _write(seeds["chain"], tmp_path, **{ARENA: plan})
    assert main(["mobile", "bundle", path, "-o", str(tmp_path / "app.pyz")]) == 1
    err = capsys.readouterr().err.strip()
    assert "more than its slots need" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "app.pyz").exists()


def test_a_kernel_given_impossible_attributes_fails_naming_the_node(seeds, tmp_path):
    g = seeds["convnet"].copy()
    conv = next(n for n in g.nodes if n.op == "Conv")
    conv.attrs["pads"] = [1 << 20] * 4  # a huge padded copy if the kernel trusted it
    stub = runtime.load(str(kiln.save(g, tmp_path / "m.kiln")))
    tracemalloc.start()
    try:
        with pytest.raises(ExecutionError, match=rf"node '{conv.name}' \(Conv\).*pads"):
            stub.run(np.ones((1, 3, 8, 8), np.float32))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_value_shapes_past_int64_are_refused(seeds, tmp_path):
    g = seeds["chain"].copy()
    relu = g.nodes[0].outputs[0]
    relu.type = kiln.ir.types.TensorType(relu.type.dtype, [1 << 32, 1 << 32])  # int64 product wraps to 0
    path = str(kiln.save(g, tmp_path / "m.kiln"))
    _refused(path, "too large for any array|does not fit its type")


# ---------------------------------------------------------------------------- the fuzzer, short run
CI_SEED, CI_CASES = 5, 1500


def test_fuzzed_packed_files_give_only_kiln_errors():
    lines = []
    counts = fuzz.run(CI_CASES, CI_SEED, log=lines.append, memory_every=25)
    failures = [ln for ln in lines if ln.startswith("case ")]
    assert not failures, "\n".join(failures[:5])
    assert sum(counts.values()) == CI_CASES
    # Both outcomes are reached: mutations get past the checks to run, and most are refused.
    assert counts["ran"] > CI_CASES // 50 and counts["refused"] > CI_CASES // 2, counts


def test_fuzz_cases_are_reproducible(tmp_path):
    seeds = fuzz.build_seeds()
    a = fuzz.make_case(seeds, 1, 42, tmp_path)
    b = fuzz.make_case(seeds, 1, 42, tmp_path)
    assert a.data == b.data and a.note == b.note


def test_the_oracle_reports_a_non_kiln_exception(monkeypatch, seeds, tmp_path):
    """The fuzzer can fail: a stub that raises a bare error is caught as a crash."""
    _write(seeds["chain"], tmp_path)

    def boom(*a, **k):
        raise KeyError("x")

    monkeypatch.setattr(runtime, "load", boom)
    assert fuzz.check(tmp_path / "m.kiln").outcome == "crash"
