"""Checks of a packed file's mobile metadata, shared by ``kiln mobile bundle``, ``pack.read_arena`` and
the stub runtime (so it imports nothing but json and kiln.errors: it ships inside every bundle).

A packed file is untrusted input like any model file: its ``kiln.mobile.*`` metadata is JSON written
by ``kiln mobile pack``, and the stub allocates and slices memory from it. So before anything is
allocated:

- ``kiln.mobile.ops`` must be a JSON list of ``"Op:dtype"`` strings;
- ``kiln.mobile.arena`` must be ``{"size": int, "alignment": power of two, "values": {name: [offset,
  nbytes]}}`` with non-negative integers (not bools, not floats);
- the arena size is bounded by the plan: no more than the end of the last slot rounded up to the
  alignment (what the packer writes), and at most ``max_bytes``;
- every slot lies inside the arena at an aligned offset (``check_slots``), and no two values that
  are live at the same node share a byte (the liveness rule of pack.lifetimes: a value lives from the
  node that writes it to the last node that reads it, a graph output to the end).

Every failure is one ``FormatError`` line naming the field.
"""
from __future__ import annotations

import bisect
import json
from typing import Optional

from kiln.errors import FormatError

PROP_VERSION, PROP_OPS, PROP_ARENA = "kiln.mobile.version", "kiln.mobile.ops", "kiln.mobile.arena"
MOBILE_VERSION = "1"
# The largest arena the stub allocates unless its loader is told otherwise: a phone has a few GiB
# in all, and the arena is allocated on every start.
MAX_ARENA_BYTES = 1 << 30
MAX_ALIGNMENT = 1 << 16
_MAX_JSON = 64 << 20  # metadata bigger than this is not something pack writes


def _json(text, prop: str):
    if not isinstance(text, str):
        raise FormatError(f"metadata {prop} is missing")
    if len(text) > _MAX_JSON:
        raise FormatError(f"metadata {prop} is {len(text):,} characters long")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise FormatError(f"metadata {prop} is not valid JSON: {str(e)[:120] or type(e).__name__}") from None


def _int(x, what: str) -> int:
    if type(x) is not int or x < 0:
        raise FormatError(f"{what} must be a non-negative integer, got {json.dumps(x)[:40]}")
    return x


def parse_manifest(text) -> list:
    """The ``Op:dtype`` list of ``kiln.mobile.ops``."""
    ops = _json(text, PROP_OPS)
    if not isinstance(ops, list) or not all(isinstance(k, str) and ":" in k for k in ops):
        raise FormatError(f"metadata {PROP_OPS} must be a JSON list of \"Op:dtype\" strings")
    return ops


def parse_arena(text, max_bytes: Optional[int] = MAX_ARENA_BYTES) -> tuple:
    """``(size, alignment, {name: (offset, nbytes)})`` from ``kiln.mobile.arena``, each number checked,
    every slot inside the arena and the size bounded by the slots (see the module docstring)."""
    plan = _json(text, PROP_ARENA)
    if not isinstance(plan, dict) or not isinstance(plan.get("values"), dict):
        raise FormatError(f"metadata {PROP_ARENA} must be an object with size, alignment and values")
    size = _int(plan.get("size"), f"{PROP_ARENA} size")
    alignment = _int(plan.get("alignment"), f"{PROP_ARENA} alignment")
    if not 1 <= alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise FormatError(f"{PROP_ARENA} alignment {alignment} is not a power of two up to {MAX_ALIGNMENT}")
    values, end = {}, 0
    for name, slot in plan["values"].items():
        if not isinstance(slot, list) or len(slot) != 2:
            raise FormatError(f"{PROP_ARENA} slot of '{name[:80]}' must be [offset, nbytes]")
        offset = _int(slot[0], f"{PROP_ARENA} offset of '{name[:80]}'")
        nbytes = _int(slot[1], f"{PROP_ARENA} nbytes of '{name[:80]}'")
        if nbytes and offset % alignment:
            raise FormatError(f"{PROP_ARENA} slot of '{name[:80]}' at offset {offset} is not {alignment}-aligned")
        if offset + nbytes > size:
            raise FormatError(f"{PROP_ARENA} slot of '{name[:80]}' [{offset}, {offset + nbytes}) lies outside the "
                              f"{size:,}-byte arena")
        values[name] = (offset, nbytes)
        end = max(end, offset + nbytes)
    bound = (end + alignment - 1) // alignment * alignment
    if size > bound:
        raise FormatError(f"{PROP_ARENA} size {size:,} is more than its slots need ({bound:,} bytes)")
    if max_bytes is not None and size > max_bytes:
        raise FormatError(f"{PROP_ARENA} size {size:,} bytes is over the {max_bytes:,}-byte limit of this runtime "
                          f"(load(..., max_arena_bytes=) raises it)")
    return size, alignment, values


def check_overlaps(slots: list) -> None:
    """``slots``: ``(name, offset, nbytes, first, last)`` with the node range the value is live in
    (inclusive). Raise FormatError for two values live at the same node whose bytes overlap."""
    by_first = sorted((s for s in slots if s[2] > 0), key=lambda s: (s[3], s[1]))
    live_starts: list = []  # sorted offsets of the live slots (disjoint, so sorted by end too)
    live: list = []         # the slots, in the same order
    for name, offset, nbytes, first, last in by_first:
        # Expire values whose last use is before this value's first node.
        keep = [k for k, s in enumerate(live) if s[4] >= first]
        if len(keep) != len(live):
            live = [live[k] for k in keep]
            live_starts = [s[1] for s in live]
        k = bisect.bisect_left(live_starts, offset)
        for other in live[max(k - 1, 0):k + 1]:
            if other[1] < offset + nbytes and offset < other[1] + other[2]:
                raise FormatError(f"{PROP_ARENA}: '{name[:80]}' [{offset}, {offset + nbytes}) overlaps "
                                  f"'{other[0][:80]}' [{other[1]}, {other[1] + other[2]}) while both are live")
        live.insert(k, (name, offset, nbytes, first, last))
        live_starts.insert(k, offset)
