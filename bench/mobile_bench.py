"""Issue 10 acceptance: the mobile path on MobileNetV3-style and a small transformer from tests/zoo.py.

For each model: trace it, ``check`` it, pack it fp32 and int8 (file sizes), compare the int8 stub run
against the fp32 full runtime on 100 random inputs (worst relative error, max |diff| / max |ref| per
input, and top-1 agreement for the classifier), bundle it, run the bundle in a fresh venv holding only
numpy (``python -m venv`` + ``pip install numpy``) and compare with ``kiln run`` on the packed file,
and measure peak memory (tracemalloc peak over load + one run, in a child process each) of the stub
with its static arena against kiln's normal runtime on the same packed file.

    .venv/bin/python bench/mobile_bench.py          # writes "## Mobile stub (issue 10)" to RESULTS.md
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import kiln  # noqa: E402
from results_md import RESULTS, cpu_name, replace_section, utc_now  # noqa: E402

TITLE = "## Mobile stub (issue 10)"
TRIALS = 100
DIMS = {"mobilenet_v3": {"batch": 1}, "transformer_encoder": {"batch": 1, "seq": 8}}  # the static shapes packed
MEMORY_CHILD = r"""
import sys, tracemalloc, numpy as np
kind, path = sys.argv[1], sys.argv[2]
if kind == "stub":
    from kiln.mobile_stub.runtime import load
    tracemalloc.start()  # after the imports: the model's own memory, not the interpreter's
    prog = load(path)
    names = [prog.infos[i][0] for i in prog.inputs]
    feeds = {n: np.random.default_rng(0).standard_normal(prog.infos[i][2]).astype(prog.infos[i][1])
             for n, i in zip(names, prog.inputs)}
    prog.run(**feeds)
else:
    import kiln, kiln.runtime.program
    tracemalloc.start()
    prog = kiln.load(path)
    feeds = {s.name: np.random.default_rng(0).standard_normal([int(d) for d in s.type.shape]).astype(np.float32)
             for s in prog.inputs}
    prog.run(feeds)
