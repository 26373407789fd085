"""Fuzzing the .kiln loader: >= 10,000 mutated files (truncated, bit-flipped, spliced, fields
rewritten with the checksums fixed) must each load as a sound graph or raise FormatError, fast
and without a large allocation. The long run is ``python -m kiln.tools.fuzz`` (docs/NOTES.md)."""
from __future__ import annotations

import struct
import time
import zlib

import flatbuffers
import numpy as np
import pytest
from hypothesis import given, strategies as st

import kiln
from kiln.ir.dtypes import DType
from kiln.serializer import format as fmt
from kiln.tools import fuzz
from kiln.serializer.fb import Attribute, Graph as FbGraph, Model, Node as FbNode
from kiln.tools.fuzz_seeds import SEED_GRAPHS, build_corpus

CI_SEED = 3
CASES_PER_MUTATOR = 1200  # x 9 mutators = 10,800 files
MEMORY_EVERY = 40         # tracemalloc on every 40th case (it slows a load several times)


@pytest.fixture(scope="module")
def corpus() -> list:
    return build_corpus()


@pytest.fixture(scope="module")
def ci_run(corpus) -> tuple:
    """The CI fuzz run, shared by the tests below: (Stats, wall seconds)."""
    stats = fuzz.Stats()
    start = time.perf_counter()
    for name in fuzz.MUTATORS:
        for index in range(CASES_PER_MUTATOR):
            case = fuzz.make_case(corpus, CI_SEED, index, mutator=name)
            stats.add(case, fuzz.check(case.data, measure_memory=index % MEMORY_EVERY == 0))
    return stats, time.perf_counter() - start


# --------------------------------------------------------------------------- the corpus and tools


def test_seeds_load_and_cover_the_schema(corpus):
    assert [s.name for s in corpus] == list(SEED_GRAPHS)
    graphs = {s.name: kiln.load_graph_from_bytes(s.data) for s in corpus}
    for g in graphs.values():
        kiln.verify(g)
    ops = {n.op for g in graphs.values() for n in g.walk()}
    assert {"If", "Loop", "Constant", "Conv"} <= ops
    dtypes = {v.dtype for g in graphs.values() for sg in g.all_graphs() for v in sg.initializers.values()}
    assert {DType.BFLOAT16, DType.FLOAT16, DType.BOOL, DType.INT64, DType.INT8} <= dtypes
    assert graphs["tensor_attrs"].metadata.props["license"] == "apache-2.0"
    assert any(n.meta for g in graphs.values() for n in g.walk())
    assert graphs["control_flow"].inputs[0].shape == ("batch", "width")


def test_fix_checksums_matches_the_writer(corpus):
    """fix_checksums recomputes exactly what kiln.save wrote (its header layout is format.py's)."""
    assert fuzz._HEADER.format == fmt._STRUCT.format
    for seed in corpus:
        assert fuzz.checksums_valid(seed.data)
        assert fuzz.fix_checksums(bytearray(seed.data)) == seed.data
    doc = corpus[0]
    buf = bytearray(doc.data)
    at = doc.data.index(b"quickstart-style CNN")
    buf[at:at + 10] = b"QUICKSTART"
    assert not fuzz.checksums_valid(buf)
    with pytest.raises(kiln.FormatError, match="checksum mismatch"):
        kiln.load_graph_from_bytes(bytes(buf))
    assert kiln.load_graph_from_bytes(bytes(fuzz.fix_checksums(buf))).metadata.doc_string.startswith("QUICKSTART")


def test_site_map_finds_every_node_op(corpus):
    """The structure map sees what the loader reads: every op name of every (sub)graph."""
    for seed in corpus:
        graph = kiln.load_graph_from_bytes(seed.data)
        ops = sorted(seed.data[fmt.HEADER_SIZE + p:][:n].decode() for p, n, f in seed.strings if f == "Node.op")
        assert ops == sorted(n.op for n in graph.walk())
        assert all(0 <= p < seed.fb_end - fmt.HEADER_SIZE for p, _size, _kind in seed.sites)


def test_cases_are_reproducible(corpus):
    a = [fuzz.make_case(corpus, 5, i) for i in range(50)]
    b = [fuzz.make_case(corpus, 5, i) for i in range(50)]
    assert [c.data for c in a] == [c.data for c in b]
    assert len({c.data for c in a}) > 45
    assert {c.mutator for c in a} == set(fuzz.MUTATORS)


# --------------------------------------------------------------------------- the oracle can fail


def _raise_index_error(data):
    raise IndexError("list index out of range")


def _broken_graph(data):
    g = kiln.Graph("broken")
    g.outputs = [g.op("Relu", g.add_input("x", "float32", [2]))]
    g.nodes.clear()  # the output's producer is gone: verify must fail
    return g


def _slow(data):
    time.sleep(0.05)
    raise kiln.FormatError("slow but proper")


