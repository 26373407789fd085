"""Fuzzing the ONNX importer: mutated ModelProtos must import or raise a kiln error, nothing else.

The seeds are small valid models (onnx.helper) covering what the importer reads: initializers
(typed fields, raw data, external data in a side file), a sparse initializer, Constant nodes,
attributes of every kind kiln uses, If with outer-scope reads, Loop, symbolic dims. A case takes
one seed and applies 1-3 mutations at the protobuf level, so they reach the importer rather than
the protobuf parser: a scalar field set to a boundary value (dims -2, 2^31, 2^62; data types 0/99;
opset versions; names "" / "\\0" / "../x" / another value's name), a repeated field's element deleted,
duplicated or swapped, a sub-message replaced by another of the same type found elsewhere in the
model (a node's subgraph swapped for the main graph, an initializer for another), raw bytes cut or
grown; some cases also flip or cut bytes of the serialized model.

The oracle: ``import_onnx`` either returns a graph (which must then save as .kiln and load back, or
be refused by the writer with a kiln error) or raises ``KilnError``; any other exception, a case
over ``TIME_LIMIT_S`` or (when measured) over ``MEMORY_LIMIT_BYTES`` of Python allocations is a
failure. Cases are reproducible: case ``i`` of seed ``s`` is made by ``random.Random(f"{s}:{i}")``.

    python -m kiln.serializer.onnx_fuzz --iterations 20000 --seed 1 [--seconds 600] [--out onnx-fuzz-failures]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import tracemalloc
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor as FD
from onnx import TensorProto as T, helper as h, numpy_helper

from kiln.errors import KilnError

TIME_LIMIT_S = 2.0
MEMORY_LIMIT_BYTES = 64 << 20
EXTERNAL_FILE = "w.bin"
_EXTERNAL_BYTES = np.arange(16, dtype=np.float32).tobytes()


# --------------------------------------------------------------------------- seeds
def _vi(name, elem=T.FLOAT, shape=None):
    return h.make_tensor_value_info(name, elem, shape)


def _m(nodes, inputs, outputs, inits=(), sparse=(), opset=18):
    g = h.make_graph(nodes, "g", inputs, outputs, initializer=list(inits), sparse_initializer=list(sparse))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def seed_models() -> dict[str, onnx.ModelProto]:
    """The valid models mutations start from (each imports as is: test_onnx_fuzz checks)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    b = h.make_tensor("b", T.FLOAT, [4], [0.1, 0.2, 0.3, 0.4])  # typed field, not raw
    mlp = _m([h.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1, alpha=1.0),
              h.make_node("Relu", ["h"], ["r"]),
              h.make_node("Softmax", ["r"], ["y"], axis=-1)],
             [_vi("x", T.FLOAT, ["batch", 3])], [_vi("y", T.FLOAT, ["batch", 4])], [w, b])

    shape = numpy_helper.from_array(np.array([0, -1], np.int64), "shape")
    consts = _m([h.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([2.0], np.float32))),
                 h.make_node("Constant", [], ["ks"], value_ints=[1, 2]),
                 h.make_node("Mul", ["x", "k"], ["m"]),
                 h.make_node("Reshape", ["m", "shape"], ["r"]),
                 h.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
                 h.make_node("Concat", ["t", "t"], ["y"], axis=0)],
                [_vi("x", T.FLOAT, [2, 3, 1])], [_vi("y", T.FLOAT, None)], [shape])

    sp = h.make_sparse_tensor(numpy_helper.from_array(np.array([1.0, 2.0], np.float32), "s"),
                              numpy_helper.from_array(np.array([1, 5], np.int64), "s_i"), [2, 3])
    sparse = _m([h.make_node("Add", ["x", "s"], ["y"])], [_vi("x", T.FLOAT, [2, 3])], [_vi("y", T.FLOAT, [2, 3])],
                sparse=[sp])

    ext = T()
    ext.name, ext.data_type, ext.data_location = "e", T.FLOAT, T.EXTERNAL
    ext.dims.extend([4, 4])
    for k, v in (("location", EXTERNAL_FILE), ("offset", "0"), ("length", str(len(_EXTERNAL_BYTES)))):
        ext.external_data.add(key=k, value=v)
    external = _m([h.make_node("MatMul", ["x", "e"], ["y"])], [_vi("x", T.FLOAT, [1, 4])], [_vi("y", T.FLOAT, [1, 4])],
                  [ext])

    then = h.make_graph([h.make_node("Mul", ["x", "x"], ["t"])], "then", [], [_vi("t", T.FLOAT, [2])])
    other = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [_vi("e", T.FLOAT, [2])])
    cond_if = _m([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                  h.make_node("Greater", ["s", "zero"], ["c"]),
                  h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                 [_vi("x", T.FLOAT, [2])], [_vi("y", T.FLOAT, [2])],
                 [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])

    body = h.make_graph([h.make_node("Identity", ["cond_in"], ["cond_out"]),
                         h.make_node("Add", ["acc_in", "x"], ["acc_out"])],
                        "body", [_vi("i", T.INT64, []), _vi("cond_in", T.BOOL, []), _vi("acc_in", T.FLOAT, [2])],
                        [_vi("cond_out", T.BOOL, []), _vi("acc_out", T.FLOAT, [2])])
    loop = _m([h.make_node("Loop", ["n", "", "x"], ["y"], body=body)],
              [_vi("x", T.FLOAT, [2])], [_vi("y", T.FLOAT, [2])],
              [numpy_helper.from_array(np.array(3, np.int64), "n")])

    conv = _m([h.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1], strides=[1, 1], kernel_shape=[3, 3]),
               h.make_node("MaxPool", ["c"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
               h.make_node("Flatten", ["p"], ["y"])],
              [_vi("x", T.FLOAT, [1, 1, 4, 4])], [_vi("y", T.FLOAT, None)],
              [numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3)).astype(np.float32), "cw")])
    conv.graph.initializer[0].ClearField("raw_data")
    conv.graph.initializer[0].float_data.extend(rng.standard_normal(18).astype(np.float32).tolist())
    return {"mlp": mlp, "consts": consts, "sparse": sparse, "external": external, "if": cond_if, "loop": loop,
            "conv": conv}


