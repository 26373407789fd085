"""bench/charts.py: it reads the tables of bench/RESULTS.md right, finds every chart's data in the file as it is,
and every chart is linked from its section and committed. Drawing needs matplotlib (not a test dependency: the
charts are made by hand), so only the drawing test skips without it."""
import struct
from pathlib import Path

import pytest

from cli_helpers import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def charts():
    return load_script(BENCH / "charts.py", "bench_charts")


@pytest.fixture(scope="module")
def sections(charts):
    return charts.parse_results((BENCH / "RESULTS.md").read_text())


SAMPLE = """# results

## First (issue 1)

Some text | with a bar, not a table.

| model | kiln ms | note |
|---|---:|---|
| a | 1.5 | x |
| b | **1,234** | |

## Second (issue 2)

### A sub-heading

| k | v |
|:--|--:|
| n/a | 45% |
not a row
| x | y |
"""


def test_parse_sections_tables_and_headings(charts):
    first, second = charts.parse_results(SAMPLE)
    assert (first.title, first.line) == ("First (issue 1)", 3)
    assert len(first.tables) == 1
    t = first.tables[0]
    assert (t.heading, t.columns, t.line) == ("", ["model", "kiln ms", "note"], 7)
    assert t.rows == [["a", "1.5", "x"], ["b", "**1,234**", ""]]
    assert [charts.number(c) for c in t.column("kiln ms")] == [1.5, 1234.0]
    assert first.text.startswith("## First") and "## Second" not in first.text
    (t2,) = second.tables  # "| x | y |" after a non-table line, with no separator, is no table
    assert (t2.heading, t2.rows) == ("A sub-heading", [["n/a", "45%"]])


@pytest.mark.parametrize("cell, value", [
    ("6.286", 6.286), ("**1,786**", 1786.0), ("45%", 45.0), ("1.36x", 1.36), ("<= 2.5", 2.5), ("4.6e-07", 4.6e-07),
    ("-0.5", -0.5), ("n/a", None), ("-", None), ("", None),
])
def test_number(charts, cell, value):
    assert charts.number(cell) == value


def test_a_missing_section_or_column_is_named(charts, sections):
    with pytest.raises(charts.Missing, match=r"no section titled 'Nowhere'"):
        charts.find_table(sections, "Nowhere", "model")
    with pytest.raises(charts.Missing, match=r"no table with columns 'model', 'bogus' in section 'CPU runtime"):
        charts.find_table(sections, "CPU runtime (issue 5)", "model", "bogus")


def test_every_chart_finds_its_data_in_results_md(charts, sections):
    """A benchmark that renames its section or columns must update its chart: this fails first."""
    cpu = charts.runtime_data(sections, "CPU runtime (issue 5)")
    assert cpu["labels"][0] == "MLP 784-512-512-10\nbatch 1"
    assert [cpu["series"][k][0] for k in ("kiln", "onnxruntime", "torch eager")] == [0.040, 0.035, 0.064]
    assert len(cpu["labels"]) == len(cpu["series"]["kiln"]) >= 8

    loading = charts.loading_data(sections)["lines"]
    assert [size for size, _ in loading["kiln.load_graph(path)"]] == [16, 32, 64, 256, 1024]

    export = charts.export_data(sections)
    assert all(None not in v for v in export["series"].values()) and len(export["labels"]) == 2

    server = charts.serving_data(sections, "Server (issue 7)", "model", ("server",))
    assert server["MLP 784-512-512-10"]["kiln serve, batching on"] == [(1, 345), (8, 771), (64, 863)]

    gpu = charts.serving_data(sections, "GPU serving against Triton", "model", ("server", "transport"))
    # bert/kiln/http at 64 clients is in the table twice (the 2-GPU baseline re-measured it): the first is kept
    assert dict(gpu["bert"]["kiln, http"])[64] == 1362

    assert charts.gpu_runtime_data(sections)["device"].startswith("NVIDIA")

    coverage = charts.coverage_data(sections)
    assert coverage["title"] == "ONNX coverage (issue 22, second part)"
    totals = {sum(row) for row in zip(*coverage["series"].values())}
    assert totals == {1884}  # every row counts the same 1,884 backend test cases

    assert charts.runtime_data(sections, "Real-model findings (issue 24)")["series"]["kiln"][0] == 23.149


def test_every_chart_is_linked_and_committed(charts, sections):
    assert charts.unlinked(sections, charts.CHARTS) == []
    for chart in charts.CHARTS:
        png = BENCH / "charts" / f"{chart.name}.png"
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", png
        assert len(data) < 100_000, f"{png}: {len(data)} bytes; keep charts small"


def test_a_section_rewritten_by_its_benchmark_loses_its_link_and_is_reported(charts, sections):
    gone = [s for s in sections if not s.title.startswith("Server (issue 7)")]
    assert [c.name for c in charts.unlinked(gone, charts.CHARTS)] == ["server"]
    assert charts.link_line(charts.CHARTS[0]) == "Chart: ![load time against model size, per loader](charts/loading.png)"


def test_draw_writes_small_pngs_at_100_dpi(charts, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert charts.main(["--out", str(tmp_path), "--only", "cpu_runtime", "--only", "onnx_coverage"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu_runtime.png", "onnx_coverage.png"]
    width, height = struct.unpack(">II", (tmp_path / "cpu_runtime.png").read_bytes()[16:24])
    assert (width, height) == (1000, 450)  # 10 x 4.5 inches at 100 dpi
    assert "wrote" in capsys.readouterr().out


def test_draw_reports_a_missing_section_and_draws_the_rest(charts, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "RESULTS.md"
    results.write_text((BENCH / "RESULTS.md").read_text().replace("## CPU runtime (issue 5)", "## CPU (renamed)"))
    assert charts.main(["--results", str(results), "--only", "cpu_runtime", "--only", "export"]) == 1
    err = capsys.readouterr().err
    assert "skipped cpu_runtime: no section titled 'CPU runtime (issue 5)'" in err
    assert (tmp_path / "charts" / "export.png").exists()
    assert not (tmp_path / "charts" / "cpu_runtime.png").exists()
