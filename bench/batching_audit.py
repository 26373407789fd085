"""Batching audit (issue 16): may ``kiln serve`` stack requests for each model, and is the verdict true?

For every model of the public model suite (bench/suite_models.py) and of the test zoo (tests/zoo.py):
trace it with kiln as bench/model_suite.py does (``kiln.trace(model, example, dynamic=...)``, with
the trace check unless --no-check), run the
batch-independence analysis (kiln/ir/batch_independence.py) on the graph the runtime runs, and then
check the claim with kiln's CPU runtime: a batch of 4 distinct rows run stacked against each row run
alone. A model classified batchable must agree row for row (scale-aware: max|a - b| <= 1e-5 + 1e-4 x
max|alone|, the suite's tolerance); a model classified not batchable shows whether it really mixes rows
(the analysis was right to refuse) or would have agreed (the analysis was conservative there).

The 4 rows are the example's rows, repeated and made distinct: float inputs get noise (0.1 x their
std), token ids are permuted within each row, masks and other 0/1 inputs are kept.

Each model runs in its own subprocess with a timeout (one BLAS/torch thread), so a hang or a crash
costs only that model. Results: bench/BATCHING.md (a table: model, batchable, reason, stacked vs
alone) and, with --jsonl, one JSON line a model.

Run (the suite's venv):
    .venv-suite/bin/python bench/batching_audit.py                         # the zoo + every suite model
    .venv-suite/bin/python bench/batching_audit.py --models resnet18,hf/bert --no-zoo
    .venv-suite/bin/python bench/batching_audit.py --sample                # the zoo + SAMPLE below
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests"))

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")
OUT = HERE / "BATCHING.md"
ROWS = 4
RTOL, ATOL = 1e-4, 1e-5
# A varied sample for a short run: CNNs, a segmentation and a video model, vision transformers, text
# encoders and decoders (masks, positions, causal masks), an encoder-decoder, speech, recurrent layers.
SAMPLE = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "vit_b_16", "deeplabv3_mobilenet_v3_large",
          "r3d_18", "timm/convnext_atto", "hf/bert", "hf/gpt2", "hf/t5_encoder", "hf/llama", "hf/bart",
          "hf/wav2vec2", "torch/lstm_classifier", "torch/transformer_encoder")


# ---------------------------------------------------------------------------- one model
def zoo_case(name: str):
    """(model, example inputs by name, dynamic spec) of a zoo model."""
    import zoo

    model, inputs, spec = zoo.by_name(name).factory()
    names, tensors = zoo.input_list(model, inputs)
    return model, dict(zip(names, tensors)), spec


def suite_case(name: str):
    """(model, example inputs by name, dynamic spec) of a suite model, named as bench/model_suite.py
    names a single input (after forward's own parameter)."""
    import inspect

    import suite_models

    case = suite_models.by_name(name)
    model = case.build()
    inputs = case.inputs("example")
    dynamic = dict(case.dynamic)
    params = list(inspect.signature(model.forward).parameters)
    if len(inputs) == 1 and params and next(iter(inputs)) not in params:
        (old,) = inputs
        inputs = {params[0]: inputs[old]}
        dynamic = {params[0] if k == old else k: d for k, d in dynamic.items()}
    return model, inputs, dynamic


def distinct_rows(inputs: dict, rows: int, seed: int = 16) -> dict:
    """``rows`` rows made from the example's rows (numpy, by name), each row distinct (see the module
    docstring)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = {}
    for name, a in inputs.items():
        picked = np.stack([a[i % a.shape[0]] for i in range(rows)])
        if picked.dtype.kind == "f":
            scale = float(picked.std()) or 1.0
            picked = (picked + 0.1 * scale * rng.standard_normal(picked.shape)).astype(a.dtype)
        elif picked.dtype.kind in "iu" and len(np.unique(picked)) > 2 and picked.ndim >= 2:
            for i in range(1, rows):
                picked[i] = picked[i].reshape(-1)[rng.permutation(picked[i].size)].reshape(picked[i].shape)
        out[name] = picked
    return out


def audit(name: str, check: bool = True) -> dict:
    """Trace (with kiln's trace check unless ``check`` is False, as bench/model_suite.py traces),
    analyse and check one model; the record of the table."""
    import numpy as np
    import torch

    import kiln
    from kiln.ir.batch_independence import analyze_batching

    torch.set_num_threads(1)
    rec: dict = {"model": name}
    t0 = time.perf_counter()
    model, inputs, dynamic = zoo_case(name[4:]) if name.startswith("zoo/") else suite_case(name)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph = kiln.trace(model, inputs, dynamic=dynamic, check=check)
        except Exception as e:  # noqa: BLE001 - a model kiln cannot trace has no verdict
            rec.update(status="not traced", reason=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rec["seconds"] = round(time.perf_counter() - t0, 1)
            return rec
    program = kiln.load(graph)
    verdict = analyze_batching(program.graph)
    traced = analyze_batching(graph)
    rec.update(status="ok", batchable=verdict.batchable, reason=verdict.reason, op=verdict.op,
               module=verdict.scope, symbol=verdict.symbol)
    if traced.batchable != verdict.batchable:
        rec["traced_verdict"] = traced.reason
    if verdict.symbol is not None:
        feeds = distinct_rows({n: np.asarray(kiln.frontend.tracer.to_numpy(t)) for n, t in inputs.items()}, ROWS)
        try:
            together = program.run(feeds)
            worst, worst_rel = 0.0, 0.0
            for i in range(ROWS):
                alone = program.run({n: a[i:i + 1] for n, a in feeds.items()})
                for out, a in alone.items():
                    t = together[out][i:i + 1]
                    if t.shape != a.shape:
                        worst, worst_rel = float("inf"), float("inf")
                        continue
                    diff = float(np.abs(t.astype(np.float64) - a.astype(np.float64)).max(initial=0.0))
                    scale = float(np.abs(a.astype(np.float64)).max(initial=0.0))
                    worst = max(worst, diff)
                    worst_rel = max(worst_rel, diff / (ATOL + RTOL * scale))
            rec["max_diff"] = worst
            rec["rows_agree"] = worst_rel <= 1.0
        except Exception as e:  # noqa: BLE001 - e.g. a guard that refuses another batch size
            rec["run_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


# ---------------------------------------------------------------------------- the run
def run_one(name: str, timeout: float, logs: Path, check: bool = True) -> dict:
    env = dict(os.environ, **{v: "1" for v in THREAD_VARS})
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        out = Path(f.name)
    log = logs / (name.replace("/", "_") + ".log")
    t0 = time.perf_counter()
    try:
        with open(log, "w") as lf:
            proc = subprocess.run([sys.executable, __file__, "--worker", name, "--worker-out", str(out),
                                   *([] if check else ["--no-check"])],
                                  env=env, stdout=lf, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
        text = out.read_text()
        if proc.returncode != 0 or not text:
            tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
            return {"model": name, "status": "failed", "reason": f"exit {proc.returncode}: {tail[0][:300]}"}
        return json.loads(text)
    except subprocess.TimeoutExpired:
        return {"model": name, "status": "timeout", "reason": f"no verdict within {timeout:.0f} s",
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        out.unlink(missing_ok=True)


def selected(args) -> list[str]:
    names: list[str] = []
    if args.zoo:
        import zoo
        names += [f"zoo/{e.name}" for e in zoo.ZOO
                  if e.needs is None or __import__("importlib").util.find_spec(e.needs) is not None]
    if args.models:
        names += [m.strip() for m in args.models.split(",") if m.strip()]
    elif args.sample:
        names += list(SAMPLE)
    elif not args.zoo_only:
        import suite_models
        names += [c.name for c in suite_models.all_cases()]
    return names


def verdict_cell(r: dict) -> str:
    if r.get("status") != "ok":
        return r.get("status", "?")
    return "yes" if r["batchable"] else "no"


def check_cell(r: dict) -> str:
    if "run_error" in r:
        return f"run failed: {r['run_error']}"
    if "max_diff" not in r:
        return "-"
    diff = r["max_diff"]
    agree = r["rows_agree"]
    if r["batchable"]:
        return f"{'0 wrong' if agree else '**WRONG**'} (max diff {diff:.2g})"
    return f"{'rows agree: conservative' if agree else 'rows differ: mixes'} (max diff {diff:.3g})"


def write_report(rows: list[dict], path: Path, command: str, wall: float, everything: bool) -> str:
    ok = [r for r in rows if r.get("status") == "ok"]
    yes = [r for r in ok if r["batchable"]]
    wrong = [r for r in yes if r.get("rows_agree") is False]
    conservative = [r for r in ok if not r["batchable"] and r.get("rows_agree") is True]
    lines = [
        "# Batching audit (issue 16)",
        "",
        "Whether `kiln serve` stacks concurrent requests for a model (`batching: auto`): only when the",
        "batch-independence analysis (kiln/ir/batch_independence.py) proves that every output row depends",
        "only on its own input row. Each claim is then checked with kiln's CPU runtime: 4 distinct rows run",
        "stacked against each row run alone (scale-aware tolerance max|a - b| <= 1e-5 + 1e-4 x max|alone|).",
        "For models classified *not* batchable the same check tells a real row mixer from a refusal that was",
        "conservative. Written by bench/batching_audit.py.",
        "",
        f"Run: `{command}` ({len(rows)} models, {wall / 60:.1f} min on this machine, one thread per model).",
    ]
    if not everything:
        lines += ["", "**This run covers the zoo and a sample of the suite, not every suite model** (the full suite",
                  "takes hours on this 2-core box and another long job was running). For all of them:",
                  "`.venv-suite/bin/python bench/batching_audit.py`."]
    lines += [
        "",
        f"- classified: {len(ok)} of {len(rows)} ({len(rows) - len(ok)} not traced / failed / timed out)",
        f"- batchable: {len(yes)}; verified 0 wrong: {len(yes) - len(wrong)}; **wrong: {len(wrong)}**",
        f"- not batchable: {len(ok) - len(yes)}, of which the rows would have agreed (the analysis was "
        f"conservative): {len(conservative)}" + (f" ({', '.join(r['model'] for r in conservative)})"
                                                 if conservative else ""),
        "",
        "| model | batchable | stacked vs alone (4 rows) | reason |",
        "|---|---|---|---|",
    ]
    for r in rows:
        reason = (r.get("reason") or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['model']} | {verdict_cell(r)} | {check_cell(r)} | {reason} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated suite names (zoo models as zoo/<name>)")
    ap.add_argument("--sample", action="store_true", help=f"the sample of {len(SAMPLE)} suite models (SAMPLE)")
    ap.add_argument("--no-zoo", dest="zoo", action="store_false", help="leave the test zoo out")
    ap.add_argument("--zoo-only", action="store_true", help="only the test zoo")
    ap.add_argument("--timeout-per-model", type=float, default=600.0)
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="trace without kiln's trace check (faster; guards the check would drop stay)")
    ap.add_argument("--out", default=str(OUT), help=f"markdown report (default {OUT.relative_to(ROOT)})")
    ap.add_argument("--jsonl", help="also write one JSON line a model here")
    ap.add_argument("--logs", default=str(Path(tempfile.gettempdir()) / "kiln-batching-logs"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        rec = audit(args.worker, args.check)
        Path(args.worker_out).write_text(json.dumps(rec))
        return
    names = selected(args)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for name in names:
        rec = run_one(name, args.timeout_per_model, logs, args.check)
        rows.append(rec)
        print(f"{name:40s} {verdict_cell(rec):10s} {check_cell(rec)[:60]:60s} {(rec.get('reason') or '')[:120]}",
              flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(rec) + "\n")
    python = os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(str(ROOT)) else "python"
    command = f"{python} bench/batching_audit.py " + " ".join(argv if argv is not None else sys.argv[1:])
    everything = not args.models and not args.sample and not args.zoo_only
    print(write_report(rows, Path(args.out), command.strip(), time.perf_counter() - t0, everything))


if __name__ == "__main__":
    main()
