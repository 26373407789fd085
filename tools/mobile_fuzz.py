"""Fuzzing the mobile path: mutated packed files must be refused with a kiln error or run, nothing else.

Seeds are small models packed by ``kiln mobile pack`` (fp32 and int8 weights). A case is one of:

- a **metadata** mutation, written back as a valid .kiln file (so it reaches the mobile checks, not a
  checksum): the arena JSON with its size set to 8 GiB or to less than the slots need, offsets negative,
  misaligned, past the end, overlapping another live value, numbers turned into floats, strings, bools
  or nulls, keys dropped, a slot given to a graph input or a constant, the JSON cut, deeply nested or
  replaced by garbage; the op manifest not a list, holding numbers or unknown ops; the version changed;
- a **byte-level** mutation of the whole file with tools/fuzz.py's mutators (truncation, bit flips,
  header and FlatBuffer fields rewritten, strings changed), checksums recomputed half the time.

The oracle runs what ``kiln mobile bundle`` runs on a file (``read_manifest``, kernel selection) and what
the bundle's stub runs (``runtime.load``, then ``run`` on random inputs of the declared shapes): each must
finish or raise ``KilnError``, within ``TIME_LIMIT_S`` and (when measured) ``MEMORY_LIMIT_BYTES`` of
allocations (the arena included). Case ``i`` of seed ``s`` is made by ``random.Random(f"{s}:{i}")``.

    python -m kiln.tools.mobile_fuzz --iterations 50000 --seed 1 [--seconds 600] [--out mobile-fuzz-failures]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import tracemalloc
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from kiln.errors import KilnError

TIME_LIMIT_S = 2.0
MEMORY_LIMIT_BYTES = 64 << 20
_ARENA, _OPS, _VERSION = "kiln.mobile.arena", "kiln.mobile.ops", "kiln.mobile.version"


# --------------------------------------------------------------------------- seeds
def seed_graphs() -> dict:
    """Small graphs to pack: a Gemm/MatMul chain with a skip connection (values of different sizes and
    lifetimes), and a Conv/pool/Gemm net (int8 weights when packed with quantization)."""
    from kiln.ir import Graph

    rng = np.random.default_rng(1)
    g = Graph("chain")
    x = g.add_input("x", "float32", ["batch", 8])
    a = g.op("Relu", x)
    h = g.op("Gemm", a, g.add_initializer("w", rng.standard_normal((16, 8)).astype(np.float32)),
             g.add_initializer("b", rng.standard_normal(16).astype(np.float32)), transB=1)
    y = g.op("Add", g.op("MatMul", h, g.add_initializer("w2", rng.standard_normal((16, 8)).astype(np.float32))), a)
    g.outputs = [g.op("Relu", y), h]

    c = Graph("convnet")
    x = c.add_input("x", "float32", [1, 3, 8, 8])
    y = c.op("Conv", x, c.add_initializer("cw", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
             c.add_initializer("cb", rng.standard_normal(4).astype(np.float32)), pads=[1, 1, 1, 1])
    y = c.op("MaxPool", c.op("Relu", y), kernel_shape=[2, 2], strides=[2, 2])
    y = c.op("Flatten", y)
    c.outputs = [c.op("Gemm", y, c.add_initializer("fw", rng.standard_normal((5, 64)).astype(np.float32)),
                      transB=1)]
    return {"chain": g, "convnet": c}


@dataclass
class PackedSeed:
    name: str
    graph: object  # the packed kiln Graph (metadata mutations start from it)
    data: bytes    # its .kiln bytes
    kiln_seed: object  # a serializer.fuzz_seeds.Seed of the same bytes (byte-level mutators)


def build_seeds() -> list:
    from kiln.mobile_stub.pack import pack
    from kiln.serializer import save
    from kiln.tools.fuzz_seeds import Seed, _SiteMap

    seeds = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, g in seed_graphs().items():
            for quantize in (None, "int8"):
                packed = pack(g, quantize=quantize)
                tag = f"{name}-{quantize or 'fp32'}"
                data = save(packed, Path(tmp) / f"{tag}.kiln").read_bytes()
                kseed = Seed(tag, data)
                _SiteMap(kseed).walk()
                seeds.append(PackedSeed(tag, packed, data, kseed))
    return seeds


# --------------------------------------------------------------------------- metadata mutations
_JUNK = [None, True, False, -1, -64, 1.5, "64", "", [], {}, 1 << 33, 1 << 63, 1 << 70, -(1 << 63), float("nan")]


def _mutate_arena(rng: random.Random, plan: dict, seed: PackedSeed) -> str:
    values = plan["values"]
    names = list(values)
    kind = rng.choice(["size", "huge", "offset", "nbytes", "overlap", "junk_slot", "junk_size", "junk_alignment",
                       "drop_key", "drop_slot", "extra_slot", "slot_shape", "alignment"])
    if kind == "size":
        plan["size"] = rng.choice([0, plan["size"] - 64, plan["size"] + 64, plan["size"] * 2])
    elif kind == "huge":
        plan["size"] = rng.choice([8 << 30, 1 << 40, (1 << 63) - 1])
        if rng.random() < 0.5 and names:  # a slot far out too, so the size is "needed"
            values[rng.choice(names)][0] = plan["size"] - 64
    elif kind == "offset" and names:
        n = rng.choice(names)
        values[n][0] = rng.choice([-64, -1, 1, 32, values[n][0] + 64, plan["size"], plan["size"] - 1, 1 << 62])
    elif kind == "nbytes" and names:
        n = rng.choice(names)
        values[n][1] = rng.choice([0, -4, 1, values[n][1] * 2, values[n][1] + 4, 1 << 40])
    elif kind == "overlap" and len(names) > 1:
        a, b = rng.sample(names, 2)
        values[b][0] = values[a][0]
    elif kind == "junk_slot" and names:
        n = rng.choice(names)
        values[n] = rng.choice([rng.choice(_JUNK), [rng.choice(_JUNK), values[n][1]], [values[n][0], rng.choice(_JUNK)],
                                [0], [0, 0, 0], {"offset": 0}])
    elif kind == "junk_size":
        plan["size"] = rng.choice(_JUNK)
    elif kind == "junk_alignment":
        plan["alignment"] = rng.choice(_JUNK + [0, 3, 48, 1 << 20])
    elif kind == "alignment":
        plan["alignment"] = rng.choice([1, 2, 128, 4096])
    elif kind == "drop_key":
        plan.pop(rng.choice(["size", "alignment", "values"]), None)
    elif kind == "drop_slot" and names:
        values.pop(rng.choice(names))
    elif kind == "extra_slot":
        others = [v.name for v in seed.graph.inputs] + list(seed.graph.initializers) + ["nowhere", ""]
        values[rng.choice(others)] = [rng.choice([0, plan["size"]]), rng.choice([0, 64, 128])]
    elif kind == "slot_shape" and names:
        plan["values"] = rng.choice([[], "x", None, [[0, 64]], {n: values[n] for n in names[:1]}])
    return f"arena {kind}"


def _mutate_text(rng: random.Random, text: str) -> tuple:
    kind = rng.choice(["cut", "nest", "garbage", "number", "bigint"])
    if kind == "cut":
        return text[: rng.randrange(len(text) + 1)], "cut"
    if kind == "nest":
        depth = rng.choice([50, 5000, 100000])
        return "[" * depth + "]" * depth, f"nested {depth}"
    if kind == "garbage":
        return rng.choice(["{", "nul\0l", "\ufffd", "NaN", "[1, 2", "{\"size\": 1e999}", "x" * 1000]), "garbage"
    if kind == "number":
        return rng.choice(["0", "-1", "1e400", "true", "null", "\"s\""]), "scalar"
    return "{\"size\": " + "9" * 5000 + ", \"alignment\": 64, \"values\": {}}", "huge int literal"


def mutate_metadata(rng: random.Random, seed: PackedSeed) -> tuple:
    """Change the packed metadata and return (props, note)."""
    props = dict(seed.graph.metadata.props)
    target = rng.choice([_ARENA, _ARENA, _ARENA, _OPS, _VERSION])
    if target == _ARENA and rng.random() < 0.8:
        plan = json.loads(props[_ARENA])
        notes = []
        for _ in range(rng.choice([1, 1, 2])):
            try:
                notes.append(_mutate_arena(rng, plan, seed))
            except (TypeError, KeyError, AttributeError, IndexError):
                notes.append("(a second mutation found nothing to change)")
        try:
            props[_ARENA] = json.dumps(plan)
        except (ValueError, OverflowError):
            props[_ARENA] = "{}"
        return props, "; ".join(notes)
    if target == _OPS and rng.random() < 0.7:
        ops = json.loads(props[_OPS])
        choice = rng.choice(["not_list", "numbers", "unknown", "empty", "no_colon", "drop"])
        if choice == "not_list":
            props[_OPS] = json.dumps({"ops": ops})
        elif choice == "numbers":
            props[_OPS] = json.dumps(ops + [1, None])
        elif choice == "unknown":
            props[_OPS] = json.dumps(ops + ["Frobnicate:float32", "Conv:int64"])
        elif choice == "empty":
            props[_OPS] = "[]"
        elif choice == "no_colon":
            props[_OPS] = json.dumps(["Conv"])
        else:
            del props[_OPS]
        return props, f"ops {choice}"
    if target == _VERSION:
        props[_VERSION] = rng.choice(["0", "2", "", "1 ", "one"])
        return props, "version"
    text, note = _mutate_text(rng, props[target])
    props[target] = text
    return props, f"{target} {note}"


# --------------------------------------------------------------------------- cases
@dataclass
class Case:
    seed_name: str
    index: int
    note: str
    data: bytes


def make_case(seeds: list, seed: int, index: int, folder: Path) -> Case:
    from kiln.tools import fuzz as kfuzz
    from kiln.serializer import save

    rng = random.Random(f"{seed}:{index}")
    s = rng.choice(seeds)
    if rng.random() < 0.6:
        props, note = mutate_metadata(rng, s)
        g = s.graph.copy()
        g.metadata.props = props
        data = save(g, folder / "case.kiln").read_bytes()
        return Case(s.name, index, f"metadata: {note}", data)
    name = rng.choice(sorted(kfuzz.MUTATORS))
    buf, note = kfuzz.MUTATORS[name](rng, s.kiln_seed, [x.kiln_seed for x in seeds])
    if rng.random() < 0.5:
        buf = kfuzz.fix_checksums(bytearray(buf))
        note += " (+crc)"
    return Case(s.name, index, f"bytes {name}: {note}", bytes(buf))


# --------------------------------------------------------------------------- the oracle
@dataclass
class Result:
    outcome: str  # "ran", "refused", "crash", "slow", "memory"
    detail: str
    seconds: float = 0.0
    peak: int = 0


def check(path: Path, *, measure_memory: bool = False) -> Result:
    """What ``kiln mobile bundle`` and the bundled stub do with the file at ``path``."""
    from kiln.mobile_stub import runtime
    from kiln.mobile_stub.bundle import check_arena, read_manifest, select_kernel_modules

    if measure_memory:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            select_kernel_modules(read_manifest(str(path)))
            check_arena(str(path))
        except KilnError:
            pass  # bundle refuses it; the stub must still refuse or run it safely
        stub = runtime.load(str(path))
        rng = np.random.default_rng(0)
        feeds = []
        for i in stub.inputs:
            _, dtype, shape = stub.infos[i]
            if int(np.prod([max(d, 1) for d in shape], dtype=object)) * dtype.itemsize > 16 << 20:
                return Result("refused", "loaded; inputs too large to try", time.perf_counter() - start)
            feeds.append(rng.standard_normal(shape).astype(dtype) if dtype.kind == "f"
                         else np.zeros(shape, dtype))
        stub.run(*feeds)
        return Result("ran", "ran", time.perf_counter() - start)
    except KilnError as e:
        return Result("refused", f"{type(e).__name__}: {e}", time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - the failure being looked for
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
        return Result("crash", f"{type(e).__name__}: {e}\n{tb}", time.perf_counter() - start)
    finally:
        if measure_memory:
            _PEAK[0] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()


_PEAK = [0]


def judge(r: Result, measured: bool) -> Result:
    if r.outcome == "crash":
        return r
    if r.seconds > TIME_LIMIT_S:
        return Result("slow", f"{r.seconds:.2f} s > {TIME_LIMIT_S} s: {r.detail[:200]}", r.seconds)
    if measured and _PEAK[0] > MEMORY_LIMIT_BYTES:
        return Result("memory", f"peak {_PEAK[0]:,} bytes > {MEMORY_LIMIT_BYTES:,}: {r.detail[:200]}", r.seconds,
                      _PEAK[0])
    return r


def run(iterations: int, seed: int, *, seconds: Optional[float] = None, first: int = 0,
        out: Optional[Path] = None, memory_every: int = 20, log=print) -> Counter:
    """Run cases ``first..first+iterations``; returns outcome counts. Failures are logged and, with
    ``out``, saved as ``case-<seed>-<i>.kiln`` with a .txt of what happened."""
    warnings.simplefilter("ignore", RuntimeWarning)  # overflow in kernels fed mutated weights: not a failure
    seeds = build_seeds()
    counts: Counter = Counter()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-mobile-fuzz-") as tmp:
        folder = Path(tmp)
        for index in range(first, first + iterations):
            if seconds is not None and time.perf_counter() - start > seconds:
                break
            case = make_case(seeds, seed, index, folder)
            path = folder / "mutated.kiln"
            path.write_bytes(case.data)
            measured = memory_every > 0 and index % memory_every == 0
            r = judge(check(path, measure_memory=measured), measured)
            counts[r.outcome] += 1
            if r.outcome not in ("ran", "refused"):
                log(f"case {index} ({case.seed_name}; {case.note}): {r.outcome}: {r.detail}")
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"case-{seed}-{index}.kiln").write_bytes(case.data)
                    (out / f"case-{seed}-{index}.txt").write_text(f"{case.note}\n{r.outcome}\n{r.detail}\n")
            if (index - first + 1) % 1000 == 0:
                log(f"{index - first + 1} cases in {time.perf_counter() - start:.0f} s: {dict(counts)}")
    return counts


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.tools.mobile_fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=50000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--first", type=int, default=0, help="first case index (replay case i with --first i --iterations 1)")
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.add_argument("--out", type=Path, help="folder to save failing cases into")
    args = p.parse_args(argv)
    start = time.perf_counter()
    counts = run(args.iterations, args.seed, seconds=args.seconds, first=args.first, out=args.out)
    bad = sum(v for k, v in counts.items() if k not in ("ran", "refused"))
    print(f"{sum(counts.values())} cases in {time.perf_counter() - start:.0f} s: {dict(counts)}; "
          f"{bad} failures (non-kiln exception, slow or too much memory)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
