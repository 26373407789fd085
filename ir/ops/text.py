"""``TfIdfVectorizer`` (ai.onnx 9): n-gram counts of integer token sequences, optionally weighted.

X is [C] or [N, C] int32/int64 tokens; Y is float32 [max(ngram_indexes) + 1] or [N, max(ngram_indexes) + 1].
The pool (``pool_int64s``) lists the n-grams to count, grouped by size: the 1-grams from ``ngram_counts[0]``,
the 2-grams from ``ngram_counts[1]`` and so on, each group running to the next start (the last to the end of
the pool). Only sizes in [min_gram_length, max_gram_length] are counted. An n-gram of size n > 1 is matched at
every start position with every token distance d in 1..max_skip_count + 1 (tokens ``start, start + d, ...,
start + (n-1) d``); a 1-gram is counted once per position.

The i-th n-gram of the pool has the value count_i (``mode`` TF), weights[i] where count_i > 0, else 0 (IDF), or
weights[i] * count_i (TFIDF), weights defaulting to 1, and adds it to column ``ngram_indexes[i]`` of Y; columns
no n-gram maps to are 0. Weights belong to n-grams, as the spec says and ONNX Runtime does (ONNX's reference
evaluator reads them by output column, the same thing only where ngram_indexes is 0, 1, 2, ...).

Refused by name, where ONNX leaves the answer undefined and runtimes differ: an n-gram listed twice in the pool
(ONNX Runtime refuses it, ONNX's reference evaluator counts it in the column of its last entry), and two n-grams
sharing a column in IDF mode (ONNX Runtime keeps the weight of one of them). String tokens (``pool_strings``,
string X) are not supported: kiln has no string tensors.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from kiln.ir.dtypes import DType
from kiln.ir.ops._common import INDEX
from kiln.ir.registry import REQUIRED, Attr, AttrKind, In, InferContext, op
from kiln.ir.types import TensorType

_MODES = ("TF", "IDF", "TFIDF")


def _check_attrs(mode: str, ngram_indexes: Sequence[int], ngram_counts: Sequence[int],
                 pool: Optional[Sequence[int]], weights: Optional[Sequence[float]], min_gram: int, max_gram: int,
                 max_skip: int) -> Optional[str]:
    """What is wrong with the attributes, or None."""
    if mode not in _MODES:
        return f"mode must be one of {', '.join(_MODES)}, not {mode!r}"
    if pool is None:
        return "pool_int64s is required (kiln has no string tensors, so pool_strings is not supported)"
    if not 1 <= min_gram <= max_gram:
        return f"need 1 <= min_gram_length <= max_gram_length, got {min_gram} and {max_gram}"
    if max_skip < 0:
        return f"max_skip_count must be >= 0, got {max_skip}"
    counts = list(ngram_counts)
    if not counts or any(not 0 <= c <= len(pool) for c in counts) or counts != sorted(counts):
        return (f"ngram_counts {counts} must be non-decreasing starts of each n-gram size in the pool "
                f"(0 .. {len(pool)})")
    total = 0
    for i, start in enumerate(counts):
        end = counts[i + 1] if i + 1 < len(counts) else len(pool)
        if (end - start) % (i + 1):
            return (f"the pool's {i + 1}-grams (from position {start}) hold {end - start} tokens, not whole "
                    f"{i + 1}-grams")
        grams = np.asarray(pool[start:end], np.int64).reshape(-1, i + 1)
        if len(np.unique(grams, axis=0)) < len(grams):
            return (f"the pool lists a {i + 1}-gram twice; its column is undefined (ONNX Runtime refuses such a "
                    f"pool)")
        total += len(grams)
    if len(ngram_indexes) != total:
        return f"ngram_indexes has {len(ngram_indexes)} entries, but the pool holds {total} n-grams (one each)"
    if not len(ngram_indexes) or min(ngram_indexes) < 0:
        return f"ngram_indexes {list(ngram_indexes)} must be one or more columns >= 0"
    if weights is not None and len(weights) and len(weights) != total:
        return f"weights has {len(weights)} entries; it needs one per n-gram of the pool, {total}"
    if mode == "IDF" and len(set(ngram_indexes)) < len(ngram_indexes):
        return ("in IDF mode n-grams may not share an output column (ngram_indexes repeats one): ONNX leaves that "
                "undefined and runtimes differ")
    return None


def _infer_tfidf(ctx: InferContext) -> TensorType:
    x = ctx.input(0)
    a = ctx.attrs
    problem = _check_attrs(a["mode"], a["ngram_indexes"], a["ngram_counts"], a["pool_int64s"], a["weights"],
                           a["min_gram_length"], a["max_gram_length"], a["max_skip_count"])
    if problem:
        ctx.fail(problem)
    size = max(a["ngram_indexes"]) + 1
    if x.shape is None:
        return TensorType(DType.FLOAT32, None)
    if len(x.shape) not in (1, 2):
        ctx.fail(f"X must be [C] or [N, C] tokens, got shape {list(x.shape)}")
    return TensorType(DType.FLOAT32, (size,) if len(x.shape) == 1 else (x.shape[0], size))


def _pool_grams(ngram_counts, pool, min_gram: int, max_gram: int) -> list:
    """[(n, tuples [m, n] int64, their indices in the pool's list of n-grams [m])] for each counted size n."""
    pool = np.asarray(pool, np.int64)
    out, first_id = [], 0
    for i, start in enumerate(ngram_counts):
        n = i + 1
        end = ngram_counts[i + 1] if i + 1 < len(ngram_counts) else len(pool)
        m = (end - start) // n
        if m and min_gram <= n <= max_gram:
            out.append((n, pool[start:end].reshape(m, n), np.arange(first_id, first_id + m)))
        first_id += m
    return out


def _match(windows: np.ndarray, tuples: np.ndarray) -> np.ndarray:
    """For each row of ``windows`` [k, n], the row of the distinct ``tuples`` [m, n] equal to it, or -1."""
    _, classes = np.unique(np.concatenate([tuples, windows]), axis=0, return_inverse=True)
    classes = classes.reshape(-1)
    table = np.full(int(classes.max()) + 1, -1, np.int64)
    table[classes[:len(tuples)]] = np.arange(len(tuples))
    return table[classes[len(tuples):]]


@op("TfIdfVectorizer", inputs=[In("X", INDEX, rank=(1, 2))], outputs=["Y"],
    attrs=[Attr("mode", AttrKind.STRING, REQUIRED), Attr("ngram_indexes", AttrKind.INTS, REQUIRED),
           Attr("ngram_counts", AttrKind.INTS, REQUIRED), Attr("max_skip_count", AttrKind.INT, REQUIRED),
           Attr("min_gram_length", AttrKind.INT, REQUIRED), Attr("max_gram_length", AttrKind.INT, REQUIRED),
           Attr("pool_int64s", AttrKind.INTS, None), Attr("weights", AttrKind.FLOATS, None)],
    infer=_infer_tfidf)
def tfidf_vectorizer(x, *, mode, ngram_indexes, ngram_counts, max_skip_count, min_gram_length, max_gram_length,
                     pool_int64s=None, weights=None):
    """Y: the weighted n-gram counts of each row of X (module docstring)."""
    problem = _check_attrs(mode, ngram_indexes, ngram_counts, pool_int64s, weights, min_gram_length,
                           max_gram_length, max_skip_count)
    if problem:
        raise ValueError(f"TfIdfVectorizer: {problem}")
    if x.ndim not in (1, 2):
        raise ValueError(f"TfIdfVectorizer: X must be [C] or [N, C], got shape {list(x.shape)}")
    rows = np.asarray(x, np.int64).reshape(x.shape if x.ndim == 2 else (1, -1))
    batch, length = rows.shape
    counts = np.zeros((batch, len(ngram_indexes)), np.int64)  # per n-gram of the pool
    for n, tuples, ids in _pool_grams(ngram_counts, pool_int64s, min_gram_length, max_gram_length):
        for skip in range(1, (max_skip_count + 1 if n > 1 else 1) + 1):
            starts = length - (n - 1) * skip  # positions a window of n tokens, skip apart, can start at
            if starts <= 0:
                break
            windows = np.stack([rows[:, k * skip:k * skip + starts] for k in range(n)], axis=-1).reshape(-1, n)
            found = _match(windows, tuples)
            hit = found >= 0
            np.add.at(counts, (np.repeat(np.arange(batch), starts)[hit], ids[found[hit]]), 1)
    w = np.asarray(weights if weights is not None and len(weights) else np.ones(len(ngram_indexes)), np.float64)
    if mode == "TF":
        values = counts.astype(np.float64)
    elif mode == "IDF":
        values = np.where(counts > 0, w, 0.0)
    else:
        values = counts * w
    y = np.zeros((batch, max(ngram_indexes) + 1), np.float64)
    np.add.at(y.T, np.asarray(ngram_indexes, np.int64), values.T)  # n-grams sharing a column add up
    y = y.astype(np.float32)
    return y if x.ndim == 2 else y[0]
