"""Draw bench/RESULTS.md's main tables as charts: PNGs in bench/charts/, linked from their sections.

The benchmarks write markdown tables, not data files, so this reads the tables back: a section is found by
the start of its ``## `` title, a table in it by the columns it must have, so reordered columns or extra
ones do not matter. Each chart is one function from the parsed file to a figure; a chart whose section or
columns are gone is reported and skipped, the others are still drawn.

    python3 -m venv /tmp/mpl && /tmp/mpl/bin/pip install matplotlib
    /tmp/mpl/bin/python bench/charts.py                # every chart -> bench/charts/*.png
    /tmp/mpl/bin/python bench/charts.py --only cpu_runtime --out /tmp/charts

Needs matplotlib, in any venv (it is no kiln dependency, and kiln is not imported). Run it by hand after a
benchmark rewrites its section, and commit the PNGs (100 dpi, 10-30 KB each; the same numbers give the same
bytes). A benchmark's rerun replaces its whole section, "Chart:" line included: this script says which
section lost its link and prints the line to put back.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
DPI = 100
# One family of colours per runtime, the same in every chart (kiln blue, onnxruntime orange, torch green,
# Triton red, ONNX files purple); the n-th series of a family in a chart takes its n-th shade. Searched in
# this order, so "onnxruntime" is not taken for "onnx", nor "torch.compile" for "torch".
FAMILIES = [
    (r"onnxruntime|\bORT\b", ("#ff7f0e", "#ffbb78", "#a65000")),
    (r"torch[-.]compile", ("#98df8a", "#5aa65a", "#c7e9c0")),
    (r"(?i:triton)", ("#d62728", "#ff9896")),
    (r"torch\.onnx|\bonnx\b", ("#9467bd", "#c5b0d5")),
    (r"torch", ("#2ca02c", "#006d2c", "#74c476")),
    (r"kiln", ("#1f77b4", "#9ecae1", "#08306b", "#4292c6")),
    (r"npz", ("#8c564b", "#c49c94")),
    (r"npy", ("#7f7f7f", "#c7c7c7")),
]


# ---------------------------------------------------------------------------- reading RESULTS.md
@dataclass
class Table:
    heading: str            # the ``### `` heading above the table, or "" under the section's own
    columns: list[str]
    rows: list[list[str]]
    line: int               # 1-based line of the header row in the file

    def has(self, *columns: str) -> bool:
        return all(c in self.columns for c in columns)

    def column(self, name: str) -> list[str]:
        i = self.columns.index(name)
        return [row[i] if i < len(row) else "" for row in self.rows]

    def records(self) -> list[dict[str, str]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


@dataclass
class Section:
    title: str              # the ``## `` title without the hashes
    line: int
    text: str               # the section's lines, title included
    tables: list[Table] = field(default_factory=list)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_results(text: str) -> list[Section]:
    """The ``## `` sections of a RESULTS.md and the markdown tables in each (header, separator, rows)."""
    sections: list[Section] = []
    lines = text.splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            sections.append(Section(line[3:].strip(), i + 1, ""))
            heading = ""
        elif line.startswith("### "):
            heading = line[4:].strip()
        elif (sections and line.startswith("|") and i + 1 < len(lines)
              and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*\|?\s*", lines[i + 1])):
            table = Table(heading, _cells(line), [], i + 1)
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                table.rows.append(_cells(lines[i]))
                i += 1
            sections[-1].tables.append(table)
            continue
        i += 1
    starts = [s.line for s in sections] + [len(lines) + 1]
    for s, end in zip(sections, starts[1:]):
        s.text = "\n".join(lines[s.line - 1:end - 1])
    return sections


def number(cell: str) -> Optional[float]:
    """The number a cell shows: ``**1,786**``, ``45%``, ``1.36x``, ``<= 2.5`` and ``6.286`` read as numbers;
    ``n/a``, ``-`` and empty cells as None."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", cell.replace("*", ""))
    return float(m.group(0).replace(",", "")) if m else None


class Missing(Exception):
    """A chart's section or table is not in the file (renamed, or its benchmark not run yet)."""


def find_table(sections: list[Section], title_start: str, *columns: str, heading: str = "") -> tuple[Section, Table]:
    """The first table having ``columns`` in the first section whose title starts with ``title_start``
    (and, with ``heading``, under a ``###`` heading starting with it)."""
    for s in sections:
        if s.title.startswith(title_start):
            for t in s.tables:
                if t.has(*columns) and t.heading.startswith(heading):
                    return s, t
            raise Missing(f"no table with columns {', '.join(map(repr, columns))} in section {s.title!r}")
    raise Missing(f"no section titled {title_start!r}...")


# ---------------------------------------------------------------------------- the charts' data
# Each ``*_data`` function returns plain lists and dicts (tested without matplotlib); ``draw_*`` plots them.
def runtime_data(sections, title: str) -> dict:
    """CPU runtime tables (issue 5, issue 24): ms per run of kiln, onnxruntime and torch eager, per model and
    batch."""
    _, t = find_table(sections, title, "model", "batch", "kiln ms", "ORT ms", "torch ms")
    rows = t.records()
    return {"labels": [f"{r['model']}\nbatch {r['batch']}" for r in rows],
            "series": {name: [number(r[col]) for r in rows]
                       for name, col in (("kiln", "kiln ms"), ("onnxruntime", "ORT ms"), ("torch eager", "torch ms"))}}


def loading_data(sections) -> dict:
    """Issue 3: median load ms against the weights' size, one line per loader."""
    _, t = find_table(sections, "Model file loading (issue 3)", "model weights", "loader", "load ms (median)")
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in t.records():
        lines.setdefault(r["loader"].strip("`"), []).append((number(r["model weights"]),
                                                              number(r["load ms (median)"])))
    return {"lines": lines}


def export_data(sections) -> dict:
    """Issue 4: median export seconds per model and exporter (exporters that did not run left out)."""
    _, t = find_table(sections, "Export time (issue 4)", "model", "exporter", "median s")
    models: list[str] = []
    series: dict[str, dict[str, float]] = {}
    for r in t.records():
        value = number(r["median s"])
        if value is None:
            continue
        models += [r["model"]] if r["model"] not in models else []
        series.setdefault(r["exporter"].strip("`"), {})[r["model"]] = value
    return {"labels": models, "series": {k: [v.get(m) for m in models] for k, v in series.items()}}


def serving_data(sections, title: str, model_col: str, server_cols: tuple[str, ...]) -> dict:
    """Requests/s against concurrent clients: {model: {server: [(clients, req/s), ...]}}. The first row of a
    (model, server, clients) is kept (later tables in a section re-measure for other comparisons)."""
    _, t = find_table(sections, title, model_col, *server_cols, "clients", "req/s")
    out: dict[str, dict[str, dict[float, float]]] = {}
    for r in t.records():
        server = ", ".join(r[c] for c in server_cols)
        points = out.setdefault(r[model_col], {}).setdefault(server, {})
        points.setdefault(number(r["clients"]), number(r["req/s"]))
    return {model: {server: sorted(points.items()) for server, points in servers.items()}
            for model, servers in out.items()}


def gpu_runtime_data(sections) -> dict:
    """Issue 8: ResNet-50 and BERT-base on the GPU, ms per run: kiln (eager, CUDA graphs), torch eager,
    torch.compile (default, reduce-overhead)."""
    cols = ("kiln eager", "kiln CUDA graphs", "torch eager", "torch.compile", "torch.compile reduce-overhead")
    s, t = find_table(sections, "GPU runtime (issue 8)", "model", "batch", *cols, heading="ResNet-50 and BERT")
    rows = t.records()
    device = re.search(r"\*\*(NVIDIA [^*]+)\*\*", s.text)
    short = [re.sub(r"\s*\(.*?\)", "", r["model"]).split(",")[0] for r in rows]
    return {"labels": [f"{name}\nbatch {r['batch']}" for name, r in zip(short, rows)],
            "series": {c: [number(r[c]) for r in rows] for c in cols},
            "device": device.group(1) if device else "the GPU"}


def coverage_data(sections) -> dict:
    """Issue 22: ONNX backend test cases passed / failed / unsupported, per row of the last coverage table."""
    found = [s for s in sections if s.title.startswith("ONNX coverage")]
    if not found:
        raise Missing("no section titled 'ONNX coverage'...")
    _, t = find_table(found[-1:], found[-1].title, "passed", "failed (answered wrong)",
                      "unsupported (refused by name)")
    rows = t.records()
    return {"title": found[-1].title, "labels": [r[t.columns[0]].replace("*", "") for r in rows],
            "series": {"passed": [number(r["passed"]) or 0 for r in rows],
                       "failed (answered wrong)": [number(r["failed (answered wrong)"]) or 0 for r in rows],
                       "unsupported (refused by name)": [number(r["unsupported (refused by name)"]) or 0
                                                         for r in rows]}}


# ---------------------------------------------------------------------------- drawing
def colors(names) -> dict[str, Optional[str]]:
    """A colour per series name: its runtime's family, the next shade for each further series of it."""
    used: dict[int, int] = {}
    out: dict[str, Optional[str]] = {}
    for name in names:
        family = next((i for i, (pattern, _) in enumerate(FAMILIES) if re.search(pattern, name)), None)
        if family is None:
            out[name] = None
            continue
        shades = FAMILIES[family][1]
        out[name] = shades[used.get(family, 0) % len(shades)]
        used[family] = used.get(family, 0) + 1
    return out


def _wrap(label: str, width: int = 18) -> str:
    import textwrap

    return "\n".join(textwrap.fill(part, width) for part in label.replace("`", "").split("\n"))


def _bars(ax, labels: list[str], series: dict[str, list], *, log: bool, unit: str) -> None:
    import numpy as np

    width = 0.8 / len(series)
    x = np.arange(len(labels))
    palette = colors(series)
    for k, (name, values) in enumerate(series.items()):
        heights = [np.nan if v is None else v for v in values]
        ax.bar(x + (k - (len(series) - 1) / 2) * width, heights, width, label=name, color=palette[name])
    ax.set_xticks(x, [_wrap(label) for label in labels], fontsize=7)
    ax.set_ylabel(unit)
    if log:
        ax.set_yscale("log")
    ax.grid(axis="y", alpha=0.3, which="both" if log else "major")
    ax.legend(fontsize=8)


def _figure(width: float, height: float, *, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), squeeze=False)
    return fig, list(axes[0])


