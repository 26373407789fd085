"""``LinearAttention`` (ai.onnx 27) and ``TensorScatter`` (ai.onnx 24): the recurrent-state attention of linear
transformers and the KV-cache write that goes with attention decoding.

LinearAttention. query [B, T, Hq*dk], key [B, T, Hkv*dk], value [B, T, Hkv*dv] (heads packed in the last dim),
an optional past_state [B, Hkv, dk, dv] (its own float type S), decay [B, T, Hkv] (one log-space decay per head)
or [B, T, Hkv*dk] (one per key dim), beta [B, T, Hkv] or [B, T, 1]. Per head and token, with S the state::

    linear:       S = S + k ⊗ v
    gated:        S = exp(g) * S + k ⊗ v
    delta:        S = S + k ⊗ β (v - Sᵀk)
    gated_delta:  S = exp(g) * S + k ⊗ β (v - (exp(g) S)ᵀ k)
    o = scale * qᵀ S        (scale 0: 1/sqrt(dk))

decay is given iff the rule gates, beta iff it has the delta correction. Grouped-query attention: query head h
reads the state of KV head h // (Hq / Hkv). Outputs: output [B, T, Hq*dv] in the query's type and present_state,
the final state, in past_state's type (the query's without one). ``chunk_size`` is a tuning hint of chunked
implementations and changes nothing. As ONNX's reference evaluator, every type computes in float32 (the state
is carried in float32), and the default scale multiplies in float64 before the float32 rounding (an explicit
one in float32). The recurrence is sequential in T; each step is vectorized over batch, heads and head dims.

TensorScatter. past_cache [B, D1.., M, ..Dn] (M, the max sequence length, on ``axis``, which may not be 0, the
batch), update with the same shape except S <= M on ``axis``, write_indices [B] (int64, zeros when omitted):
present_cache is past_cache with update[b, .., s, ..] written at position write_indices[b] + s of the axis,
modulo M in ``circular`` mode. In ``linear`` mode every write must fall inside the cache (0 <= write index and
write index + S <= M); the kernel refuses one that does not, where ONNX's reference would wrap a negative index.
"""
from __future__ import annotations

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import ALL, compute_dtype
from kiln.ir.registry import Attr, AttrKind, In, InferContext, Out, op, REQUIRED
from kiln.ir.types import TensorType, merge_dim, normalize_axis

# LinearAttention's T and S: ONNX's type constraints (no float64).
_LA_TYPES = frozenset({DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32})
# update rule -> (gates with decay, delta correction with beta)
UPDATE_RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True),
                "gated_delta": (True, True)}
SCATTER_MODES = ("linear", "circular")


def _known(d) -> bool:
    return isinstance(d, int)


def _same_dim(ctx: InferContext, dims: list, what: str):
    """The merged dim of several (name, dim) that must be equal."""
    out = None
    for name, d in dims:
        if _known(out) and _known(d) and out != d:
            ctx.fail(f"{what} differs: " + ", ".join(f"{n} has {x}" for n, x in dims if x is not None))
        out = merge_dim(out, d)
    return out


def _per_head(ctx: InferContext, name: str, size, heads: int):
    """size / heads where size is a known int (it must divide), else None."""
    if not _known(size):
        return None
    if size % heads:
        ctx.fail(f"{name}'s last dim {size} is not a multiple of its {heads} heads")
    return size // heads


