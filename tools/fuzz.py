"""Fuzzing the .kiln loader: mutators, an oracle and the long-run CLI (seeds: fuzz_seeds.py).

Every mutated file must either load as a graph that verifies and prints, or raise FormatError,
within a second and without a large allocation. Most mutators rewrite the header checksums after
mutating, because a file rejected by a CRC never reaches the FlatBuffer reader or the decoder,
which is where the bugs would be. Cases are reproducible: case ``i`` of seed ``s`` is made by
``random.Random(f"{s}:{i}")``, so a failure found after hours is replayed with ``--first i``.

    python -m kiln.tools.fuzz --iterations 200000 --seed 1 [--seconds 600] [--out fuzz-failures]
"""
from __future__ import annotations

import argparse
import random
import signal
import struct
import sys
import threading
import time
import tracemalloc
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import kiln
from kiln.ir.registry import all_op_names
from kiln.serializer.format import HEADER_SIZE
from kiln.tools.fuzz_seeds import Seed, build_corpus

# The header layout of serializer/format.py, crc excluded (test_fuzz checks the two agree).
_HEADER = struct.Struct("<8sIIQQQQIII")
_FIELDS = {"version": 1, "header_size": 2, "fb_offset": 3, "fb_size": 4, "data_offset": 5, "data_size": 6,
           "fb_crc": 7, "data_crc": 8, "flags": 9}

TIME_LIMIT_S = 1.0
MEMORY_LIMIT_BYTES = 50 << 20
HANG_ALARM_S = 10.0  # a load still running after this is stopped and reported as a hang


# --------------------------------------------------------------------------- checksums

def fix_checksums(buf: bytearray) -> bytearray:
    """Rewrite the FlatBuffer, data and header CRCs of ``buf`` (in place) for whatever its header
    fields now say, so that a mutation is judged by the structural checks, not by a CRC."""
    if len(buf) < HEADER_SIZE:
        return buf
    fields = list(_HEADER.unpack_from(buf))
    fb_off, fb_size, d_off, d_size = fields[3:7]
    fields[7] = zlib.crc32(buf[fb_off:fb_off + fb_size])
    fields[8] = zlib.crc32(buf[d_off:d_off + d_size])
    body = _HEADER.pack(*fields)
    buf[:HEADER_SIZE] = body + struct.pack("<I", zlib.crc32(body))
    return buf


def checksums_valid(buf: bytes) -> bool:
    """Whether all three CRCs of ``buf`` match (the case then reaches the structural checks)."""
    if len(buf) < HEADER_SIZE:
        return False
    return fix_checksums(bytearray(buf[:])) == buf


# --------------------------------------------------------------------------- mutators
# Each takes (rng, seed, corpus) and returns the mutated bytes and a note of what it did.

def _interesting(size: int, old: int, rng: random.Random) -> int:
    """A boundary value for a ``size``-byte integer field, returned as its unsigned bits."""
    bits = 8 * size
    choices = [0, 1, 2, -1, old + 1, old - 1, old + 4, old - 4, old * 2, 2 ** (bits - 1) - 1, -(2 ** (bits - 1)),
               2 ** (bits - 1) - 8, 1 << 31, 1 << 30, 4096, rng.randrange(64), rng.getrandbits(bits)]
    return rng.choice(choices) % (1 << bits)


def _put(buf: bytearray, pos: int, size: int, value: int) -> None:
    buf[pos:pos + size] = (value % (1 << 8 * size)).to_bytes(size, "little")


def _get(buf: bytes, pos: int, size: int) -> int:
    return int.from_bytes(buf[pos:pos + size], "little")


def _maybe_fix(rng: random.Random, buf: bytearray, what: str) -> tuple[bytearray, str]:
    if rng.random() < 0.5:
        return fix_checksums(buf), what + " (+crc)"
    return buf, what