def draw_runtime(data: dict, title: str):
    fig, (ax,) = _figure(10, 4.5)
    _bars(ax, data["labels"], data["series"], log=True, unit="ms per run (log scale, lower is faster)")
    ax.set_title(title, fontsize=10)
    return fig


def draw_loading(data: dict):
    fig, (ax,) = _figure(9, 4.5)
    palette = colors(data["lines"])
    sizes = sorted({size for points in data["lines"].values() for size, _ in points})
    for name, points in data["lines"].items():
        x, ms = zip(*points)
        ax.plot(x, ms, marker="o", label=name, color=palette[name])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("model weights, MiB (log scale)")
    ax.set_ylabel("load ms, median (log scale)")
    ax.set_title("Model file loading (issue 3): kiln.load_graph maps the file; its time does not grow with the "
                 "weights", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return fig


def draw_export(data: dict):
    fig, (ax,) = _figure(9, 4.5)
    _bars(ax, data["labels"], data["series"], log=False, unit="seconds, median (lower is faster)")
    ax.set_title("Export time (issue 4): model to file, median of 3 runs", fontsize=10)
    return fig


def draw_serving(data: dict, title: str):
    fig, axes = _figure(5 * len(data), 4.5, ncols=len(data))
    for ax, (model, servers) in zip(axes, data.items()):
        # Transports / settings of one server share its colour and differ by line style.
        palette = colors(dict.fromkeys(s.split(",")[0] for s in servers))
        clients = sorted({c for points in servers.values() for c, _ in points})
        for server, points in servers.items():
            x, rps = zip(*points)
            ax.plot(x, rps, marker="o", label=server, color=palette[server.split(",")[0]],
                    linestyle="--" if "shm" in server or "off" in server else "-")
        ax.set_xscale("log")
        ax.set_xticks(clients, [f"{c:g}" for c in clients])
        ax.set_xticks([], minor=True)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent clients (log scale)")
        ax.set_ylabel("requests/s (higher is better)")
        ax.set_title(model, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return fig


def draw_gpu_runtime(data: dict):
    fig, (ax,) = _figure(9, 4.5)
    _bars(ax, data["labels"], data["series"], log=True, unit="ms per run (log scale, lower is faster)")
    ax.set_title(f"GPU runtime (issue 8): {data['device']}, fp32, TF32 off", fontsize=10)
    return fig


def draw_coverage(data: dict):
    import numpy as np

    fig, (ax,) = _figure(9, 0.6 * len(data["labels"]) + 2)
    y = np.arange(len(data["labels"]))[::-1]
    left = np.zeros(len(y))
    total = max(sum(row) for row in zip(*data["series"].values()))
    for name, color in zip(data["series"], ("#2ca02c", "#d62728", "#c7c7c7")):
        values = np.array(data["series"][name], dtype=float)
        ax.barh(y, values, left=left, label=name, color=color)
        for yi, lo, v in zip(y, left, values):
            if v >= 0.04 * total:  # a number inside its bar where it fits
                ax.text(lo + v / 2, yi, f"{v:,.0f}", ha="center", va="center", fontsize=8)
        left += values
    ax.set_yticks(y, data["labels"], fontsize=8)
    ax.set_xlabel("ONNX backend test cases")
    ax.set_title(data["title"], fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncols=3, frameon=False)
    return fig


# ---------------------------------------------------------------------------- the charts
@dataclass(frozen=True)
class Chart:
    name: str               # bench/charts/<name>.png
    section: str            # the start of the title of the section that links it
    alt: str                # the link's text
    make: Callable          # sections -> figure


CHARTS = [
    Chart("loading", "Model file loading (issue 3)", "load time against model size, per loader",
          lambda s: draw_loading(loading_data(s))),
    Chart("export", "Export time (issue 4)", "export seconds per model and exporter",
          lambda s: draw_export(export_data(s))),
    Chart("cpu_runtime", "CPU runtime (issue 5)", "kiln, onnxruntime and torch eager, ms per run",
          lambda s: draw_runtime(runtime_data(s, "CPU runtime (issue 5)"),
                                 "CPU runtime (issue 5): kiln vs onnxruntime vs torch eager, 2 threads each")),
    Chart("server", "Server (issue 7)", "requests/s against clients, per server",
          lambda s: draw_serving(serving_data(s, "Server (issue 7)", "model", ("server",)),
                                 "Server (issue 7): requests/s on 2 cores, load generator included")),
    Chart("gpu_runtime", "GPU runtime (issue 8)", "ResNet-50 and BERT-base on the GPU, ms per run",
          lambda s: draw_gpu_runtime(gpu_runtime_data(s))),
    Chart("gpu_serving", "GPU serving against Triton (issue 17)", "requests/s against clients: kiln, Triton, torch",
          lambda s: draw_serving(serving_data(s, "GPU serving against Triton", "model", ("server", "transport")),
                                 "GPU serving (issue 17): requests/s on one H100 ('kiln (2 GPUs)': on two)")),
    Chart("onnx_coverage", "ONNX coverage (issue 22, second part)", "ONNX backend test cases per runtime",
          lambda s: draw_coverage(coverage_data(s))),
    Chart("real_models", "Real-model findings (issue 24)", "kiln, onnxruntime and torch eager, ms per run",
          lambda s: draw_runtime(runtime_data(s, "Real-model findings (issue 24)"),
                                 "Real-model findings (issue 24): ms per run, 2 threads each")),
]


def save_png(fig, path: Path) -> None:
    """The figure at DPI, reduced to a 128-colour palette (a third of the bytes of matplotlib's RGBA PNG, no
    visible change on flat-coloured charts) and without matplotlib's version stamp, so the same numbers give
    the same file."""
    import io

    from PIL import Image  # a dependency of matplotlib

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=DPI)
    image = Image.open(buf).convert("RGB")
    image.quantize(colors=128, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)


def link_line(chart: Chart) -> str:
    """The line each chart's section holds (after its table)."""
    return f"Chart: ![{chart.alt}](charts/{chart.name}.png)"


def unlinked(sections: list[Section], charts: list[Chart]) -> list[Chart]:
    """The charts whose section does not link their PNG (a benchmark rerun rewrote the section)."""
    return [c for c in charts
            if not any(s.title.startswith(c.section) and f"(charts/{c.name}.png)" in s.text for s in sections)]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the RESULTS.md to read (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: charts/ next to --results)")
    parser.add_argument("--only", action="append", choices=[c.name for c in CHARTS], metavar="NAME",
                        help="draw only this chart (repeatable): " + ", ".join(c.name for c in CHARTS))
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("charts.py needs matplotlib: pip install matplotlib (in any venv; kiln is not needed)",
              file=sys.stderr)
        return 2
    import matplotlib.pyplot as plt

    sections = parse_results(args.results.read_text())
    out = args.out or args.results.parent / "charts"
    out.mkdir(parents=True, exist_ok=True)
    charts = [c for c in CHARTS if not args.only or c.name in args.only]
    failed = 0
    for chart in charts:
        try:
            fig = chart.make(sections)
        except Missing as e:
            print(f"skipped {chart.name}: {e}", file=sys.stderr)
            failed += 1
            continue
        path = out / f"{chart.name}.png"
        save_png(fig, path)
        plt.close(fig)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    for chart in unlinked(sections, charts):
        print(f"note: section {chart.section!r} does not link {chart.name}.png; add after its table:\n"
              f"  {link_line(chart)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
