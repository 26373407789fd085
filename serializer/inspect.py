"""What is in a .kiln file, for ``kiln inspect``: a plain-dict summary and its text form.

The header is read on its own (64 bytes, through ``format.parse_header``) so that its fields
can be reported as stored; everything else comes from ``load_graph``, so inspecting a file
checks it exactly as loading does and no decoding logic lives here. The graph is loaded
without opset upgrades: the summary describes the file, not what it would become in memory.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Union

import numpy as np

from kiln.errors import FormatError, KilnError
from kiln.ir.dtypes import dtype as as_dtype
from kiln.ir.graph import Graph, Value
from kiln.ir.types import format_shape
from kiln.serializer.format import HEADER_SIZE, Header, parse_header
from kiln.serializer import reader

PathLike = Union[str, os.PathLike]


def read_summary(path: PathLike, *, verify: bool = False) -> dict:
    """The summary of the .kiln file at ``path`` (see ``inspect_file``)."""
    return inspect_file(path, verify=verify)[0]


def inspect_file(path: PathLike, *, verify: bool = False) -> tuple[dict, Graph]:
    """Read ``path`` and return (summary, graph). ``verify``: checksum the whole data segment
    even when it is larger than the size ``load_graph`` checks by default."""
    path = Path(path)
    header, file_size = read_header(path)
    graph = reader.load_graph(path, check_data=True if verify else None, upgrade=False)
    # The same rule load_graph applies when check_data is None.
    verified = verify or header.data_size <= reader.AUTO_CHECK_DATA_BYTES
    return summarize(graph, header, path, file_size, verified), graph


def read_header(path: Path) -> tuple[Header, int]:
    """The parsed header and the file size, reading only the first 64 bytes."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        # A missing file or a folder is a user mistake, not a bug: say so without a traceback.
        raise KilnError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return parse_header(raw, size), size
    except FormatError as e:
        raise FormatError(f"{path}: {e}") from None


def summarize(graph: Graph, header: Header, path: PathLike, file_size: int, verified: bool) -> dict:
    """The summary of a loaded file as plain JSON-ready values."""
    ops = _sorted_histogram(graph.op_counts())
    params, param_bytes, by_dtype = _parameter_totals(graph)
    meta = graph.metadata
    return {
        "path": str(path),
        "file_size": file_size,
        "header": _header_fields(header),
        "data_checksum_verified": verified,
        "ir_version": graph.ir_version,
        "opset_version": graph.opset_version,
        "producer": {"name": meta.producer_name, "version": meta.producer_version},
        "doc_string": meta.doc_string,
        "metadata": dict(sorted(meta.props.items())),
        "graph_name": graph.name,
        "inputs": [_value_entry(v) for v in graph.inputs],
        "outputs": [_value_entry(v) for v in graph.outputs],
        "nodes": sum(ops.values()),
        "subgraphs": sum(1 for _ in graph.all_graphs()) - 1,
        "ops": ops,
        "parameters": params,
        "parameter_bytes": param_bytes,
        "parameter_bytes_by_dtype": by_dtype,
        "guards": [guard_entry(n) for n in graph.walk() if n.domain == "kiln" and n.op == "Guard"],
        "batching": batching_entry(graph),
    }


def batching_entry(graph: Graph) -> dict:
    """Whether a server may stack requests for this model (kiln/ir/batch_independence.py), and why."""
    from kiln.ir.batch_independence import analyze_batching

    return analyze_batching(graph).to_json()


def guard_entry(node) -> dict:
    """A kiln.Guard as JSON-ready values: where the traced model read tensor data, how, and
    the value the graph requires there (kiln/ir/ops/guard.py)."""
    from kiln.checks import describe

    a = node.schema.fill_attrs(node.attrs)
    return {"location": a["location"], "code": a["code"], "what": a["what"], "read": a["read"],
            "expected": describe(np.asarray(a["expected"])), "input": node.inputs[0].name}


def _header_fields(h: Header) -> dict:
    return {"header_version": h.header_version, "flatbuffer_offset": h.flatbuffer_offset,
            "flatbuffer_size": h.flatbuffer_size, "data_offset": h.data_offset, "data_size": h.data_size,
            "flatbuffer_crc32": h.flatbuffer_crc32, "data_crc32": h.data_crc32, "flags": h.flags}


def _value_entry(v: Value) -> dict:
    # JSON has no "symbol" type: a symbolic dim is its name, an unknown dim null, and an
    # unknown rank a null shape.
    shape = None if v.shape is None else list(v.shape)
    dtype = None if v.dtype is None else v.dtype.short
    return {"name": v.name, "dtype": dtype, "shape": shape}


