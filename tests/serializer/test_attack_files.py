"""The hand-made malicious .kiln files (issue 16, serializer/attack_files.py): each is rejected
with FormatError or loads, in bounded time and memory; loading is linear in uses, readers and
nodes; the load limits refuse what they say; kernels never see a form the schema forbids; a
run that would pass the memory budget is refused before any buffer is allocated."""
from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

import kiln
from kiln.ir import Graph, verify
from kiln.ir.registry import AttrKind, all_schemas
from kiln.serializer import attack_files as af
from kiln.serializer.reader import LoadLimits

SMALL = sorted(af.ATTACKS)
SECONDS = 5.0            # per small file, on a busy 2-core machine (they take 0.2 s or less alone)
PEAK_BYTES = 64 << 20    # tracemalloc peak per small file


def _load(data: bytes, **kw):
    return kiln.load_graph_from_bytes(data, **kw)


@pytest.mark.parametrize("name", SMALL)
def test_each_attack_is_rejected_or_loads_in_bounded_time_and_memory(name):
    attack = af.ATTACKS[name]
    data = af.build(name)
    start = time.perf_counter()
    try:
        graph = _load(data)
    except kiln.FormatError as e:
        outcome, message = "reject", str(e)
    else:
        outcome, message = "load", ""
        verify(graph)
    elapsed = time.perf_counter() - start
    tracemalloc.start()  # a second load, for its memory (tracemalloc slows a load several times)
    try:
        try:
            _load(data)
        except kiln.FormatError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = "reject" if attack.expect == "reject" else "load"
    assert outcome == expected, f"{name}: {outcome} {message}"
    assert elapsed < SECONDS, f"{name} took {elapsed:.2f} s"
    assert peak < PEAK_BYTES, f"{name} peaked at {peak / 2**20:.0f} MiB"
    if outcome == "reject":
        assert message and "Traceback" not in message


@pytest.mark.parametrize("name", [n for n, a in af.ATTACKS.items() if a.expect in ("load", "refuse_run")])
def test_files_that_load_also_plan_or_are_refused_with_a_kiln_error(name, tmp_path):
    """kiln.load (optimize + plan) never raises anything but a KilnError on them."""
    path = tmp_path / f"{name}.kiln"
    path.write_bytes(af.build(name))
    try:
        kiln.load(path, memory_budget="1GiB")
    except kiln.ResourceError:
        assert af.ATTACKS[name].expect == "refuse_run"


# --------------------------------------------------------------------------- linear time


