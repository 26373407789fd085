"""CUDA C source for elementwise bodies (a ``kiln.FusedElementwise`` body, or one elementwise
node), compiled with ``cupy.RawKernel`` and launched over broadcast operands.

Why generate code: a chain like ``x+1, *2, relu, -0.5, sigmoid`` run op by op reads and writes
the whole tensor five times; one generated kernel reads each input once and writes each output
once, so it runs at the memory-bandwidth floor. The same generator serves a single elementwise
node (a body of one op), so every elementwise op the runtime runs natively goes through this
module and the per-op conformance tests exercise every expression below.

Layout of a generated kernel (one thread per output element, grid-stride loop):

- Each operand (a body input, or a body constant of more than one element) is read in one of
  three modes, chosen per call from the operands' shapes and strides: ``flat`` (contiguous with
  the output's shape: index ``i``), ``scalar`` (one element: read once, before the loop) or
  ``strided`` (broadcast or non-contiguous: the output index is split into coordinates over the
  collapsed output dims and dotted with the operand's element strides, 0 on broadcast dims).
  Adjacent dims that every operand walks contiguously are merged first, so a bias broadcast
  over [N, C, H, W] is a 2-D or 3-D index computation, not 4-D.
- Indices are 32-bit when every element offset fits, else 64-bit.
- A vectorized path handles 4 elements per thread with 16-byte loads and stores (4-byte dtypes),
  or 8 when every operand read and every output is a 2-byte type (float16: 16-byte loads of 8
  halves, converted and computed in float32), when every operand is ``flat`` or ``scalar``,
  every pointer is aligned to its vector and the size is a multiple of the width. Before the
  8-wide path, half bodies took the element path (2-byte loads).
- Body constants of one element become C literals (exactly: floats via their float64 repr).
- Math runs in the op's dtype (float32 stays float32, with CUDA's float functions); the CPU
  references compute in float64 and round once, so results differ by a few ulps.

Caching: kernels are kept in memory by the SHA-256 of their source. On disk, CuPy's own
compile cache does the work: ``cupy.RawKernel`` compiles through NVRTC and stores the cubin in
``CUPY_CACHE_DIR`` (default ``~/.cupy/kernel_cache``), keyed by a hash of the source, the
options, the architecture and the NVRTC version, so a second process loads the cubin instead
of compiling (``kernel_cache_dir`` below reports the directory in use).
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

# --------------------------------------------------------------------------- dtypes and literals

CTYPES = {
    np.dtype(np.float32): "float", np.dtype(np.float64): "double",
    np.dtype(np.int8): "signed char", np.dtype(np.int16): "short", np.dtype(np.int32): "int",
    np.dtype(np.int64): "long long", np.dtype(np.uint8): "unsigned char", np.dtype(np.uint16): "unsigned short",
    np.dtype(np.uint32): "unsigned int", np.dtype(np.uint64): "unsigned long long", np.dtype(np.bool_): "bool",
}


# Half types (issue 18): stored as 16-bit words, loaded into float, computed in float and rounded once when
# stored (a fused chain rounds only its outputs, as torch.compile's generated kernels do; an explicit Cast to
# half inside a body rounds there too). Conversions are PTX (fp16), with no header for NVRTC to find.
HALF = {np.dtype(np.float16): ("kiln_h2f", "kiln_f2h")}
CTYPES[np.dtype(np.float16)] = "unsigned short"


def _bfloat16() -> Optional[np.dtype]:
    try:
        import ml_dtypes  # noqa: PLC0415 - optional: bfloat16 arrays on the host
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


# bfloat16 (issue 18): the same scheme. CuPy has no bfloat16 arrays, so on the device a bfloat16 tensor is
# its 16-bit words in a uint16 array (runtime/kernels/cuda/__init__.py, ``storage_dtype``); the body's
# dtypes (the graph's) say how to read them. Loaded by a shift into the high half of a float, stored with
# PTX's round-to-nearest-even cvt.rn.bf16.f32 (sm_80+).
BF16 = _bfloat16()
if BF16 is not None:
    HALF[BF16] = ("kiln_bf2f", "kiln_f2bf")
    CTYPES[BF16] = "unsigned short"


def kind(dt: Any) -> str:
    """numpy's dtype kind, with bfloat16 (ml_dtypes' kind 'V') a float."""
    dt = np.dtype(dt)
    return "f" if BF16 is not None and dt == BF16 else dt.kind


def storage_dtype(dt: Any) -> np.dtype:
    """The dtype of the device array holding a value of ``dt`` (bfloat16: uint16 words)."""
    dt = np.dtype(dt)
    return np.dtype(np.uint16) if BF16 is not None and dt == BF16 else dt


def supported_dtype(dt: Any) -> bool:
    return np.dtype(dt) in CTYPES


def ctype(dt: Any) -> str:
    """The C type a value of ``dt`` is stored as (in memory, kernel parameters)."""
    return CTYPES[np.dtype(dt)]


def compute_ctype(dt: Any) -> str:
    """The C type a value of ``dt`` is computed in: float for half types, else its storage type."""
    dt = np.dtype(dt)
    return "float" if dt in HALF else CTYPES[dt]


def load_expr(dt: Any, expr: str) -> str:
    """``expr`` (a stored ``dt``) as its compute type."""
    conv = HALF.get(np.dtype(dt))
    return f"{conv[0]}({expr})" if conv else expr


def store_expr(dt: Any, expr: str) -> str:
    """``expr`` (a computed value) as stored ``dt``."""
    conv = HALF.get(np.dtype(dt))
    return f"{conv[1]}({expr})" if conv else f"({ctype(dt)}){expr}"


def has_half(dtypes) -> bool:
    return any(np.dtype(d) in HALF for d in dtypes)


def literal(value: Any, dt: Any) -> str:
    """An exact C literal of ``value`` in dtype ``dt``."""
    dt = np.dtype(dt)
    t = compute_ctype(dt)
    if kind(dt) == "b":
        return "true" if bool(value) else "false"
    if kind(dt) == "f":
        v = float(value)
        if math.isnan(v):
            return f"(({t})__longlong_as_double(0x7ff8000000000000LL))"
        if math.isinf(v):
            return f"(({t})__longlong_as_double({'0xfff0000000000000LL' if v < 0 else '0x7ff0000000000000LL'}))"
        return f"(({t}){float(v)!r})"  # repr of the float64 value is exact; the cast rounds it once
    if kind(dt) == "u":
        return f"(({t}){int(value)}ULL)"
    v = int(value)
    if v == -(1 << 63):
        return "((long long)(-9223372036854775807LL - 1))"
    return f"(({t}){v}LL)"


# --------------------------------------------------------------------------- the body IR


@dataclass
class Step:
    op: str
    attrs: dict
    args: list            # C names of the arguments (None for an omitted optional input)
    arg_dtypes: list
    out: str              # C name of the result
    dtype: np.dtype       # result dtype


@dataclass
class Body:
    """An elementwise computation: operands (inputs, then array constants), steps, outputs."""

    operand_dtypes: list                      # dtype of each operand (inputs first)
    n_inputs: int                             # operands [0, n_inputs) are the node's inputs
    consts: list = field(default_factory=list)  # host arrays of operands n_inputs..
    steps: list = field(default_factory=list)
    outputs: list = field(default_factory=list)  # C names of the outputs
    output_dtypes: list = field(default_factory=list)
    literals: dict = field(default_factory=dict)  # C name -> literal expression
    exponents: dict = field(default_factory=dict)  # C name of a literal that is a small integer power -> it

    def signature(self) -> str:
        parts = [",".join(str(d) for d in self.operand_dtypes)]
        for s in self.steps:
            parts.append(f"{s.op}{sorted(s.attrs.items())}{s.args}{s.out}:{s.dtype}")
        parts.append(f"{self.outputs}{self.literals}")
        return "|".join(parts)


class Unsupported(Exception):
    """The body uses an op or dtype the generator has no CUDA expression for."""


def _static_dtype(v) -> np.dtype:
    if v.type is None:
        raise Unsupported(f"value {v.name} has no type")
    try:
        return np.dtype(v.type.dtype.numpy)
    except Exception as e:  # noqa: BLE001
        raise Unsupported(str(e)) from e


def body_from_graph(g) -> Body:
    """The Body of a FusedElementwise ``body`` graph (its inputs are the node's inputs)."""
    return body_from_nodes(g.inputs, g.initializers.values(), g.nodes, g.outputs)


def body_from_nodes(inputs, initializers, nodes, outputs) -> Body:
    """The Body computing ``outputs`` from ``inputs`` (the operands, in order) and the constant
    Values ``initializers`` through the elementwise ``nodes`` (in order): a whole fused body, or
    the elementwise part of a ``kiln.FusedEpilogue`` body (whose anchor's output is an input)."""
    names: dict = {}
    dtypes = [_static_dtype(v) for v in inputs]
    body = Body(operand_dtypes=list(dtypes), n_inputs=len(inputs))
    for i, v in enumerate(inputs):
        names[v] = f"a{i}"
    for v in initializers:
        arr = np.asarray(v.const)
        dt = arr.dtype
        if not supported_dtype(dt):
            raise Unsupported(f"constant dtype {dt}")
        if arr.size == 1:
            name = f"k{len(body.literals)}"
            body.literals[name] = literal(arr.reshape(-1)[0], dt)
            _note_exponent(body, name, arr)
        else:
            name = f"a{len(body.operand_dtypes)}"
            body.operand_dtypes.append(dt)
            body.consts.append(arr)
        names[v] = name
    for node in nodes:
        _add_step(body, node.op, node.domain, node.schema.fill_attrs(node.attrs),
                  [None if v is None else names[v] for v in node.inputs],
                  [None if v is None else _static_dtype(v) for v in node.inputs],
                  node.outputs, names)
    for v in outputs:
        if v not in names:
            raise Unsupported(f"output {v.name} is not computed by the body")
        body.outputs.append(names[v])
        body.output_dtypes.append(_static_dtype(v))
    return body


def body_from_node(node, attrs: dict, const_literals: Optional[dict] = None) -> Body:
    """The Body of one elementwise node: its inputs are the operands (``const_literals`` maps
    input positions of one-element constants to values, inlined as literals)."""
    const_literals = const_literals or {}
    body = Body(operand_dtypes=[], n_inputs=0)
    names: dict = {}
    args, dts = [], []
    for i, v in enumerate(node.inputs):
        if v is None:
            args.append(None)
            dts.append(None)
            continue
        dt = _static_dtype(v)
        if i in const_literals:
            name = f"k{len(body.literals)}"
            body.literals[name] = literal(const_literals[i], dt)
            _note_exponent(body, name, np.asarray(const_literals[i]))
        else:
            name = f"a{len(body.operand_dtypes)}"
            body.operand_dtypes.append(dt)
        args.append(name)
        dts.append(dt)
    body.n_inputs = len(body.operand_dtypes)
    _add_step(body, node.op, node.domain, attrs, args, dts, node.outputs, names)
    for v in node.outputs:
        body.outputs.append(names[v])
        body.output_dtypes.append(_static_dtype(v))
    return body


# Powers written as products (issue 24: ``x ** 3`` in a GELU approximation): exact for -1 (one
# division, as pow's correctly rounded 1/x) and within an ulp or two for 2..4, like powf itself.
SMALL_POWERS = (-1.0, 1.0, 2.0, 3.0, 4.0)


def _note_exponent(body: Body, name: str, arr: np.ndarray) -> None:
    v = arr.reshape(-1)[0]
    if np.issubdtype(arr.dtype, np.floating) and float(v) in SMALL_POWERS:
        body.exponents[name] = float(v)


def _add_step(body: Body, op: str, domain: str, attrs: dict, args: list, dts: list, outputs, names: dict) -> None:
    if domain != "" or op not in EXPRESSIONS:
        raise Unsupported(f"no CUDA expression for {op}")
    if len(outputs) != 1:
        raise Unsupported(f"{op} with {len(outputs)} outputs")
    out_dt = _static_dtype(outputs[0])
    for dt in [out_dt] + [d for d in dts if d is not None]:
        if not supported_dtype(dt):
            raise Unsupported(f"{op} on {dt}")
    name = f"t{len(body.steps)}"
    attrs = dict(attrs)
    if op == "Pow" and len(args) == 2 and args[1] in body.exponents and kind(dts[0]) == "f":
        attrs["_exponent"] = body.exponents[args[1]]  # a small integer power: multiplications (_pow)
    body.steps.append(Step(op, attrs, list(args), list(dts), name, out_dt))
    names[outputs[0]] = name


# --------------------------------------------------------------------------- op expressions
# Each maps (attrs, result ctype, argument dtypes, *argument names) to a C expression.

def _float_op(fn: str) -> Callable:
    def expr(attrs, t, dts, a):
        if kind(dts[0]) == "f":
            return f"k_{fn}(({t}){a})"
        return f"({t})k_{fn}((double){a})"  # integer inputs: in double, truncated (Erf allows ints)
    return expr


def _div(attrs, t, dts, a, b):
    if kind(dts[0]) == "f":
        return f"({a} / {b})"
    return f"k_idiv<{t}>({a}, {b})"


def _pow(attrs, t, dts, a, b):
    base, exp = np.dtype(dts[0]), np.dtype(dts[1])
    e = attrs.get("_exponent")
    if kind(base) == "f" and e is not None:
        x = f"(({t}){a})"
        return {-1.0: f"(({t})1 / {x})", 1.0: x, 2.0: f"({x} * {x})", 3.0: f"({x} * {x} * {x})",
                4.0: f"(({x} * {x}) * ({x} * {x}))"}[e]
    if kind(base) == "f":
        return f"k_pow(({t}){a}, ({t}){b})"
    if kind(exp) in "iu":
        return f"k_ipow<{t}>({a}, (long long){b})"
    return f"({t})trunc(pow((double){a}, (double){b}))"


def _fold(fn: str) -> Callable:
    def expr(attrs, t, dts, *xs):
        out = f"({t}){xs[0]}"
        for x in xs[1:]:
            out = f"{fn}({out}, ({t}){x})"
        return out
    return expr


def _sum(attrs, t, dts, *xs):
    return "(" + f"({t})(" + " + ".join(f"(double){x}" for x in xs) + "))"


def _mean(attrs, t, dts, *xs):
    return f"(({t})((" + " + ".join(f"(double){x}" for x in xs) + f") / {len(xs)}.0))"


def _clip(attrs, t, dts, x, lo=None, hi=None):
    out = x
    if lo is not None:
        out = f"k_max({out}, ({t}){lo})"
    if hi is not None:
        out = f"k_min({out}, ({t}){hi})"
    return f"({t})({out})"


def _cast(attrs, t, dts, x, *unused):
    if t == "bool":
        return f"({x} != 0)"
    return f"({t})({x})"


def _f(v, t):
    return f"(({t}){float(v)!r})"


def _gelu(attrs, t, dts, x):
    if attrs.get("approximate", "none") == "tanh":
        return f"k_gelu_tanh(({t}){x})"
    return f"k_gelu(({t}){x})"


def _is_inf(attrs, t, dts, x):
    neg = "true" if attrs.get("detect_negative", 1) else "false"
    pos = "true" if attrs.get("detect_positive", 1) else "false"
    return f"(k_isinf({x}) && ({x} < 0 ? {neg} : {pos}))"


EXPRESSIONS: dict[str, Callable] = {
    "Add": lambda at, t, d, a, b: f"({t})({a} + {b})",
    "Sub": lambda at, t, d, a, b: f"({t})({a} - {b})",
    "Mul": lambda at, t, d, a, b: f"({t})({a} * {b})",
    "Div": _div,
    "Pow": _pow,
    "Neg": lambda at, t, d, a: f"({t})(-{a})",
    "Abs": lambda at, t, d, a: f"k_abs({a})",
    "Sign": lambda at, t, d, a: f"({a} != {a} ? {a} : ({t})(({a} > 0) - ({a} < 0)))",
    "Floor": lambda at, t, d, a: f"k_floor({a})" if kind(d[0]) == "f" else a,
    "Ceil": lambda at, t, d, a: f"k_ceil({a})" if kind(d[0]) == "f" else a,
    "Exp": _float_op("exp"), "Log": _float_op("log"), "Sqrt": _float_op("sqrt"), "Erf": _float_op("erf"),
    "Tanh": _float_op("tanh"), "Sin": _float_op("sin"), "Cos": _float_op("cos"), "Sigmoid": _float_op("sigmoid"),
    "Softplus": _float_op("softplus"), "Mish": _float_op("mish"),
    "Reciprocal": lambda at, t, d, a: f"(({t})1 / {a})",
    "Max": _fold("k_max"), "Min": _fold("k_min"), "Sum": _sum, "Mean": _mean,
    "Clip": _clip,
    "Relu": lambda at, t, d, a: f"({a} < ({t})0 ? ({t})0 : {a})",
    "LeakyRelu": lambda at, t, d, a: f"({a} >= 0 ? {a} : {_f(at.get('alpha', 0.01), t)} * {a})",
    "Elu": lambda at, t, d, a: f"({a} >= 0 ? {a} : {_f(at.get('alpha', 1.0), t)} * k_expm1({a}))",
    "Selu": lambda at, t, d, a: (f"({_f(at['gamma'], t)} * ({a} > 0 ? {a} : "
                                 f"{_f(at['alpha'], t)} * k_expm1({a})))"),
    "Gelu": _gelu,
    "HardSigmoid": lambda at, t, d, a: f"k_hsig({a}, {_f(at.get('alpha', 0.2), t)}, {_f(at.get('beta', 0.5), t)})",
    "HardSwish": lambda at, t, d, a: f"({a} * k_hsig({a}, ({t})(1.0 / 6.0), ({t})0.5))",
    "Softsign": lambda at, t, d, a: f"({a} / (({t})1 + k_abs({a})))",
    "PRelu": lambda at, t, d, a, s: f"({t})({a} < 0 ? {s} * {a} : {a})",
    "Equal": lambda at, t, d, a, b: f"({a} == {b})",
    "Less": lambda at, t, d, a, b: f"({a} < {b})",
    "Greater": lambda at, t, d, a, b: f"({a} > {b})",
    "LessOrEqual": lambda at, t, d, a, b: f"({a} <= {b})",
    "GreaterOrEqual": lambda at, t, d, a, b: f"({a} >= {b})",
    "Not": lambda at, t, d, a: f"(!{a})",
    "And": lambda at, t, d, a, b: f"({a} && {b})",
    "Or": lambda at, t, d, a, b: f"({a} || {b})",
    "Xor": lambda at, t, d, a, b: f"({a} != {b})",
    "Where": lambda at, t, d, c, a, b: f"({c} ? {a} : {b})",
    "Cast": _cast, "CastLike": _cast,
    "IsNaN": lambda at, t, d, a: f"({a} != {a})",
    "IsInf": _is_inf,
    "Identity": lambda at, t, d, a: f"{a}",
}
# CastLike's second input only gives the dtype: the kernel never reads it.
UNREAD_INPUTS = {"CastLike": (1,)}

# The 16-bit float conversions every kiln kernel that reads or writes half types uses (generated, row,
# attention, dequantize kernels; the bfloat16 widening around float32 kernels): float16 through PTX cvt (no
# header for NVRTC to find); bfloat16 is the high half of a float32, rounded to nearest even in plain C (as
# ml_dtypes and torch do) so the source compiles on every architecture; a NaN stays a quiet NaN.
HALF_CONVERSIONS = r"""
__device__ __forceinline__ float kiln_h2f(unsigned short h) { float f; asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short kiln_f2h(float f) { unsigned short h; asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float kiln_bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short kiln_f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""

PRELUDE = r"""
#define KF __device__ __forceinline__
KF float k_exp(float x) { return expf(x); }      KF double k_exp(double x) { return exp(x); }
KF float k_log(float x) { return logf(x); }      KF double k_log(double x) { return log(x); }
KF float k_sqrt(float x) { return sqrtf(x); }    KF double k_sqrt(double x) { return sqrt(x); }
KF float k_erf(float x) { return erff(x); }      KF double k_erf(double x) { return erf(x); }
KF float k_tanh(float x) { return tanhf(x); }    KF double k_tanh(double x) { return tanh(x); }
KF float k_sin(float x) { return sinf(x); }      KF double k_sin(double x) { return sin(x); }
KF float k_cos(float x) { return cosf(x); }      KF double k_cos(double x) { return cos(x); }
KF float k_expm1(float x) { return expm1f(x); }  KF double k_expm1(double x) { return expm1(x); }
KF float k_pow(float x, float y) { return powf(x, y); }  KF double k_pow(double x, double y) { return pow(x, y); }
KF float k_erfc(float x) { return erfcf(x); }    KF double k_erfc(double x) { return erfc(x); }
KF float k_log1p(float x) { return log1pf(x); }  KF double k_log1p(double x) { return log1p(x); }
KF float k_floor(float x) { return floorf(x); }  KF double k_floor(double x) { return floor(x); }
KF float k_ceil(float x) { return ceilf(x); }    KF double k_ceil(double x) { return ceil(x); }
template <typename T> KF bool k_isinf(T x) { return x == x && x - x != x - x; }
template <typename T> KF T k_abs(T x) { return x < 0 ? (T)(-x) : x; }
KF float k_abs(float x) { return fabsf(x); }     KF double k_abs(double x) { return fabs(x); }
// NaN-propagating max/min (numpy's maximum/minimum).
template <typename T> KF T k_max(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a > b ? a : b)); }
template <typename T> KF T k_min(T a, T b) { return (a != a) ? a : ((b != b) ? b : (a < b ? a : b)); }
// Overflow-free logistic: exp only ever sees -|x|.
template <typename T> KF T k_sigmoid(T x) { T e = k_exp(-k_abs(x)); return x >= 0 ? (T)1 / ((T)1 + e) : e / ((T)1 + e); }
template <typename T> KF T k_softplus(T x) { return k_max(x, (T)0) + k_log1p(k_exp(-k_abs(x))); }
template <typename T> KF T k_mish(T x) { return x * k_tanh(k_softplus(x)); }
// Exact Gelu as x * erfc(-x / sqrt 2) / 2: no cancellation in the negative tail.
template <typename T> KF T k_gelu(T x) { return (T)0.5 * x * k_erfc(-x * (T)0.70710678118654752440); }
template <typename T> KF T k_gelu_tanh(T x) {
  return (T)0.5 * x * ((T)1 + k_tanh((T)0.79788456080286535588 * (x + (T)0.044715 * x * x * x))); }