def _infer_linear_attention(ctx: InferContext):
    a = ctx.attrs
    rule = a["update_rule"]
    if rule not in UPDATE_RULES:
        ctx.fail(f"update_rule must be one of {', '.join(UPDATE_RULES)}, not {rule!r}")
    hq, hkv = a["q_num_heads"], a["kv_num_heads"]
    if hq <= 0 or hkv <= 0 or hq % hkv:
        ctx.fail(f"q_num_heads ({hq}) must be a positive multiple of kv_num_heads ({hkv})")
    gated, delta = UPDATE_RULES[rule]
    for i, name, wanted, rules in ((4, "decay", gated, "gated, gated_delta"), (5, "beta", delta, "delta, gated_delta")):
        if wanted != ctx.has_input(i):
            ctx.fail(f"update_rule {rule!r} {'needs' if wanted else 'takes no'} {name} input (the rules that take "
                     f"it: {rules})")
    q = ctx.input(0)
    named = [(0, "query"), (1, "key"), (2, "value"), (4, "decay"), (5, "beta")]
    given = [(i, n, ctx.input(i)) for i, n in named if ctx.has_input(i)]
    for i, name, t in given[1:]:
        if t.dtype is not q.dtype:
            ctx.fail(f"{name} is {t.dtype} but query is {q.dtype}; they share one type")
    for _, name, t in given:
        if t.shape is not None and len(t.shape) != 3:
            ctx.fail(f"{name} must be 3-D [batch, seq, heads*dim], not {list(t.shape)}")
    state_dt = ctx.input(3).dtype if ctx.has_input(3) else q.dtype
    shapes = {name: t.shape for _, name, t in given if t.shape is not None}
    past = ctx.input(3).shape if ctx.has_input(3) else None
    if past is not None and len(past) != 4:
        ctx.fail(f"past_state must be 4-D [batch, kv_num_heads, dk, dv], not {list(past)}")
    batch = _same_dim(ctx, [(n, s[0]) for n, s in shapes.items()] + ([("past_state", past[0])] if past else []),
                      "the batch size")
    seq = _same_dim(ctx, [(n, s[1]) for n, s in shapes.items()], "the sequence length")
    dk = _per_head(ctx, "query", shapes["query"][2], hq) if "query" in shapes else None
    k_dk = _per_head(ctx, "key", shapes["key"][2], hkv) if "key" in shapes else None
    if _known(dk) and _known(k_dk) and dk != k_dk:
        ctx.fail(f"query's head size is {dk} ({shapes['query'][2]} / {hq} heads) but key's is {k_dk} "
                 f"({shapes['key'][2]} / {hkv} heads)")
    dk = merge_dim(dk, k_dk)
    dv = _per_head(ctx, "value", shapes["value"][2], hkv) if "value" in shapes else None
    if "decay" in shapes and _known(shapes["decay"][2]):
        last = shapes["decay"][2]
        if last != hkv and not (_known(dk) and last == hkv * dk):
            ctx.fail(f"decay's last dim must be kv_num_heads ({hkv}, one decay per head) or kv_num_heads*dk "
                     f"({hkv * dk if _known(dk) else '?'}, one per key dim), not {last}")
    if "beta" in shapes and _known(shapes["beta"][2]) and shapes["beta"][2] not in (hkv, 1):
        ctx.fail(f"beta's last dim must be kv_num_heads ({hkv}) or 1, not {shapes['beta'][2]}")
    if past is not None:
        for axis, (want, what) in enumerate(((batch, "batch size"), (hkv, "kv_num_heads"), (dk, "dk"),
                                             (dv, "dv"))):
            if _known(want) and _known(past[axis]) and past[axis] != want:
                ctx.fail(f"past_state has shape {list(past)}: dim {axis} must be the {what} {want}, not {past[axis]}")
        dk, dv = merge_dim(dk, past[2]), merge_dim(dv, past[3])
    out_last = hq * dv if _known(dv) else None
    return [TensorType(q.dtype, (batch, seq, out_last)), TensorType(state_dt, (batch, hkv, dk, dv))]


def _run_shapes(query, key, value, past_state, decay, beta, hq: int, hkv: int) -> tuple:
    """(B, T, dk, dv) of the inputs, checked at run time (where inference saw symbols) as ONNX's reference does."""
    b, t, q_last = query.shape
    if q_last % hq or value.shape[2] % hkv:
        raise ValueError(f"LinearAttention: query's last dim {q_last} must divide into q_num_heads={hq} heads and "
                         f"value's {value.shape[2]} into kv_num_heads={hkv}")
    dk, dv = q_last // hq, value.shape[2] // hkv
    wanted = [("key", key, [(b, t, hkv * dk)]), ("value", value, [(b, t, hkv * dv)]),
              ("decay", decay, [(b, t, hkv), (b, t, hkv * dk)]), ("beta", beta, [(b, t, hkv), (b, t, 1)]),
              ("past_state", past_state, [(b, hkv, dk, dv)])]
    for name, x, shapes in wanted:
        if x is not None and x.shape not in shapes:
            raise ValueError(f"LinearAttention: {name} has shape {list(x.shape)}, for query {list(query.shape)} it "
                             f"must be " + " or ".join(str(list(s)) for s in shapes))
    return b, t, dk, dv