def _cpu_seconds(data: bytes, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        _load(data)
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("name,small,large", [("many_uses", 10_000, 40_000), ("readers", 2_000, 8_000),
                                              ("chain", 2_000, 8_000), ("wide_subgraphs", 250, 1_000)])
def test_load_time_is_linear(name, small, large):
    """4x the size costs about 4x the time (before issue 16: 16x for uses and readers)."""
    build = af.ATTACKS[name].build
    a, b = build(small), build(large)
    _load(a)  # warm-up
    ta, tb = _cpu_seconds(a), _cpu_seconds(b)
    assert tb < 8 * ta + 0.05, f"{name}: {small} -> {ta:.3f} s, {large} -> {tb:.3f} s"


def test_eighty_thousand_uses_of_one_value_load_fast():
    data = af.many_uses(80_000)  # 115.8 s before issue 16
    start = time.perf_counter()
    graph = kiln.load_graph_from_bytes(data)
    assert time.perf_counter() - start < 5.0
    assert len(graph.inputs[0].uses) == 80_000


def test_deep_chain_does_not_hit_the_recursion_limit():
    data = af.chain(30_000)
    program = kiln.load(_tmp_write(data))
    x = np.array([-1, 0, 1, 2], np.float32)
    np.testing.assert_array_equal(program.run({"x": x})["v29999"], np.maximum(x, 0))


def _tmp_write(data: bytes):
    import tempfile
    f = tempfile.NamedTemporaryFile(suffix=".kiln", delete=False)
    f.write(data)
    f.close()
    return f.name


# --------------------------------------------------------------------------- limits


def test_max_nodes_refuses_before_decoding():
    data = af.chain(20_000)
    start = time.perf_counter()
    with pytest.raises(kiln.FormatError, match=r"more than 1,000 nodes .*max_nodes"):
        _load(data, limits=LoadLimits(max_nodes=1_000))
    assert time.perf_counter() - start < 0.25
    assert len(_load(data, limits=LoadLimits(max_nodes=20_000)).nodes) == 20_000


def test_max_nodes_counts_subgraph_nodes():
    data = af.wide_fan_in_subgraphs(100)  # 100 If nodes + 200 body nodes
    with pytest.raises(kiln.FormatError, match="Node tables"):
        _load(data, limits=LoadLimits(max_nodes=250))
    _load(data, limits=LoadLimits(max_nodes=300))


def test_max_values_and_graph_bytes_and_memory():
    data = af.many_values_declared(5_000)
    with pytest.raises(kiln.FormatError, match="ValueInfo tables"):
        _load(data, limits=LoadLimits(max_values=1_000))
    with pytest.raises(kiln.FormatError, match="max_graph_bytes"):
        _load(data, limits=LoadLimits(max_graph_bytes=10_000))
    with pytest.raises(kiln.FormatError, match="memory budget"):
        _load(data, limits=LoadLimits(max_memory_bytes=1 << 20))
    _load(data, limits=LoadLimits(max_memory_bytes=64 << 20))


def test_max_depth_is_one_rule_with_the_writer():
    from kiln.serializer.format import MAX_SUBGRAPH_NESTING
    assert LoadLimits().max_depth == MAX_SUBGRAPH_NESTING
    data = af.deep_nesting(6)
    _load(data)
    with pytest.raises(kiln.FormatError, match="nest|deeper"):
        _load(data, limits=LoadLimits(max_depth=4))
    deeper = af.deep_nesting(MAX_SUBGRAPH_NESTING + 5)
    with pytest.raises(kiln.FormatError, match="nest|deeper"):
        _load(deeper)
    assert _load(deeper, limits=LoadLimits(max_depth=MAX_SUBGRAPH_NESTING + 5)) is not None
    with pytest.raises(ValueError):
        LoadLimits(max_depth=10_000)


def test_time_budget():
    data = af.chain(5_000)
    with pytest.raises(kiln.FormatError, match="time budget"):
        _load(data, limits=LoadLimits(max_seconds=0.0))
    _load(data, limits=LoadLimits(max_seconds=60.0))


def test_unlimited_still_checks_structure():
    with pytest.raises(kiln.FormatError):
        _load(af.cycle(), limits=LoadLimits.unlimited())


@pytest.mark.slow
@pytest.mark.parametrize("build", [af.chain, af.readers])
def test_files_over_the_node_limit_are_refused_under_default_limits_in_under_a_second(build):
    """One node over the default max_nodes (250k): refused from the Node vector's length, before any node
    is read, so the time does not grow with the file (a million nodes took as long; building that file
    with the Python FlatBuffers builder took 40 s of the suite)."""
    data = build(LoadLimits().max_nodes + 1)
    start = time.perf_counter()
    with pytest.raises(kiln.FormatError, match="max_nodes|Node tables"):
        _load(data)
    assert time.perf_counter() - start < 1.0


# --------------------------------------------------------------------------- schema forms (item 3)


def _dummy_attr(kind: AttrKind, g: Graph):
    return {AttrKind.INT: 0, AttrKind.FLOAT: 0.0, AttrKind.STRING: "", AttrKind.INTS: (0,),
            AttrKind.FLOATS: (0.0,), AttrKind.STRINGS: ("a",), AttrKind.TENSOR: np.zeros(1, np.float32),
            AttrKind.GRAPH: g.subgraph()}[kind]


def _form_cases():
    cases = []
    for schema in all_schemas():
        for i, param in enumerate(schema.inputs):
            if param.ranks is not None:
                bad = next(r for r in (2, 3, 1, 0) if r not in param.ranks)
                cases.append((schema.name, schema.domain, i, (2,) * bad))
            if param.max_elements is not None:
                cases.append((schema.name, schema.domain, i, (param.max_elements + 1,)))
    return cases


FORM_CASES = _form_cases()


def test_the_schemas_declare_the_forms_kernels_read():
    declared = {(op, i) for op, _, i, _ in FORM_CASES}
    for must in [("Reshape", 1), ("Expand", 1), ("Tile", 1), ("ConstantOfShape", 0), ("Slice", 1), ("Split", 1),
                 ("Pad", 1), ("Unsqueeze", 1), ("Squeeze", 1), ("ReduceSum", 1), ("Range", 0), ("TopK", 1),
                 ("If", 0), ("Loop", 0), ("Clip", 1), ("Resize", 3), ("CumSum", 1)]:
        assert must in declared, must


@pytest.mark.parametrize("op,domain,i,shape", FORM_CASES, ids=[f"{c[0]}-{c[2]}-{len(c[3])}d" for c in FORM_CASES])
def test_verifier_rejects_forbidden_input_forms_naming_node_and_input(op, domain, i, shape):
    from kiln.ir.registry import get_schema
    schema = get_schema(op, domain)
    g = Graph("g")
    inputs = []
    for k in range(max(i + 1, schema.min_inputs)):
        param = schema.input_param(k)
        dtype = sorted(param.types, key=str)[0]
        arr_shape = shape if k == i else (1,)
        inputs.append(g.add_initializer(f"in{k}", np.zeros(arr_shape, dtype.numpy)))
    attrs = {name: _dummy_attr(a.kind, g) for name, a in schema.attrs.items() if a.required}
    node = g.add_node(op, inputs, attrs, domain=domain, name="victim")
    g.outputs = list(node.outputs)
    with pytest.raises(kiln.VerifyError, match=rf"node 'victim' .*input {i} \('{schema.input_param(i).name}'\)"):
        verify(g, require_types=False, check_inference=False)


def test_reshape_with_a_2d_shape_is_a_format_error_at_kiln_load(tmp_path):
    path = tmp_path / "r.kiln"
    path.write_bytes(af.reshape_2d_shape())
    with pytest.raises(kiln.FormatError, match=r"node 'reshape' \(Reshape\): input 1 \('shape'\) .* rank 2"):
        kiln.load(path)


def test_kiln_run_prints_no_traceback_for_it(tmp_path, capsys):
    from kiln import cli
    path = tmp_path / "r.kiln"
    path.write_bytes(af.reshape_2d_shape())
    code = cli.main(["run", str(path)]) if hasattr(cli, "main") else 1
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err


# --------------------------------------------------------------------------- run-time memory (item 4)


def test_gather_blowup_is_refused_at_load(tmp_path):
    """The issue's small file whose Gather makes a 16 GiB output: a static plan, refused at load."""
    path = tmp_path / "g.kiln"
    path.write_bytes(af.gather_blowup())
    assert path.stat().st_size < 1 << 20
    with pytest.raises(kiln.ResourceError, match=r"16.00 GiB .* 1.00 GiB"):
        kiln.load(path, memory_budget="1GiB")
    assert kiln.load(path).estimate_memory() == 16 << 30


def test_gather_blowup_per_request_is_refused_before_allocating(tmp_path):
    path = tmp_path / "g.kiln"
    path.write_bytes(af.gather_blowup_per_request())
    program = kiln.load(path, memory_budget="1GiB")
    assert program.run({"x": np.ones((2, 64), np.float32)})["y"].shape == (2, 1 << 16)
    x = np.ones((1 << 16, 64), np.float32)
    assert program.estimate_memory({"x": x}) == 16 << 30
    tracemalloc.start()
    try:
        with pytest.raises(kiln.ResourceError, match=r"16.00 GiB .*batch=65536.* 1.00 GiB"):
            program.run({"x": x})
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_static_plan_over_budget_is_refused_at_load(tmp_path):
    path = tmp_path / "h.kiln"
    path.write_bytes(af.huge_shape())
    with pytest.raises(kiln.ResourceError, match="memory budget"):
        kiln.load(path, memory_budget=1 << 30)
    assert kiln.load(path).memory.static == 4 << 40  # without a budget it loads (and cannot run)


def test_a_model_within_budget_runs_and_symbols_bind_per_request():
    g = Graph("m")
    x = g.add_input("x", "float32", ("batch", 1024))
    g.outputs = [g.op("Relu", g.op("Add", x, x))]
    program = kiln.load(g, memory_budget="10MiB")
    small = np.ones((4, 1024), np.float32)
    assert program.run({"x": small})["relu"].shape == (4, 1024)
    # a [4, 1024] float32 buffer per instruction: Add and Relu, or one fused pass where the native extension is
    assert program.estimate_memory({"x": small}) == len(program.plan.instructions) * 4 * 4096
    with pytest.raises(kiln.ResourceError, match="batch=4096"):  # 16 MiB a buffer, fused or not
        program.run({"x": np.ones((4096, 1024), np.float32)})
    assert program.run({"x": small})["relu"].shape == (4, 1024)


def test_memory_budget_from_the_environment(monkeypatch):
    from kiln.runtime.program import default_memory_budget, parse_bytes
    monkeypatch.setenv("KILN_MEMORY_BUDGET", "2GiB")
    assert default_memory_budget() == 2 << 30
    assert parse_bytes("512MB") == 512_000_000 and parse_bytes(4096) == 4096
    for bad in ("lots", "-1GiB", 0, "1e40GiB"):
        with pytest.raises(kiln.KilnError):
            parse_bytes(bad)


def test_limits_pass_through_kiln_load(tmp_path):
    path = tmp_path / "c.kiln"
    path.write_bytes(af.chain(3_000))
    with pytest.raises(kiln.FormatError, match="Node tables"):
        kiln.load(path, limits=kiln.LoadLimits(max_nodes=100))
    assert kiln.load(path, limits=kiln.LoadLimits(max_nodes=3_000)) is not None