template <typename T> KF T k_hsig(T x, T alpha, T beta) { return k_min(k_max(alpha * x + beta, (T)0), (T)1); }
// C division truncates toward zero, as ONNX integer Div does; x / 0 gives 0 (numpy's result).
template <typename T> KF T k_idiv(T a, T b) { return b == 0 ? (T)0 : (T)(a / b); }
template <typename T> KF T k_ipow(T base, long long e) {
  if (e < 0) return (T)trunc(pow((double)base, (double)e));
  T r = 1, b = base;
  while (e) { if (e & 1) r = (T)(r * b); b = (T)(b * b); e >>= 1; }
  return r;
}
template <typename T, int W> struct alignas(sizeof(T) * W) VW { T v[W]; };
""" + HALF_CONVERSIONS


# --------------------------------------------------------------------------- source generation

FLAT, SCALAR, STRIDED = "f", "s", "d"


def body_code(body: Body, load: Callable[[int], str]) -> list:
    """C statements computing the body; ``load(k)`` is operand k's value expression."""
    lines = []
    for name, lit in body.literals.items():
        lines.append(f"const auto {name} = {lit};")
    read: set = set()
    for s in body.steps:
        skip = UNREAD_INPUTS.get(s.op, ())
        args = []
        for i, a in enumerate(s.args):
            if a is None or i in skip:
                args.append(None if a is None else "0")
                continue
            if a.startswith("a") and a not in read:
                k = int(a[1:])
                dt = body.operand_dtypes[k]
                lines.append(f"const {compute_ctype(dt)} {a} = {load_expr(dt, load(k))};")
                read.add(a)
            args.append(a)
        while args and args[-1] is None:
            args.pop()
        t = compute_ctype(s.dtype)
        expr = EXPRESSIONS[s.op](s.attrs, t, s.arg_dtypes, *args)
        if s.op in ("Cast", "CastLike") and np.dtype(s.dtype) in HALF:  # a cast to half rounds to half here
            expr = load_expr(s.dtype, store_expr(s.dtype, f"(float)({expr})"))
        lines.append(f"const {t} {s.out} = ({t})({expr});")
    # An output that is an operand or literal passed through (Identity-like bodies).
    for o in body.outputs:
        if o.startswith("a") and o not in read:
            k = int(o[1:])
            dt = body.operand_dtypes[k]
            lines.append(f"const {compute_ctype(dt)} {o} = {load_expr(dt, load(k))};")
            read.add(o)
    return lines