# --------------------------------------------------------------------------- mutations
_INTS = [0, 1, -1, -2, 2, 3, 7, 99, 1 << 31, (1 << 31) - 1, 1 << 32, 1 << 40, 1 << 62, (1 << 63) - 1, -(1 << 63)]
_STRINGS = ["", "\0", "x\0y", " ", "../x", "/etc/passwd", "w.bin\0", "a" * 300, "\u00e9\u2603", "x", "y", "w",
            "then_branch", "axis", "perm", "location", "offset", "length"]


def _messages(msg, out: list, depth: int = 0) -> list:
    """Every message in ``msg`` (itself included), depth first."""
    out.append(msg)
    if depth > 60:
        return out
    for fd, value in msg.ListFields():
        if fd.type == FD.TYPE_MESSAGE:
            for sub in (value if _repeated(fd) else [value]):
                _messages(sub, out, depth + 1)
    return out


def _repeated(fd) -> bool:
    return fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == FD.LABEL_REPEATED


def _names(model) -> list[str]:
    found = set()
    for m in _messages(model, []):
        for fd, value in m.ListFields():
            if fd.type == FD.TYPE_STRING:
                found.update(value if _repeated(fd) else [value])
    return sorted(found)


def _int_value(rng: random.Random, old: int) -> int:
    return rng.choice(_INTS + [old + 1, old - 1, -old, old * 2])