def _greedy(data):
    blob = bytearray(4 << 20)
    raise kiln.FormatError(f"allocated {len(blob)} bytes first")


def _silent(data):
    raise kiln.FormatError("")


@pytest.mark.parametrize("loader, limits, why", [
    (_raise_index_error, {}, "IndexError"),
    (_silent, {}, "without a message"),
    (_broken_graph, {}, "the loaded graph is broken"),
    (_slow, {"TIME_LIMIT_S": 0.01}, "load took"),
    (_slow, {"HANG_ALARM_S": 0.01}, "still running"),
    (_greedy, {"MEMORY_LIMIT_BYTES": 1 << 20}, "allocated 4 MiB"),
])
def test_oracle_flags_bad_loads(monkeypatch, loader, limits, why):
    monkeypatch.setattr(kiln, "load_graph_from_bytes", loader)
    for name, value in limits.items():
        monkeypatch.setattr(fuzz, name, value)
    result = fuzz.check(b"", measure_memory=True)
    assert result.outcome == "failed"
    assert why in result.error


# --------------------------------------------------------------------------- the CI fuzz run


def test_no_mutated_file_breaks_the_loader(ci_run):
    stats, _ = ci_run
    details = [f"case {c.index} ({c.mutator} on {c.seed}: {c.what}):\n{r.error}" for c, r in stats.failures[:3]]
    assert not stats.failures, f"{len(stats.failures)} failures; first ones:\n" + "\n".join(details)


def test_ci_run_is_big_deep_and_fast(ci_run):
    stats, wall = ci_run
    assert stats.cases >= 10_000
    # Most mutators fix the CRCs: at least half the files get past them to the real checks,
    # and every later check (FlatBuffer reader, decoder, IR verify) rejects some while some still load.
    assert stats.valid_crc >= stats.cases // 2
    for where in ("header", "checksum", "structure", "decoder", "graph"):
        assert stats.stages.get(where, 0) >= 50, stats.table()
    assert stats.stages["loaded"] >= 500, stats.table()
    assert stats.slowest[0] < 1.0, f"slowest load: {stats.slowest}"
    assert stats.total_s / stats.cases < 0.01
    assert wall < 60


def test_loads_allocate_little(ci_run):
    stats, _ = ci_run
    assert 0 < stats.peak_bytes < 50 << 20


def test_load_graph_from_files(corpus, tmp_path):
    """The same contract through load_graph (mmap of a real file)."""
    path = tmp_path / "case.kiln"
    outcomes = set()
    for index in range(200):
        path.write_bytes(fuzz.make_case(corpus, CI_SEED, index).data)
        try:
            kiln.verify(kiln.load_graph(path))
            outcomes.add("loaded")
        except kiln.FormatError as e:
            assert str(path) in str(e)  # the message names the file
            outcomes.add("rejected")
    assert outcomes == {"loaded", "rejected"}


@given(st.data())
def test_any_overwrite_with_fixed_checksums(corpus, data):
    """Hypothesis picks a seed, a FlatBuffer offset and new bytes; CRCs are then fixed."""
    seed = data.draw(st.sampled_from(corpus))
    pos = data.draw(st.integers(fmt.HEADER_SIZE, seed.fb_end - 1))
    new = data.draw(st.binary(min_size=1, max_size=8))
    buf = bytearray(seed.data)
    buf[pos:pos + len(new)] = new
    try:
        kiln.verify(kiln.load_graph_from_bytes(bytes(fuzz.fix_checksums(buf))))
    except kiln.FormatError:
        pass


# --------------------------------------------------------------------------- hand-made hostile files
# Random mutation rarely builds these: FlatBuffer offsets only point forward, so loops are
# impossible, but shared subtrees and deep nesting are not.


def _vector(b: flatbuffers.Builder, start, offsets: list) -> int:
    start(b, len(offsets))
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def nested_if_file(levels: int, fan: int) -> bytes:
    """Graphs nested ``levels`` deep, each holding one If whose ``fan`` attributes all point at
    the SAME inner graph: a file of a few KB that describes fan ** levels paths."""
    b = flatbuffers.Builder(1024)
    inner = None
    for _ in range(levels):
        attrs = []
        for _ in range(fan):
            name = b.CreateString("then_branch")
            Attribute.Start(b)
            Attribute.AddName(b, name)
            Attribute.AddKind(b, 8)  # GRAPH
            if inner is not None:
                Attribute.AddGraph(b, inner)
            attrs.append(Attribute.End(b))
        attrs_vec = _vector(b, FbNode.StartAttributesVector, attrs)
        op = b.CreateString("If")
        FbNode.Start(b)
        FbNode.AddOp(b, op)
        FbNode.AddAttributes(b, attrs_vec)
        nodes = _vector(b, FbGraph.StartNodesVector, [FbNode.End(b)])
        FbGraph.Start(b)
        FbGraph.AddNodes(b, nodes)
        inner = FbGraph.End(b)
    return _model_file(b, inner)