def operands_read(body: Body) -> set:
    """Operand indices the body reads (CastLike's dtype-only input is not read)."""
    used = set()
    for s in body.steps:
        skip = UNREAD_INPUTS.get(s.op, ())
        for i, a in enumerate(s.args):
            if a is not None and i not in skip and a.startswith("a"):
                used.add(int(a[1:]))
    for o in body.outputs:
        if o.startswith("a"):
            used.add(int(o[1:]))
    return used


def generate(body: Body, modes: Sequence[str], ndim: int, index: str, vec: int, alias: bool = False) -> str:
    """The kernel source for ``body`` with operand ``modes`` (FLAT/SCALAR/STRIDED, '-' for
    operands not read), ``ndim`` collapsed output dims, index type ``index`` ('int' or
    'long long') and the vector width ``vec`` (4 or 8 elements a thread; 0 or False: the element
    path; True means 4). ``alias``: an output is also an operand (an in-place launch), so no
    pointer is declared ``__restrict__``."""
    w = 4 if vec is True else int(vec)
    restrict = "" if alias else " __restrict__"
    params = []
    for k, dt in enumerate(body.operand_dtypes):
        if modes[k] != "-":
            params.append(f"const {ctype(dt)}*{restrict} p{k}")
    for j, dt in enumerate(body.output_dtypes):
        params.append(f"{ctype(dt)}*{restrict} q{j}")
    params.append(f"{index} n")
    if not vec:
        params += [f"{index} D{d}" for d in range(ndim)]
        for k, m in enumerate(modes):
            if m == STRIDED:
                params += [f"{index} S{k}_{d}" for d in range(ndim)]
    lines = [PRELUDE, f'extern "C" __global__ void kiln_ew({", ".join(params)}) {{']
    # Scalars are read once per thread, before the loop.
    for k, m in enumerate(modes):
        if m == SCALAR:
            lines.append(f"  const {ctype(body.operand_dtypes[k])} s{k} = p{k}[0];")
    lines.append(f"  const {index} step = ({index})gridDim.x * blockDim.x;")
    if vec:
        lines.append(f"  for ({index} v = ({index})blockIdx.x * blockDim.x + threadIdx.x; v < n / {w}; v += step) {{")
        for k, m in enumerate(modes):
            if m == FLAT:
                lines.append(f"    const VW<{ctype(body.operand_dtypes[k])}, {w}> v{k} = "
                             f"reinterpret_cast<const VW<{ctype(body.operand_dtypes[k])}, {w}>*>(p{k})[v];")
        for j, dt in enumerate(body.output_dtypes):
            lines.append(f"    VW<{ctype(dt)}, {w}> r{j};")
        lines.append("    #pragma unroll")
        lines.append(f"    for (int e = 0; e < {w}; ++e) {{")
        code = body_code(body, lambda k: f"v{k}.v[e]" if modes[k] == FLAT else f"s{k}")
        lines += ["      " + c for c in code]
        for j, o in enumerate(body.outputs):
            lines.append(f"      r{j}.v[e] = {store_expr(body.output_dtypes[j], o)};")
        lines.append("    }")
        for j, dt in enumerate(body.output_dtypes):
            lines.append(f"    reinterpret_cast<VW<{ctype(dt)}, {w}>*>(q{j})[v] = r{j};")
        lines.append("  }")
    else:
        lines.append(f"  for ({index} i = ({index})blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {{")
        strided = [k for k, m in enumerate(modes) if m == STRIDED]
        if strided:
            for k in strided:
                lines.append(f"    {index} o{k} = 0;")
            lines.append(f"    {index} r = i;")
            for d in range(ndim - 1, 0, -1):
                lines.append(f"    {{ const {index} c = r % D{d}; r /= D{d};"
                             + "".join(f" o{k} += c * S{k}_{d};" for k in strided) + " }")
            lines.append("   " + "".join(f" o{k} += r * S{k}_0;" for k in strided))

        def load(k):
            return {FLAT: f"p{k}[i]", SCALAR: f"s{k}", STRIDED: f"p{k}[o{k}]"}[modes[k]]
        code = body_code(body, load)
        lines += ["    " + c for c in code]
        for j, o in enumerate(body.outputs):
            lines.append(f"    q{j}[i] = {store_expr(body.output_dtypes[j], o)};")
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- compilation cache