print(tracemalloc.get_traced_memory()[1])
"""


def build(name: str, work: Path) -> Path:
    import zoo

    model, example, dynamic = zoo.by_name(name).factory()
    graph = kiln.trace(model, example, dynamic=dynamic)
    path = work / f"{name}.kiln"
    kiln.save(graph, path)
    return path


def fresh_venv(work: Path) -> Path:
    """A venv with numpy alone (from the configured package index)."""
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "numpy"], check=True)
    return py


def stub_vs_fp32(fp32_packed: Path, int8_packed: Path, rng: np.random.Generator) -> tuple[float, float | None]:
    """Worst relative error of the int8 stub against the fp32 full runtime, and top-1 agreement when
    the output is [N, classes]."""
    from kiln.mobile_stub.runtime import load as stub_load

    ref, stub = kiln.load(str(fp32_packed)), stub_load(str(int8_packed))
    worst, agree = 0.0, []
    for _ in range(TRIALS):
        feeds = {s.name: rng.standard_normal([int(d) for d in s.type.shape]).astype(np.float32) for s in ref.inputs}
        want = ref.run(feeds, as_list=True)[0]
        got = stub.run(**feeds)[0]
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
        if want.ndim == 2 and want.shape[1] > 1:
            agree.append(float(np.mean(want.argmax(1) == got.argmax(1))))
    return worst, (float(np.mean(agree)) if agree else None)


def peak(kind: str, path: Path) -> int:
    out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, kind, str(path)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def measure(name: str, work: Path, py_fresh: Path) -> dict:
    from kiln.mobile_stub.bundle import bundle, top_level_imports
    from kiln.mobile_stub.check import check
    from kiln.mobile_stub.pack import pack_file

    src = build(name, work)
    dims = DIMS[name]
    problems = check(str(src), dims)
    fp32, int8 = work / f"{name}.fp32.mobile.kiln", work / f"{name}.int8.mobile.kiln"
    pack_file(src, fp32, dims=dims)
    rep = pack_file(src, int8, quantize="int8", dims=dims)
    rel, top1 = stub_vs_fp32(fp32, int8, np.random.default_rng(0))
    pyz = work / f"{name}.pyz"
    b = bundle(str(int8), str(pyz))
    # the bundle in the numpy-only venv against `kiln run` (the full runtime) on the same packed file
    prog = kiln.load(str(int8))
    feeds = {s.name: np.random.default_rng(1).standard_normal([int(d) for d in s.type.shape]).astype(np.float32)
             for s in prog.inputs}
    np.savez(work / "in.npz", **feeds)
    check_run = subprocess.run([str(py_fresh), str(pyz), "--check"], capture_output=True, text=True)
    run = subprocess.run([str(py_fresh), str(pyz), "--input", str(work / "in.npz"), "-o", str(work / "out.npz")],
                         capture_output=True, text=True)
    if run.returncode or check_run.returncode:
        raise SystemExit(f"{name}: bundle failed in the fresh venv: {run.stderr or check_run.stderr}")
    kiln_run = subprocess.run([sys.executable, "-m", "kiln", "run", str(int8), "--input", str(work / "in.npz"),
                               "-o", str(work / "ref.npz")], capture_output=True, text=True, check=True)
    assert kiln_run.returncode == 0
    got, want = np.load(work / "out.npz"), np.load(work / "ref.npz")
    bundle_diff = max(float(np.max(np.abs(got[k] - want[k]) / max(np.max(np.abs(want[k])), 1e-30)))
                      for k in want.files)
    forbidden = [m for m in top_level_imports(str(pyz)) if m.startswith(("kiln.ir", "torch", "onnx"))]
    return {"model": name, "check_problems": len(problems), "fp32_size": fp32.stat().st_size,
            "int8_size": int8.stat().st_size, "src_size": src.stat().st_size, "rel_err": rel, "top1": top1,
            "pack_rel_err": rep.max_rel_error, "bundle_size": b.size, "bundle_code": b.code_size,
            "bundle_model": b.model_size, "kernels": b.kernels, "modules": len(b.modules),
            "package_size": b.package_size, "package_zip": b.package_zip_size, "bundle_vs_kiln": bundle_diff,
            "forbidden_imports": forbidden, "arena": rep.arena_size, "arena_naive": rep.arena_naive_size,
            "peak_stub": peak("stub", int8), "peak_full": peak("full", int8)}


def table(rows: list[dict]) -> str:
    kb = lambda n: f"{n / 1024:.1f} KiB"
    lines = [TITLE, "",
             "`python bench/mobile_bench.py` (2-core shared machine). int8 = `pack --quantize int8`; errors are the "
             "int8 stub runtime vs the fp32 full runtime over "
             f"{TRIALS} random inputs (max |diff| / max |ref| per input, worst); the bundle ran in a fresh venv "
             "with numpy alone and is compared with `kiln run` on the same packed file; peak memory is the "
             "tracemalloc peak over load + one run, each in its own process.", "",
             "| model | check | fp32 packed | int8 packed | ratio | rel err (worst) | top-1 agree | bundle | "
             "bundle code | bundle vs kiln run | arena (naive) | peak stub | peak full runtime |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        top1 = "-" if r["top1"] is None else f"{r['top1']:.0%}"
        lines.append(
            f"| {r['model']} | {'pass' if r['check_problems'] == 0 else str(r['check_problems']) + ' missing'} | "
            f"{kb(r['fp32_size'])} | {kb(r['int8_size'])} | {r['int8_size'] / r['fp32_size']:.2f}x | "
            f"{r['rel_err']:.2%} | {top1} | {kb(r['bundle_size'])} | {kb(r['bundle_code'])} "
            f"({', '.join(r['kernels'])}) | {r['bundle_vs_kiln']:.1e} | {kb(r['arena'])} ({kb(r['arena_naive'])}) | "
            f"{kb(r['peak_stub'])} | {kb(r['peak_full'])} |")
    r = rows[0]
    shares = ", ".join(f"{x['model']} {x['bundle_code'] / x['package_zip']:.0%}" for x in rows)
    lines += ["", f"Static dims packed: {'; '.join(f'{m} ' + str(d) for m, d in DIMS.items())}. "
              f"Full kiln package: {kb(r['package_size'])} of .py source, {kb(r['package_zip'])} zipped; a "
              f"bundle's code (zipped, model excluded) is {shares} of that. "
              f"Bundles import no kiln.ir/torch/onnx at module level: "
              f"{'yes' if not any(x['forbidden_imports'] for x in rows) else 'NO'}."]
    lines += ["", f"Machine: {cpu_name()}, nproc {os.cpu_count()}, Python {platform.python_version()}, "
              f"numpy {np.__version__}; {utc_now()}.",
              "", "Goals (issue 10):"]
    for x in rows:
        ratio = x["int8_size"] / x["fp32_size"]
        lines.append(f"- {x['model']}: check passes: {'met' if x['check_problems'] == 0 else 'not met'}; int8 file at "
                     f"most 0.3x fp32: {ratio:.2f}x: {'met' if ratio <= 0.3 else 'not met'}; outputs within 2% "
                     f"relative: {x['rel_err']:.2%}: {'met' if x['rel_err'] <= 0.02 else 'not met'}; bundle in a "
                     f"numpy-only venv matches `kiln run`: {x['bundle_vs_kiln']:.1e}: "
                     f"{'met' if x['bundle_vs_kiln'] <= 1e-5 else 'not met'}"
                     + ("" if x["top1"] is None else f"; top-1 agreement {x['top1']:.0%}"))
    return "\n".join(lines) + "\n"


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        py = fresh_venv(work)
        rows = [measure(name, work, py) for name in ("mobilenet_v3", "transformer_encoder")]
    print(json.dumps(rows, indent=1))
    body = table(rows)
    print(body)
    replace_section(RESULTS, TITLE, body)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