def _sorted_histogram(counts: dict[str, int]) -> dict[str, int]:
    """Most frequent op first, ties by name, so the output is stable."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _parameter_totals(graph: Graph) -> tuple[int, int, dict[str, int]]:
    """Elements and bytes of every constant (initializers and tensor attributes, subgraphs
    included). A tensor stored once but referenced twice (tied weights: the writer dedups
    them) is counted once, as ``sum(p.numel() for p in module.parameters())`` does."""
    seen: set[tuple] = set()
    elements = 0
    total = 0
    by_dtype: dict[str, int] = {}
    for arr in _constants(graph):
        key = (arr.__array_interface__["data"][0], arr.nbytes, arr.dtype.str, arr.shape)
        if key in seen:
            continue
        seen.add(key)
        elements += int(arr.size)
        total += int(arr.nbytes)
        name = as_dtype(arr.dtype).short
        by_dtype[name] = by_dtype.get(name, 0) + int(arr.nbytes)
    return elements, total, dict(sorted(by_dtype.items(), key=lambda kv: (-kv[1], kv[0])))


def _constants(graph: Graph) -> Iterator[np.ndarray]:
    for g in graph.all_graphs():
        for v in g.initializers.values():
            yield v.const
        for node in g.nodes:
            for a in node.attrs.values():
                if isinstance(a, np.ndarray):
                    yield a


# ---- text

def format_summary(s: dict) -> str:
    """The summary as aligned text for a terminal."""
    lines = [f"{s['path']}: {_size(s['file_size'])}"]
    lines += _header_lines(s)
    producer = s["producer"]
    lines.append(f"  {'versions':<10} IR version {s['ir_version']}, opset {s['opset_version']}")
    lines.append(f"  {'producer':<10} {producer['name'] or '-'} {producer['version']}".rstrip())
    if s["doc_string"]:
        lines.append(f"  {'doc':<10} {s['doc_string']}")
    for key, value in s["metadata"].items():
        lines.append(f"  {'metadata':<10} {key} = {value}")
    lines.append(f"graph {s['graph_name']}: {len(s['inputs'])} inputs, {len(s['outputs'])} outputs, "
                 f"{s['nodes']} nodes" + (f" ({s['subgraphs']} subgraphs)" if s["subgraphs"] else ""))
    lines += _values_lines("inputs", s["inputs"])
    lines += _values_lines("outputs", s["outputs"])
    lines += _table_lines(f"ops ({len(s['ops'])} kinds, {s['nodes']} nodes)", {k: str(v) for k, v in s["ops"].items()})
    lines.append(f"parameters: {s['parameters']:,} elements, {_size(s['parameter_bytes'])}")
    lines += [f"  {name:<10} {_size(n)}" for name, n in s["parameter_bytes_by_dtype"].items()]
    lines += guard_lines(s.get("guards", []))
    lines += batching_lines(s.get("batching"))
    return "\n".join(lines)


def batching_lines(b: "dict | None") -> list[str]:
    """The batch-independence verdict as text: may ``kiln serve`` stack requests, and why."""
    if b is None:
        return []
    verdict = f"batchable along '{b['symbol']}'" if b["batchable"] else "not batchable (kiln serve runs requests one at a time)"
    return [f"batching: {verdict}", f"  {b['reason']}"]


def guard_lines(guards: list[dict]) -> list[str]:
    """The guards as text: one line each, the source line, then the code read there."""
    if not guards:
        return ["guards: none"]
    lines = [f"guards ({len(guards)}: the graph refuses inputs that change these values read while tracing):"]
    for g in guards:
        lines.append(f"  {g['location'] or '?'}: {g['what']} must be {g['expected']}")
        if g["code"]:
            lines.append(f"      {g['code']}")
    return lines


def _header_lines(s: dict) -> list[str]:
    h = s["header"]
    fb_end = h["flatbuffer_offset"] + h["flatbuffer_size"]
    data_end = h["data_offset"] + h["data_size"]
    check = "verified" if s["data_checksum_verified"] else "not verified (use --verify)"
    return [
        f"  {'header':<10} version {h['header_version']}, flags {h['flags']}",
        f"  {'graph':<10} bytes {h['flatbuffer_offset']}..{fb_end} ({h['flatbuffer_size']:,} bytes), "
        f"crc32 {h['flatbuffer_crc32']:08x} verified",
        f"  {'data':<10} bytes {h['data_offset']}..{data_end} ({h['data_size']:,} bytes), "
        f"crc32 {h['data_crc32']:08x} {check}",
    ]


def _values_lines(title: str, values: list[dict]) -> list[str]:
    return _table_lines(title, {v["name"]: _type_text(v) for v in values})


def _table_lines(title: str, rows: dict[str, str]) -> list[str]:
    if not rows:
        return [f"{title}: none"]
    width = max(len(k) for k in rows)
    return [f"{title}:"] + [f"  {k:<{width}}  {v}" for k, v in rows.items()]


def _type_text(v: dict) -> str:
    if v["dtype"] is None:
        return "?"
    shape = None if v["shape"] is None else tuple(v["shape"])
    return v["dtype"] + format_shape(shape)


def format_bytes(n: int) -> str:
    """``n`` bytes for people: 512 B, 1.5 KiB, 3.2 MiB ... (kiln view shows sizes so too)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def _size(n: int) -> str:
    return format_bytes(n) if n < 1024 else f"{format_bytes(n)} ({n:,} bytes)"