def shared_payload_file(refs: int, elements: int, payload: str) -> bytes:
    """A graph whose node list names ONE node ``refs`` times; that node has ``elements`` inputs
    (all omitted, -1) or a name of ``4 * elements`` bytes: a file of about 4 * (refs + elements)
    bytes that decodes to refs * elements items unless shared payloads count against the cap."""
    b = flatbuffers.Builder(1024)
    inputs = name = None
    if payload == "inputs":
        inputs = b.CreateNumpyVector(np.full(elements, -1, np.int32))
    else:
        name = b.CreateString("n" * 4 * elements)
    op = b.CreateString("Identity")
    FbNode.Start(b)
    FbNode.AddOp(b, op)
    if inputs is not None:
        FbNode.AddInputs(b, inputs)
    if name is not None:
        FbNode.AddName(b, name)
    node = FbNode.End(b)
    nodes = _vector(b, FbGraph.StartNodesVector, [node] * refs)
    FbGraph.Start(b)
    FbGraph.AddNodes(b, nodes)
    return _model_file(b, FbGraph.End(b))


def _model_file(b: flatbuffers.Builder, graph: int) -> bytes:
    """Finish a Model around ``graph`` and frame it as a .kiln file with correct checksums."""
    Model.Start(b)
    Model.AddIrVersion(b, 1)
    Model.AddOpsetVersion(b, 1)
    Model.AddGraph(b, graph)
    b.Finish(Model.End(b), file_identifier=fmt.FILE_IDENTIFIER)
    fb = bytes(b.Output())
    data_offset = fmt.align(fmt.HEADER_SIZE + len(fb), fmt.SEGMENT_ALIGNMENT)
    header = fmt.Header(fmt.HEADER_SIZE, len(fb), data_offset, 0, zlib.crc32(fb), zlib.crc32(b""))
    return header.pack() + fb + bytes(data_offset - fmt.HEADER_SIZE - len(fb))


@pytest.mark.parametrize("levels, fan, why", [
    (20, 2, "more objects than the buffer can hold"),  # 2**20 paths (11 s to walk without the cap)
    (40, 1, "nesting deeper than"),  # serializer.format.MAX_TABLE_DEPTH (the nesting rule)
])
def test_shared_and_deep_subgraphs_are_cut_short(levels, fan, why):
    data = nested_if_file(levels, fan)
    assert len(data) <= 4096
    result = fuzz.check(data)
    assert result.outcome == "rejected" and why in result.error
    assert result.seconds < 0.1


@pytest.mark.parametrize("payload", ["inputs", "name"])
def test_shared_payloads_count_against_the_cap(payload):
    """Regression: fbread charged one unit per object however long its payload, so 500 nodes
    sharing one 2,000-element inputs vector (a 12 KB file) decoded 1M items: 7.5 s and 129 MiB.
    Strings and scalar vectors now cost one unit per 4 bytes on every path that reaches them."""
    data = shared_payload_file(500, 2000, payload)
    assert len(data) <= 16384
    result = fuzz.check(data, measure_memory=True)
    assert result.outcome == "rejected" and "more objects than the buffer can hold" in result.error
    assert result.seconds < 0.5 and result.peak_bytes < 5 << 20


def test_one_long_payload_still_loads_in_linear_time():
    """The cap does not reject a big payload reached once (100,000 inputs: invalid for Identity,
    but only the IR verifier may say so)."""
    start = time.perf_counter()
    with pytest.raises(kiln.FormatError, match="has 100000 inputs"):
        kiln.load_graph_from_bytes(shared_payload_file(1, 100_000, "inputs"))
    assert time.perf_counter() - start < 1.0


# --------------------------------------------------------------------------- the long-run CLI


def test_cli_runs_clean(capsys, tmp_path):
    assert fuzz.main(["--iterations", "300", "--seed", "1", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "done: 300 cases" in out and "0 failed" in out and "fb_field" in out
    assert not (tmp_path / "out").exists()


def test_cli_saves_failures_and_exits_nonzero(monkeypatch, capsys, tmp_path):
    real = kiln.load_graph_from_bytes

    def flaky(data):
        if len(data) % 7 == 0:
            raise struct.error("unpack requires a buffer of 8 bytes")
        return real(data)

    monkeypatch.setattr(kiln, "load_graph_from_bytes", flaky)
    out = tmp_path / "failures"
    assert fuzz.main(["--iterations", "100", "--seed", "2", "--out", str(out)]) == 1
    saved = sorted(out.glob("*.kiln"))
    assert saved and all(len(p.read_bytes()) % 7 == 0 for p in saved)
    note = saved[0].with_suffix(".txt").read_text()
    assert "struct.error" in note and "on seed" in note
    assert "FAIL case" in capsys.readouterr().out