def truncate(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Cut the file short: inside the header, the FlatBuffer, the padding or the data."""
    lo, hi = rng.choice([(0, HEADER_SIZE), (HEADER_SIZE, seed.fb_end), (seed.fb_end, len(seed.data))])
    n = rng.randrange(lo, max(hi, lo + 1))
    return bytearray(seed.data[:n]), f"truncate to {n} of {len(seed.data)} bytes"


def bitflip(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Flip 1-8 bits, mostly inside the header and FlatBuffer; fix the CRCs half the time."""
    buf = bytearray(seed.data)
    end = seed.fb_end if rng.random() < 0.8 else len(buf)
    bits = [rng.randrange(8 * end) for _ in range(rng.randint(1, 8))]
    for b in bits:
        buf[b // 8] ^= 1 << (b % 8)
    return _maybe_fix(rng, buf, f"flip bits {bits}")


def overwrite(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Overwrite 1, 2, 4 or 8 bytes of the header or FlatBuffer (aligned or not) with a boundary value."""
    buf = bytearray(seed.data)
    size = rng.choice([1, 2, 4, 8])
    pos = rng.randrange(seed.fb_end - size)
    if rng.random() < 0.5:
        pos -= pos % size
    value = _interesting(size, _get(buf, pos, size), rng)
    _put(buf, pos, size, value)
    return _maybe_fix(rng, buf, f"overwrite {size} bytes at {pos} with {value:#x}")


def splice(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """A prefix of one seed and a suffix of another, or a piece of another seed's FlatBuffer
    pasted over this one's (CRCs fixed)."""
    other = rng.choice(corpus)
    a, b = seed.data, other.data
    if rng.random() < 0.5:
        cut_a, cut_b = rng.randrange(len(a)), rng.randrange(len(b))
        return _maybe_fix(rng, bytearray(a[:cut_a] + b[cut_b:]), f"{seed.name}[:{cut_a}] + {other.name}[{cut_b}:]")
    buf = bytearray(a)
    n = rng.randint(4, 64)
    src = rng.randrange(HEADER_SIZE, max(other.fb_end - n, HEADER_SIZE + 1))
    dst = rng.randrange(HEADER_SIZE, max(seed.fb_end - n, HEADER_SIZE + 1))
    buf[dst:dst + n] = b[src:src + n]
    return fix_checksums(buf), f"paste {other.name}[{src}:{src + n}] at {dst} (+crc)"


def insert_delete(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Insert or delete a few bytes of the header or FlatBuffer (shifting all that follows)."""
    buf = bytearray(seed.data)
    pos = rng.randrange(seed.fb_end)
    n = rng.choice([1, 2, 4, 8, rng.randint(1, 64)])
    if rng.random() < 0.5:
        buf[pos:pos] = bytes(rng.getrandbits(8) for _ in range(n))
        return _maybe_fix(rng, buf, f"insert {n} bytes at {pos}")
    del buf[pos:pos + n]
    return _maybe_fix(rng, buf, f"delete {n} bytes at {pos}")


def header_field(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Set one header field to a boundary value (or shrink it), then fix the CRCs so that sizes,
    offsets, version and flags are judged on their own; a smaller data size also cuts the file."""
    buf = bytearray(seed.data)
    name = rng.choice(list(_FIELDS))
    fields = list(_HEADER.unpack_from(buf))
    i = _FIELDS[name]
    old = fields[i]
    size = 8 if 3 <= i <= 6 else 4
    new = rng.randrange(old) if old and rng.random() < 0.4 else _interesting(size, old, rng)
    fields[i] = new
    buf[:_HEADER.size] = _HEADER.pack(*fields)
    if name == "data_size" and new < old:
        del buf[fields[5] + new:]
    if name in ("fb_crc", "data_crc"):  # keep the bad CRC: only the header's own is fixed
        buf[_HEADER.size:HEADER_SIZE] = struct.pack("<I", zlib.crc32(bytes(buf[:_HEADER.size])))
        return buf, f"header {name} {old} -> {new} (+header crc)"
    return fix_checksums(buf), f"header {name} {old} -> {new} (+crc)"


def fb_field(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Set 1-3 integers the verifier or decoder reads (offsets, vtable entries, lengths, scalar
    fields, vector elements) to boundary values, then fix the CRCs."""
    buf = bytearray(seed.data)
    what = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        pos, size, kind = rng.choice(seed.sites)
        at = HEADER_SIZE + pos
        value = _interesting(size, _get(buf, at, size), rng)
        if kind == "vtable" and rng.random() < 0.5:
            value = 0  # the field is now absent: defaults, and missing required fields
        _put(buf, at, size, value)
        what.append(f"{kind}@{pos}={value:#x}")
    return fix_checksums(buf), f"fields {', '.join(what)} (+crc)"


def fb_retarget(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Point an offset at another object: mostly one of the same type (shared subtrees, a graph
    holding itself, a value defined twice), else anything (type confusion). CRCs fixed."""
    buf = bytearray(seed.data)
    pos, type_name = rng.choice(seed.offsets)
    same = seed.objects.get(type_name, [])
    if same and rng.random() < 0.7:
        target = rng.choice(same)
    else:
        target = rng.choice([p for group in seed.objects.values() for p in group] + [pos, 0])
    _put(buf, HEADER_SIZE + pos, 4, target - pos)
    return fix_checksums(buf), f"offset@{pos} ({type_name}) -> {target} (+crc)"


def fb_string(rng: random.Random, seed: Seed, corpus: list) -> tuple[bytearray, str]:
    """Rename: an op becomes another registered op of the same length, a string copies another
    of its length (names collide), or one byte goes bad (invalid UTF-8, NUL). CRCs fixed."""
    buf = bytearray(seed.data)
    pos, n, fld = rng.choice([s for s in seed.strings if s[1]])
    at = HEADER_SIZE + pos
    ops = [name for name in all_op_names() if len(name) == n]
    same = [p for p, m, _f in seed.strings if m == n and p != pos]
    roll = rng.random()
    if fld == "Node.op" and ops and roll < 0.6:
        buf[at:at + n] = rng.choice(ops).encode()
    elif same and roll < 0.8:
        buf[at:at + n] = buf[HEADER_SIZE + rng.choice(same):][:n]
    else:
        buf[at + rng.randrange(n)] = rng.choice([0x00, 0xFF, 0xC3, 0x80, ord("x"), rng.getrandbits(8)])
    return fix_checksums(buf), f"{fld}@{pos} {seed.data[at:at + n]!r} -> {bytes(buf[at:at + n])!r} (+crc)"


Mutator = Callable[[random.Random, Seed, list], tuple[bytearray, str]]
MUTATORS: dict[str, Mutator] = {
    "truncate": truncate, "bitflip": bitflip, "overwrite": overwrite, "splice": splice,
    "insert_delete": insert_delete, "header_field": header_field, "fb_field": fb_field,
    "fb_retarget": fb_retarget, "fb_string": fb_string}


# --------------------------------------------------------------------------- cases and the oracle

@dataclass
class Case:
    index: int
    mutator: str
    seed: str
    what: str
    data: bytes


@dataclass
class Result:
    outcome: str                     # "loaded", "rejected" (FormatError) or "failed"
    seconds: float
    error: str = ""                  # the FormatError message, or the failure's traceback
    peak_bytes: Optional[int] = None  # tracemalloc peak, when measured


def make_case(corpus: list[Seed], seed: int, index: int, mutator: Optional[str] = None) -> Case:
    """Case ``index`` of run ``seed``: the same arguments always give the same bytes."""
    rng = random.Random(f"{seed}:{index}")
    name = mutator or rng.choice(list(MUTATORS))
    base = rng.choice(corpus)
    data, what = MUTATORS[name](rng, base, corpus)
    return Case(index, name, base.name, what, bytes(data))


class _Hang(Exception):
    pass


def _alarm(signum, frame) -> None:
    raise _Hang(f"load still running after {HANG_ALARM_S} s")


def check(data: bytes, *, measure_memory: bool = False) -> Result:
    """The oracle: load ``data``; a graph must verify and print, an error must be FormatError,
    and the load must end within TIME_LIMIT_S (and allocate under MEMORY_LIMIT_BYTES)."""
    if measure_memory:
        tracemalloc.start()
    # SIGALRM turns a hang into a reported failure; signals work only in the main thread.
    guard = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if guard:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, HANG_ALARM_S)
    start = time.perf_counter()
    try:
        result = _load_and_check(data)
    finally:
        if guard:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    result.seconds = time.perf_counter() - start
    if measure_memory:
        result.peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return _apply_limits(result)


def _load_and_check(data: bytes) -> Result:
    try:
        graph = kiln.load_graph_from_bytes(data)
    except kiln.FormatError as e:
        if not str(e).strip():
            return Result("failed", 0.0, "FormatError without a message:\n" + traceback.format_exc())
        return Result("rejected", 0.0, str(e))
    except Exception:  # noqa: BLE001  (anything but FormatError is the bug being hunted)
        return Result("failed", 0.0, "load raised:\n" + traceback.format_exc())
    try:
        kiln.verify(graph)
        str(graph)
    except Exception:  # noqa: BLE001
        return Result("failed", 0.0, "the loaded graph is broken:\n" + traceback.format_exc())
    return Result("loaded", 0.0)


def _apply_limits(result: Result) -> Result:
    if result.outcome != "failed" and result.seconds > TIME_LIMIT_S:
        return Result("failed", result.seconds, f"load took {result.seconds:.3f} s (limit {TIME_LIMIT_S} s)",
                      result.peak_bytes)
    if result.outcome != "failed" and (result.peak_bytes or 0) > MEMORY_LIMIT_BYTES:
        return Result("failed", result.seconds, f"load allocated {result.peak_bytes >> 20} MiB at peak "
                      f"(limit {MEMORY_LIMIT_BYTES >> 20} MiB)", result.peak_bytes)
    return result


# --------------------------------------------------------------------------- the long run

# Which check stopped a rejected file, by its message: shows how deep the mutations reach.
_STAGES = (("checksum", ("checksum mismatch", "is corrupt: ")), ("structure", ("corrupt model structure",)),
           ("graph", ("the file holds an invalid graph",)),
           ("header", ("not a .kiln file", "bad magic", "bad header", "file is truncated", "file header version")))


def stage(result: Result) -> str:
    """``loaded``, ``failed``, or the check that rejected the file: header, checksum, structure
    (FlatBuffer reader, fbread), decoder (values, types, data ranges, ops) or graph (IR verifier)."""
    if result.outcome != "rejected":
        return result.outcome
    for name, prefixes in _STAGES:
        if any(p in result.error for p in prefixes):
            return name
    return "decoder"


@dataclass
class Stats:
    cases: int = 0
    stages: dict = field(default_factory=dict)
    by_mutator: dict = field(default_factory=dict)
    valid_crc: int = 0
    total_s: float = 0.0
    slowest: tuple = (0.0, "")
    peak_bytes: int = 0
    failures: list = field(default_factory=list)

    def add(self, case: Case, result: Result) -> None:
        self.cases += 1
        where = stage(result)
        self.stages[where] = self.stages.get(where, 0) + 1
        counts = self.by_mutator.setdefault(case.mutator, {})
        counts[where] = counts.get(where, 0) + 1
        self.valid_crc += checksums_valid(case.data)
        self.total_s += result.seconds
        self.slowest = max(self.slowest, (result.seconds, f"case {case.index} ({case.mutator})"))
        self.peak_bytes = max(self.peak_bytes, result.peak_bytes or 0)
        if result.outcome == "failed":
            self.failures.append((case, result))

    def line(self, elapsed: float) -> str:
        return (f"{self.cases} cases in {elapsed:.0f} s ({self.cases / max(elapsed, 1e-9):.0f}/s), "
                f"{len(self.failures)} failed, {self.valid_crc} with valid CRCs; mean load "
                f"{1000 * self.total_s / max(self.cases, 1):.2f} ms, slowest {1000 * self.slowest[0]:.1f} ms "
                f"({self.slowest[1]}), peak allocation {self.peak_bytes >> 10} KiB (sampled)")

    def table(self) -> str:
        rows = [f"  {name:14s} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
                for name, c in sorted(self.by_mutator.items())]
        return "\n".join(["outcome by mutator (loaded, or the check that rejected the file):"] + rows)


def save_failure(case: Case, result: Result, folder: Path) -> Path:
    """Write the failing input and a note (mutation, traceback) to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"case-{case.index}-{case.mutator}-{case.seed}"
    stem.with_suffix(".kiln").write_bytes(case.data)
    stem.with_suffix(".txt").write_text(f"case {case.index}: {case.mutator} on seed {case.seed}: {case.what}\n\n"
                                        f"{result.error}\n")
    return stem.with_suffix(".kiln")


def run(iterations: int, seed: int, *, seconds: Optional[float] = None, first: int = 0,
        out: Path = Path("fuzz-failures"), memory_every: int = 100, progress_s: float = 10.0) -> Stats:
    """Run cases ``first .. first + iterations`` (or until ``seconds`` pass), printing progress."""
    corpus = build_corpus()
    stats = Stats()
    start = last = time.perf_counter()
    for index in range(first, first + iterations):
        case = make_case(corpus, seed, index)
        result = check(case.data, measure_memory=memory_every > 0 and index % memory_every == 0)
        stats.add(case, result)
        if result.outcome == "failed":
            path = save_failure(case, result, out)
            print(f"FAIL case {index} ({case.mutator} on {case.seed}: {case.what}) -> {path}\n{result.error}",
                  flush=True)
        now = time.perf_counter()
        if now - last >= progress_s:
            print(stats.line(now - start), flush=True)
            last = now
        if seconds is not None and now - start >= seconds:
            break
    print("done:", stats.line(time.perf_counter() - start))
    print(stats.table(), flush=True)
    return stats


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.tools.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=100_000, help="number of mutated files to load")
    p.add_argument("--seed", type=int, default=0, help="run seed (case i of seed s is always the same bytes)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.add_argument("--first", type=int, default=0, help="index of the first case (replay one with --iterations 1)")
    p.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="folder for failing inputs")
    p.add_argument("--memory-every", type=int, default=100, help="measure allocations on every n-th case (0: never)")
    args = p.parse_args(argv)
    stats = run(args.iterations, args.seed, seconds=args.seconds, first=args.first, out=args.out,
                memory_every=args.memory_every)
    if stats.failures:
        print(f"{len(stats.failures)} failing inputs saved in {args.out}/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