def _set_scalar(rng: random.Random, msg, fd, names: list) -> str:
    rep = _repeated(fd)
    if rep:
        values = getattr(msg, fd.name)
        if not len(values):
            return ""
        i = rng.randrange(len(values))
        old = values[i]
    else:
        old = getattr(msg, fd.name)
    t = fd.type
    if t == FD.TYPE_STRING:
        new = rng.choice(_STRINGS + names)
    elif t == FD.TYPE_BYTES:
        new = rng.choice([b"", old[: len(old) // 2], old + old[:7], bytes(rng.getrandbits(8) for _ in range(len(old))),
                          b"\0" * 3, old + b"\0"])
    elif t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
        new = rng.choice([0.0, -0.0, float("nan"), float("inf"), -1.0, 1e30, 1e-30])
    elif t == FD.TYPE_BOOL:
        new = not old
    elif t == FD.TYPE_ENUM:
        new = rng.choice([v.number for v in fd.enum_type.values])
    else:
        new = _int_value(rng, int(old))
        bits = 32 if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32, FD.TYPE_UINT32, FD.TYPE_FIXED32) else 64
        unsigned = t in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64)
        new = new % (1 << bits) if unsigned else (new + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    try:
        if rep:
            getattr(msg, fd.name)[i] = new
        else:
            setattr(msg, fd.name, new)
    except (ValueError, TypeError):
        return ""
    return f"{type(msg).__name__}.{fd.name}{f'[{i}]' if rep else ''} = {new!r:.40}"


def mutate_field(rng: random.Random, model) -> str:
    msgs = _messages(model, [])
    names = _names(model)
    for _ in range(20):
        msg = rng.choice(msgs)
        fields = [fd for fd in msg.DESCRIPTOR.fields if fd.type != FD.TYPE_MESSAGE]
        if not fields:
            continue
        fd = rng.choice(fields)
        note = _set_scalar(rng, msg, fd, names)
        if note:
            return note
    return "no-op"


def mutate_repeated(rng: random.Random, model) -> str:
    """Delete, duplicate or swap elements of a repeated field (dims, nodes, inputs, attributes...)."""
    msgs = _messages(model, [])
    for _ in range(20):
        msg = rng.choice(msgs)
        fields = [fd for fd in msg.DESCRIPTOR.fields if _repeated(fd) and len(getattr(msg, fd.name))]
        if not fields:
            continue
        fd = rng.choice(fields)
        items = getattr(msg, fd.name)
        n = len(items)
        i, j = rng.randrange(n), rng.randrange(n)
        op = rng.choice(["delete", "duplicate", "swap", "clear"])
        if fd.type == FD.TYPE_MESSAGE:
            if op == "delete":
                del items[i]
            elif op == "duplicate":
                items.add().CopyFrom(items[i])
            elif op == "swap":
                a, b = type(items[i])(), type(items[j])()
                a.CopyFrom(items[i])
                b.CopyFrom(items[j])
                items[i].CopyFrom(b)
                items[j].CopyFrom(a)
            else:
                msg.ClearField(fd.name)
        else:
            values = list(items)
            if op == "delete":
                del values[i]
            elif op == "duplicate":
                values.append(values[i])
            elif op == "swap":
                values[i], values[j] = values[j], values[i]
            else:
                values = []
            msg.ClearField(fd.name)
            getattr(msg, fd.name).extend(values)
        return f"{type(msg).__name__}.{fd.name}: {op} [{i}]"
    return "no-op"


def mutate_transplant(rng: random.Random, model) -> str:
    """Replace a message with a copy of another of the same type elsewhere in the model."""
    msgs = _messages(model, [])
    by_type: dict = {}
    for m in msgs:
        by_type.setdefault(type(m).__name__, []).append(m)
    kinds = [k for k, v in by_type.items() if len(v) > 1 and k != "ModelProto"]
    if not kinds:
        return "no-op"
    kind = rng.choice(kinds)
    dst, src = rng.sample(by_type[kind], 2)
    copy = type(src)()
    try:
        copy.CopyFrom(src)
        dst.CopyFrom(copy)
    except Exception:  # noqa: BLE001 - upb refuses a copy nested past its depth limit
        return "no-op"
    return f"{kind}: replaced by a copy of another"


def mutate_clear(rng: random.Random, model) -> str:
    """Clear one set field (a required-in-practice field missing: a graph, a type, a tensor's data)."""
    msgs = _messages(model, [])
    for _ in range(20):
        msg = rng.choice(msgs)
        fields = msg.ListFields()
        if fields:
            fd, _ = rng.choice(fields)
            msg.ClearField(fd.name)
            return f"{type(msg).__name__}.{fd.name} cleared"
    return "no-op"


MUTATORS = {"field": mutate_field, "repeated": mutate_repeated, "transplant": mutate_transplant,
            "clear": mutate_clear}


@dataclass
class Case:
    seed_name: str
    index: int
    notes: list
    data: bytes


def make_case(seeds: dict, seed: int, index: int) -> Case:
    rng = random.Random(f"{seed}:{index}")
    name = rng.choice(sorted(seeds))
    model = onnx.ModelProto()
    model.CopyFrom(seeds[name])
    notes = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choice(sorted(MUTATORS))
        notes.append(f"{kind}: {MUTATORS[kind](rng, model)}")
    try:
        data = model.SerializeToString()
    except Exception as e:  # noqa: BLE001 - e.g. a message made unserializable: judge the original
        notes.append(f"serialize failed ({type(e).__name__}); seed bytes used")
        data = seeds[name].SerializeToString()
    if rng.random() < 0.1:
        buf = bytearray(data)
        if buf and rng.random() < 0.5:
            for _ in range(rng.randrange(1, 4)):
                buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
            notes.append("bytes flipped")
        else:
            buf = buf[: rng.randrange(len(buf) + 1)]
            notes.append(f"cut to {len(buf)} bytes")
        data = bytes(buf)
    return Case(name, index, notes, data)


# --------------------------------------------------------------------------- the oracle
@dataclass
class Result:
    outcome: str  # "imported", "refused" (a kiln error), "crash", "slow", "memory"
    detail: str
    seconds: float
    peak: int = 0


def check(data: bytes, folder: Path, *, measure_memory: bool = False) -> Result:
    """Import ``data`` (external data read from ``folder``); save and reload what imports."""
    from kiln.serializer.onnx_import import import_onnx
    from kiln.serializer.reader import load_graph_from_bytes
    from kiln.serializer.writer import save

    if measure_memory:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        try:
            graph = import_onnx(bytes(data), base_dir=folder)
            out = folder / "roundtrip.kiln"
            try:
                save(graph, out)
            except KilnError as e:
                return _timed(Result("refused", f"save: {type(e).__name__}: {e}", 0.0), start)
            load_graph_from_bytes(out.read_bytes())
            return _timed(Result("imported", f"{len(graph.nodes)} nodes", 0.0), start)
        except KilnError as e:
            return _timed(Result("refused", f"{type(e).__name__}: {e}", 0.0), start)
        except BaseException as e:  # noqa: BLE001 - the failure being looked for
            if isinstance(e, KeyboardInterrupt):
                raise
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
            return _timed(Result("crash", f"{type(e).__name__}: {e}\n{tb}", 0.0), start)
    finally:
        if measure_memory:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            _LAST_PEAK[0] = peak


_LAST_PEAK = [0]


def _timed(r: Result, start: float) -> Result:
    r.seconds = time.perf_counter() - start
    return r


def judge(r: Result, measured: bool) -> Result:
    if r.outcome in ("imported", "refused"):
        if r.seconds > TIME_LIMIT_S:
            return Result("slow", f"{r.seconds:.2f} s > {TIME_LIMIT_S} s ({r.detail[:200]})", r.seconds)
        if measured:
            r.peak = _LAST_PEAK[0]
            if r.peak > MEMORY_LIMIT_BYTES:
                return Result("memory", f"peak {r.peak:,} bytes > {MEMORY_LIMIT_BYTES:,} ({r.detail[:200]})",
                              r.seconds, r.peak)
    return r


def prepare_folder(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / EXTERNAL_FILE).write_bytes(_EXTERNAL_BYTES)
    return folder


def run(iterations: int, seed: int, *, seconds: Optional[float] = None, first: int = 0,
        out: Optional[Path] = None, memory_every: int = 25, log=print) -> Counter:
    """Run cases ``first..first+iterations`` of ``seed``; returns outcome counts (crash/slow/memory
    cases are saved under ``out`` as .onnx files with a .txt of what happened)."""
    seeds = seed_models()
    counts: Counter = Counter()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-onnx-fuzz-") as tmp:
        folder = prepare_folder(Path(tmp))
        for index in range(first, first + iterations):
            if seconds is not None and time.perf_counter() - start > seconds:
                break
            case = make_case(seeds, seed, index)
            measured = memory_every > 0 and index % memory_every == 0
            r = judge(check(case.data, folder, measure_memory=measured), measured)
            counts[r.outcome] += 1
            if r.outcome not in ("imported", "refused"):
                log(f"case {index} ({case.seed_name}; {'; '.join(case.notes)}): {r.outcome}: {r.detail}")
                if out is not None:
                    out.mkdir(parents=True, exist_ok=True)
                    (out / f"case-{seed}-{index}.onnx").write_bytes(case.data)
                    (out / f"case-{seed}-{index}.txt").write_text(
                        f"{case.seed_name}\n{chr(10).join(case.notes)}\n{r.outcome}\n{r.detail}\n")
            if (index - first + 1) % 1000 == 0:
                log(f"{index - first + 1} cases in {time.perf_counter() - start:.0f} s: {dict(counts)}")
    return counts


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.serializer.onnx_fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=20000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--first", type=int, default=0, help="first case index (replay case i with --first i --iterations 1)")
    p.add_argument("--seconds", type=float, help="stop after this long")
    p.add_argument("--out", type=Path, help="folder to save failing cases into")
    args = p.parse_args(argv)
    start = time.perf_counter()
    counts = run(args.iterations, args.seed, seconds=args.seconds, first=args.first, out=args.out)
    bad = sum(v for k, v in counts.items() if k not in ("imported", "refused"))
    print(f"{sum(counts.values())} cases in {time.perf_counter() - start:.0f} s: {dict(counts)}; "
          f"{bad} failures (non-kiln exception, slow or too much memory)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