_COMPILED: dict = {}
STATS = {"compiled": 0, "memory_hits": 0}


def compile_kernel(source: str, name: str = "kiln_ew"):
    """``cupy.RawKernel`` of the function ``name`` in ``source``, one per source text per process
    (keyed by SHA-256); CuPy's on-disk cache (see the module docstring) spares the NVRTC run
    across processes. Also used by rowwise.py's softmax/LayerNorm kernels."""
    import cupy
    key = hashlib.sha256(f"{name}\0{source}".encode()).hexdigest()
    k = _COMPILED.get(key)
    if k is None:
        k = cupy.RawKernel(source, name, options=("--std=c++17",))
        k.compile()
        _COMPILED[key] = k
        STATS["compiled"] += 1
    else:
        STATS["memory_hits"] += 1
    return k


def kernel_cache_dir() -> str:
    """Where CuPy keeps compiled kernels on disk."""
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


# --------------------------------------------------------------------------- launching


def collapse(shape: tuple, strides: list) -> tuple:
    """Merge adjacent dims that every operand walks contiguously (stride[d] == stride[d+1] *
    shape[d+1]); size-1 dims are dropped. ``strides`` is one list of element strides per
    operand. Returns (shape, strides) with as few dims as possible (at least one)."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    if not dims:
        return (1,), [[0] for _ in strides]
    out_shape = [shape[dims[0]]]
    out_strides = [[s[dims[0]]] for s in strides]
    for d in dims[1:]:
        n = shape[d]
        if all(os_[-1] == s[d] * n for os_, s in zip(out_strides, strides)):
            out_shape[-1] *= n
            for os_, s in zip(out_strides, strides):
                os_[-1] = s[d]
        else:
            out_shape.append(n)
            for os_, s in zip(out_strides, strides):
                os_.append(s[d])
    return tuple(out_shape), out_strides


# Launch shape: BLOCK threads a block; at most BLOCKS_PER_SM blocks per multiprocessor, each
# thread looping over the rest (grid-stride); 0 = no cap (one vector or element per thread).
# The 4-wide path and the element path differ (bench/gpu_launch_shape.py, H200): the 8192^2
# chain ran 1.08x the bandwidth floor at 256/32 and 1.01x at 128/uncapped, while a broadcast
# bias + Gelu on the element path ran 2.0x at 256/32 and 2.8x uncapped. Module globals, read at
# each new launch plan, so a benchmark can compare shapes.
BLOCK, BLOCKS_PER_SM = 256, 32
BLOCK_VEC, BLOCKS_PER_SM_VEC = 128, 0
_INT32_MAX = (1 << 31) - 1


class ElementwiseKernel:
    """A compiled-on-demand launcher of one Body: ``run(*operands)`` (device arrays, inputs
    only; constants are uploaded once here) returns the output arrays. Launch plans are cached
    per operand shape/stride/alignment signature."""

    def __init__(self, body: Body):
        import cupy
        self.cp = cupy
        self.body = body
        self.consts = [cupy.asarray(np.asarray(c).view(storage_dtype(c.dtype))) for c in body.consts]
        self.read = operands_read(body)
        self.dtypes = [np.dtype(d) for d in body.operand_dtypes]
        self._plans: dict = {}
        dev = cupy.cuda.Device()
        self.sms = dev.attributes["MultiProcessorCount"]
        self.vector_launches = 0
        self.launches = 0

    def __call__(self, *inputs, out=None):
        """The outputs for these operands; ``out``: an array to write the (single) output into,
        of the output's shape and dtype (it may be one of the operands: each element is read
        before it is written, by the same thread)."""
        cp = self.cp
        ops = []
        for k, a in enumerate(list(inputs) + self.consts):
            if not isinstance(a, cp.ndarray):
                a = cp.asarray(a)
            want = storage_dtype(self.dtypes[k])
            if a.dtype != want:
                if want != self.dtypes[k]:  # bfloat16 words: no conversion on the device would be right
                    raise ValueError(f"operand {k} is {a.dtype}, the kernel reads {self.dtypes[k]} as {want} words")
                a = a.astype(want)  # a scalar given with another dtype (rare)
            ops.append(a)
        alias = out is not None and any(a.data.ptr == out.data.ptr for a in ops)
        key = tuple((a.shape, a.strides, a.data.ptr % 16 == 0) for a in ops) + (alias,)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(ops, alias)
            if len(self._plans) < 64:
                self._plans[key] = plan
        kern, shape, blocks, block, extra, vec = plan
        if out is not None:
            if len(self.body.output_dtypes) != 1 or out.shape != tuple(shape) or \
                    out.dtype != storage_dtype(self.body.output_dtypes[0]) or not out.flags.c_contiguous or \
                    (vec and out.data.ptr % 16):
                raise ValueError("out= must be one C-contiguous, 16-byte aligned array of the output's shape and dtype")
            outs = [out]
        else:
            outs = [cp.empty(shape, storage_dtype(dt)) for dt in self.body.output_dtypes]
        n = math.prod(shape)
        if n == 0:
            return outs
        args = [a for k, a in enumerate(ops) if k in self.read] + outs + extra
        kern((blocks,), (block,), tuple(args))
        self.launches += 1
        self.vector_launches += vec
        return outs

    def _plan(self, ops: list, alias: bool = False) -> tuple:
        # The output covers the operands the body reads (CastLike's dtype-only input is not one).
        shape = np.broadcast_shapes(*(a.shape for k, a in enumerate(ops) if k in self.read))
        n = math.prod(shape)
        ndim = len(shape)
        modes, el_strides = [], []
        for k, a in enumerate(ops):
            if k not in self.read:
                modes.append("-")
                el_strides.append(None)
                continue
            if a.size == 1:
                modes.append(SCALAR)
                el_strides.append(None)
            elif a.shape == tuple(shape) and a.flags.c_contiguous:
                modes.append(FLAT)
                el_strides.append(None)
            else:
                modes.append(STRIDED)
                # Broadcast view: numpy-style strides with 0 on broadcast dims, in elements.
                pad = ndim - a.ndim
                st = [0] * pad + [0 if a.shape[d] == 1 else a.strides[d] // a.itemsize for d in range(a.ndim)]
                el_strides.append(st)
        strided = [k for k, m in enumerate(modes) if m == STRIDED]
        all_flat = not strided
        # Vector width: 16-byte loads, 8 elements a thread where every operand read and every output is a
        # 2-byte type (float16: issue 18), else 4 (4-byte types; a half operand beside float32 ones takes
        # 8-byte loads). Each flat operand must be aligned to its vector.
        sizes = [ops[k].itemsize for k, m in enumerate(modes) if m == FLAT] + \
            [np.dtype(d).itemsize for d in self.body.output_dtypes]
        width = 8 if sizes and all(z == 2 for z in sizes) else 4
        aligned = all(ops[k].data.ptr % (width * ops[k].itemsize) == 0 for k, m in enumerate(modes) if m == FLAT)
        vec = width if (all_flat and n % width == 0 and n >= width and aligned
                        and all(z in (2, 4) for z in sizes)) else 0
        # Outputs are fresh cupy allocations (256-byte aligned): always vector-aligned.
        if strided:
            cshape, cstr = collapse(tuple(shape), [el_strides[k] for k in strided])
        else:
            cshape, cstr = (n,), []
        span = max([n] + [sum(abs(s) * (d - 1) for s, d in zip(st, cshape)) + 1 for st in cstr])
        block, per_sm = (BLOCK_VEC, BLOCKS_PER_SM_VEC) if vec else (BLOCK, BLOCKS_PER_SM)
        work = n // vec if vec else n
        blocks = -(-work // block)
        if per_sm:
            blocks = min(blocks, self.sms * per_sm)
        blocks = max(1, blocks)
        index = "int" if span <= _INT32_MAX and n + 8 * block * blocks <= _INT32_MAX else "long long"
        it = np.int32 if index == "int" else np.int64
        src = generate(self.body, modes, len(cshape), index, vec, alias)
        kern = compile_kernel(src)
        extra = [it(n)]
        if not vec:
            extra += [it(d) for d in cshape]
            for st in cstr:
                extra += [it(s) for s in st]
        return kern, tuple(shape), blocks, block, extra, int(bool(vec))
