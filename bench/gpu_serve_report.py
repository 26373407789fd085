"""Markdown tables from bench/gpu_serve_bench.py's JSON files (bench/gpu_serve/*.json): one row per
(model, server, transport, clients), with the share of kiln's compute ceiling (best rows/s over buckets).

    python bench/gpu_serve_report.py bench/gpu_serve/*.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    rows, ceilings, devices = [], {}, set()
    for p in paths:
        r = json.loads(Path(p).read_text())
        devices.add(r.get("device", "?"))
        for model, e in r["models"].items():
            if e.get("ceiling"):
                best = max(v["rows_per_s"] for v in e["ceiling"].values())
                ceilings.setdefault(model, (best, e["ceiling"]))
            for server, s in e["servers"].items():
                label = server + (" (2 GPUs)" if "two_gpus." in p or p.endswith("bert_two_gpus.json") else "")
                if not s["ready"]:
                    rows.append((model, label, "-", "-", "not ready", "", "", "", "", "", "", "", Path(p).name))
                for x in s["runs"]:
                    share = x["req_per_s"] / ceilings[model][0] * 100 if model in ceilings else float("nan")
                    rows.append((model, label, x["mode"], x["clients"], f"{x['req_per_s']:.0f}", f"{share:.0f}%",
                                 f"{x['p50_ms']:.2f}" if x["p50_ms"] else "-", f"{x['p99_ms']:.1f}" if x["p99_ms"] else "-",
                                 f"{x['mean_batch']:.1f}" if x["mean_batch"] else "-",
                                 f"{x['gpu_util_pct']:.0f}" if x["gpu_util_pct"] is not None else "-",
                                 f"{x['server_cpu_us_per_req']:.0f}", f"{x['errors']}", Path(p).name))
    print("Devices:", "; ".join(sorted(devices)))
    for model, (best, c) in ceilings.items():
        print(f"\n{model} ceiling (kiln CudaProgram, one graph replay, device arrays): "
              + ", ".join(f"b{b} {v['ms']:.2f} ms" for b, v in c.items()) + f"; best {best:.0f} rows/s")
    print("\n| model | server | transport | clients | req/s | of ceiling | p50 ms | p99 ms | mean batch | GPU util % "
          "| server CPU us/req | errors | file |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
