"""Trace the test-zoo models here, for bench/gpu_bench.py's zoo section to run on the GPU machine.

    .venv/bin/python bench/gpu_zoo_export.py                 # every entry -> bench/zoo_traced/
    .venv/bin/python bench/gpu_zoo_export.py --only mlp,gpt  # a subset (merged into the manifest)

Why: issue 8 wants every tests/zoo.py model checked against torch on the GPU, but the device
machine's torch (2.11) lacks a hook kiln's tracer uses inside ``F.multi_head_attention_forward``,
so ``transformer_encoder`` and ``hf_gpt2`` do not trace there. The CUDA backend is not what fails,
so the check should not depend on that machine's tracer: this script traces each entry on this
box (newer torch), and writes, per entry,

- ``<name>.kiln``: the traced graph (``kiln.save``), which gpu_bench loads instead of tracing;
- ``<name>.pt``: the model's ``state_dict()`` (``torch.save``). The device builds the same model
  with the zoo factory and loads these weights with ``strict=True``, so its torch reference uses
  exactly the weights in the .kiln file, whatever its own torch's random initialisation does;
- ``manifest.json``: per entry the file names, their sha256 and sizes, the kiln, torch (and for
  ``needs`` entries, that package's) versions used, and the graph's input/output names; plus
  every entry not exported and why. gpu_bench refuses a file whose sha256 does not match.

The whole folder travels to the device with the run's ``carry`` option, which copies at most
64 MiB altogether (the working tree included), so an entry whose files exceed ``--entry-cap-mib``
(default 16) is skipped, as is any entry that would take the folder past ``--total-cap-mib``
(default 48). Entries whose ``needs`` package does not import are skipped (the manifest says so).

hf_bert / hf_gpt2 need transformers, which is no dependency of kiln; install it beside the venv:

    .venv/bin/pip install --target /tmp/hf452 transformers==4.52.4 && rm -rf /tmp/hf452/numpy*
    PYTHONPATH=/tmp/hf452 .venv/bin/python bench/gpu_zoo_export.py

(``rm``: keep the venv's numpy, not a second copy.) Why 4.52.4: from 4.5x on (checked: 4.57.6 and
5.24.0) GPT-2 builds its causal mask in ``transformers.masking_utils``, which calls ``torch.diff``,
an op kiln's tracer does not map yet, so hf_gpt2 traces nowhere with those; 4.52.4 traces both.
The weights are what makes the device's torch reference comparable: the device builds the model
with its own transformers and loads this state_dict strictly (a key or shape mismatch is reported
as an error row, not a pass); the manifest records the transformers version each graph came from.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

DEFAULT_OUT = HERE / "zoo_traced"
MANIFEST = "manifest.json"
MIB = 2 ** 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _version(module: str) -> Optional[str]:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except ImportError:
        return None


def export_entry(entry, out: Path) -> dict:
    """Trace one zoo entry and write ``<name>.kiln`` and ``<name>.pt`` into ``out``: its manifest record."""
    import torch

    import kiln
    import zoo

    model, inputs, spec = entry.factory()
    graph = kiln.trace(model, inputs, dynamic=spec)
    names, _ = zoo.input_list(model, inputs)
    graph_inputs = [v.name for v in graph.inputs]
    if graph_inputs != names:  # gpu_bench feeds the zoo's inputs positionally
        raise RuntimeError(f"the graph's inputs {graph_inputs} are not the zoo's {names}")
    kiln_file, pt_file = out / f"{entry.name}.kiln", out / f"{entry.name}.pt"
    kiln.save(graph, kiln_file)
    torch.save(model.state_dict(), pt_file)
    files = {"kiln": kiln_file.name, "state_dict": pt_file.name}
    rec = {"files": files,
           "sha256": {f: sha256(out / f) for f in files.values()},
           "bytes": {f: (out / f).stat().st_size for f in files.values()},
           "kiln_version": kiln.__version__,
           "torch_version": torch.__version__,
           "inputs": graph_inputs,
           "outputs": [v.name for v in graph.outputs],
           "dynamic": {k: {str(d): s for d, s in v.items()} for k, v in spec.items()}}
    if entry.needs is not None:
        rec[f"{entry.needs}_version"] = _version(entry.needs)
    return rec


def _remove(out: Path, rec_or_names) -> None:
    for name in rec_or_names:
        (out / name).unlink(missing_ok=True)


def _still_valid(out: Path, rec: dict) -> bool:
    """An entry kept from an earlier manifest: its files are there and unchanged."""
    try:
        return all(sha256(out / f) == h for f, h in rec["sha256"].items())
    except OSError:
        return False


def export(out: Path = DEFAULT_OUT, only: Optional[list] = None, entry_cap_mib: float = 16.0,
           total_cap_mib: float = 48.0) -> dict:
    """Export the zoo (or the ``only`` entries) into ``out``; write and return the manifest.

    With ``only``, entries of an existing manifest in ``out`` that were not re-exported stay in it
    (if their files still match) and count towards the total cap."""
    import torch

    import kiln
    import zoo

    out.mkdir(parents=True, exist_ok=True)
    chosen = list(zoo.ZOO)
    if only:
        known = {e.name for e in zoo.ZOO}
        unknown = [n for n in only if n not in known]
        if unknown:
            raise SystemExit(f"unknown zoo entries: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        chosen = [e for e in zoo.ZOO if e.name in only]
    entries: dict = {}
    skipped: dict = {}
    old_path = out / MANIFEST
    if only and old_path.exists():
        old = json.loads(old_path.read_text())
        for name, rec in old.get("entries", {}).items():
            if name not in only and _still_valid(out, rec):
                entries[name] = rec
        for name, why in old.get("skipped", {}).items():
            if name not in only and name not in entries:
                skipped[name] = why
    total = sum(sum(rec["bytes"].values()) for rec in entries.values())
    for entry in chosen:
        if entry.needs is not None and importlib.util.find_spec(entry.needs) is None:
            skipped[entry.name] = f"{entry.needs} is not installed here"
            print(f"{entry.name}: skipped ({skipped[entry.name]})", flush=True)
            continue
        try:
            rec = export_entry(entry, out)
        except Exception as e:  # noqa: BLE001 - recorded; the other entries are still exported
            skipped[entry.name] = f"export failed: {type(e).__name__}: {str(e)[:300]}"
            _remove(out, [f"{entry.name}.kiln", f"{entry.name}.pt"])
            print(f"{entry.name}: {skipped[entry.name]}", flush=True)
            continue
        size = sum(rec["bytes"].values())
        why = None
        if size > entry_cap_mib * MIB:
            why = f"{size / MIB:.1f} MiB of files, over the per-entry cap of {entry_cap_mib:g} MiB"
        elif total + size > total_cap_mib * MIB:
            why = (f"{size / MIB:.1f} MiB of files would take the folder to {(total + size) / MIB:.1f} MiB, "
                   f"over the total cap of {total_cap_mib:g} MiB")
        if why:
            _remove(out, rec["files"].values())
            skipped[entry.name] = why
            print(f"{entry.name}: skipped ({why})", flush=True)
            continue
        total += size
        entries[entry.name] = rec
        skipped.pop(entry.name, None)
        print(f"{entry.name}: " + ", ".join(f"{f} {rec['bytes'][f] / 1024:.0f} KiB" for f in rec["files"].values())
              + f"; inputs {rec['inputs']}", flush=True)
    manifest = {"created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "kiln_version": kiln.__version__, "torch_version": torch.__version__,
                "python": sys.version.split()[0],
                "caps_mib": {"entry": entry_cap_mib, "total": total_cap_mib},
                "total_bytes": total,
                "entries": {e.name: entries[e.name] for e in zoo.ZOO if e.name in entries},
                "skipped": {e.name: skipped[e.name] for e in zoo.ZOO if e.name in skipped}}
    old_path.write_text(json.dumps(manifest, indent=1) + "\n")
    listed = {MANIFEST} | {f for rec in entries.values() for f in rec["files"].values()}
    stray = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in listed)
    print(f"wrote {out}/{MANIFEST}: {len(entries)} entries, {total / MIB:.2f} MiB of model files "
          f"(torch {torch.__version__}, kiln {kiln.__version__}); skipped: "
          + (", ".join(f"{k} ({v})" for k, v in manifest["skipped"].items()) or "none"), flush=True)
    if stray:
        print(f"note: {out} also holds files the manifest does not list (they travel with `carry` too): "
              f"{', '.join(stray)}", flush=True)
    return manifest


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    ap.add_argument("--only", help="comma-separated zoo entries (default: all)")
    ap.add_argument("--entry-cap-mib", type=float, default=16.0, help="skip an entry whose files exceed this")
    ap.add_argument("--total-cap-mib", type=float, default=48.0, help="skip entries that take the folder past this")
    args = ap.parse_args(argv)
    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else None
    export(args.out, only, args.entry_cap_mib, args.total_cap_mib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