@op("LinearAttention",
    inputs=[In("query", _LA_TYPES, rank=3), In("key", _LA_TYPES, rank=3), In("value", _LA_TYPES, rank=3),
            In("past_state", _LA_TYPES, optional=True, rank=4), In("decay", _LA_TYPES, optional=True, rank=3),
            In("beta", _LA_TYPES, optional=True, rank=3)],
    outputs=[Out("output", _LA_TYPES), Out("present_state", _LA_TYPES)],
    attrs=[Attr("chunk_size", AttrKind.INT, 64), Attr("kv_num_heads", AttrKind.INT, REQUIRED),
           Attr("q_num_heads", AttrKind.INT, REQUIRED), Attr("scale", AttrKind.FLOAT, 0.0),
           Attr("update_rule", AttrKind.STRING, "gated_delta")],
    infer=_infer_linear_attention)
def linear_attention(query, key, value, past_state=None, decay=None, beta=None, *, chunk_size=64, kv_num_heads,
                     q_num_heads, scale=0.0, update_rule="gated_delta"):
    """Linear attention with a recurrent state (module docstring)."""
    gated, delta = UPDATE_RULES[update_rule]
    out_dt = query.dtype
    state_dt = out_dt if past_state is None else past_state.dtype
    acc = compute_dtype(out_dt)  # float32 for every LinearAttention type
    hq, hkv = q_num_heads, kv_num_heads
    group = hq // hkv
    b, t, dk, dv = _run_shapes(query, key, value, past_state, decay, beta, hq, hkv)
    q = query.astype(acc).reshape(b, t, hkv, group, dk)  # query head h = kv head h // group
    k = key.astype(acc).reshape(b, t, hkv, dk)
    v = value.astype(acc).reshape(b, t, hkv, dv)
    if gated:  # exp(g) per head or per key dim, broadcast over dv: [B, T, Hkv, 1 | dk, 1]
        factor = np.exp(decay.astype(acc).reshape(b, t, hkv, decay.shape[2] // hkv, 1))
    if delta:  # [B, T, Hkv | 1, 1]
        rate = beta.astype(acc).reshape(b, t, beta.shape[2], 1)
    state = np.zeros((b, hkv, dk, dv), acc) if past_state is None else past_state.astype(acc)
    reads = np.empty((b, t, hkv, group, dv), acc)
    for i in range(t):
        if gated:
            state = state * factor[:, i]
        ki, vi = k[:, i], v[:, i]
        if delta:
            retrieved = np.matmul(ki[:, :, None, :], state)[:, :, 0, :]  # Sᵀk: [B, Hkv, dv]
            vi = rate[:, i] * (vi - retrieved)
        state = state + ki[:, :, :, None] * vi[:, :, None, :]
        reads[:, i] = np.matmul(q[:, i], state)  # [B, Hkv, group, dk] @ [B, Hkv, dk, dv]
    if scale == 0.0:  # ONNX's reference: a float64 1/sqrt(dk) times the float32 read, rounded to float32
        with np.errstate(divide="ignore"):
            factor64 = 1.0 / np.sqrt(np.float64(dk))
        out = (reads * factor64).astype(acc)
    else:
        out = reads * acc.type(scale)
    return out.reshape(b, t, hq * dv).astype(out_dt), state.astype(state_dt)


def _infer_tensor_scatter(ctx: InferContext) -> TensorType:
    past, update = ctx.input(0), ctx.input(1)
    mode = ctx.attrs["mode"]
    if mode not in SCATTER_MODES:
        ctx.fail(f"mode must be one of {', '.join(SCATTER_MODES)}, not {mode!r}")
    if update.dtype is not past.dtype:
        ctx.fail(f"update is {update.dtype} but past_cache is {past.dtype}")
    if past.shape is None:
        return TensorType(past.dtype, None)
    rank = len(past.shape)
    try:
        axis = normalize_axis(ctx.attrs["axis"], rank)
    except ValueError as e:
        ctx.fail(str(e))
    if axis == 0:
        ctx.fail(f"axis {ctx.attrs['axis']} is the batch dimension (0); the sequence axis must be another")
    shape = list(past.shape)
    if update.shape is not None:
        if len(update.shape) != rank:
            ctx.fail(f"update has rank {len(update.shape)} ({list(update.shape)}) but past_cache has rank {rank} "
                     f"({list(past.shape)})")
        for d, (p, u) in enumerate(zip(past.shape, update.shape)):
            if d == axis:
                if _known(p) and _known(u) and u > p:
                    ctx.fail(f"update's sequence length {u} (axis {axis}) exceeds past_cache's {p}")
            elif _known(p) and _known(u) and p != u:
                ctx.fail(f"update has shape {list(update.shape)} and past_cache {list(past.shape)}: they may differ "
                         f"on axis {axis} only, not on {d}")
            else:
                shape[d] = merge_dim(p, u)
    if ctx.has_input(2):
        w = ctx.input(2).shape
        if w is not None:
            if len(w) != 1:
                ctx.fail(f"write_indices must be 1-D [batch], not {list(w)}")
            if _known(w[0]) and _known(shape[0]) and w[0] != shape[0]:
                ctx.fail(f"write_indices has {w[0]} entries for a batch of {shape[0]}")
            shape[0] = merge_dim(shape[0], w[0])
    return TensorType(past.dtype, tuple(shape))


@op("TensorScatter",
    inputs=[In("past_cache", ALL), In("update", ALL), In("write_indices", {DType.INT64}, optional=True, rank=1)],
    outputs=["present_cache"], attrs=[Attr("axis", AttrKind.INT, -2), Attr("mode", AttrKind.STRING, "linear")],
    infer=_infer_tensor_scatter)
def tensor_scatter(past_cache, update, write_indices=None, *, axis=-2, mode="linear"):
    """past_cache with update written along ``axis`` at each batch entry's write index (module docstring)."""
    axis = normalize_axis(axis, past_cache.ndim)
    if update.ndim != past_cache.ndim or any(u != p for d, (u, p) in enumerate(zip(update.shape, past_cache.shape))
                                             if d != axis) or update.shape[axis] > past_cache.shape[axis]:
        raise ValueError(f"TensorScatter: update {list(update.shape)} must match past_cache {list(past_cache.shape)} "
                         f"except on axis {axis}, where it may be shorter")
    present = past_cache.copy()
    batch, length, steps = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
    if write_indices is None:
        start = np.zeros(batch, np.int64)
    else:
        start = np.asarray(write_indices, np.int64).reshape(-1)
        if start.shape[0] != batch:
            raise ValueError(f"TensorScatter: write_indices has {start.shape[0]} entries for a batch of {batch}")
    if steps == 0 or present.size == 0:
        return present
    pos = start[:, None] + np.arange(steps)  # [B, S]
    if mode == "circular":
        pos = pos % length
    elif np.any(start < 0) or np.any(start + steps > length):
        bad = int(np.flatnonzero((start < 0) | (start + steps > length))[0])
        raise ValueError(f"TensorScatter (linear mode): batch entry {bad} writes {steps} positions from "
                         f"{int(start[bad])}, outside the {length} of axis {axis}")
    # The sequence axis moved next to the batch (a view of present): [B, M, ...] takes [B, S, ...].
    np.moveaxis(present, axis, 1)[np.arange(batch)[:, None], pos] = np.moveaxis(update, axis, 1)
    return present
