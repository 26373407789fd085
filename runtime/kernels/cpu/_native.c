/* kiln's optional native CPU kernels (issues 21 and 24): what numpy cannot do in one pass.

   Built at install when a C compiler is there (pyproject.toml: an optional extension, so an install without one
   still succeeds and kiln runs its numpy kernels); wheels carry it prebuilt. The numpy kernels stay the
   reference and the fallback: runtime/kernels/cpu/native.py binds these only for the float32 inputs they cover,
   and tests/runtime/test_native.py checks every one against the reference (or, for the elementwise chains,
   against the unfused kernels bit for bit).

   - direct_conv2d: a grouped 2-D convolution computed directly over stride-phase images (prepare_plane): each
     kernel tap is one contiguous, branch-free run over a flattened phase image, accumulated in registers
     (4 vectors of a depthwise plane, or 4 output channels x 2 vectors of a dense conv, so each input load feeds
     8 FMAs), a chunk of output rows at a time; the bias and an activation (Relu, HardSwish, HardSigmoid, Clip,
     LeakyRelu) are applied in the pass that copies the result out. For depthwise convs, the 3-channel stem and
     1x1 convs over few channels, where im2col + GEMM copies more than it multiplies. Where the CPU has AVX-512F
     the same entry point runs dconv/dwconv/dwk register tiles instead (see "AVX-512 direct conv" below): they
     read the input rows in place, with masked loads at the edges, and need no phase images.
   - im2col, gemm_out: the GEMM convolution's columns in one pass, and its output pass (bias, activation).
   - sgemm: an AVX-512 GEMM (packed operands, a 12 x 32 micro-kernel, threads over columns, rows or a batch)
     for the convolutions' and MatMul/Gemm's float32 products, where numpy's OpenBLAS may run AVX2 kernels.
   - gelu, layer_norm, softmax: one or two passes per row where numpy makes 5-15 (exp8: Cephes' expf).
   - elementwise: a FusedElementwise body of correctly rounded ops as register code over cache-sized chunks.

   Code generation: the loops are written with GCC vector types (8 floats) and compiled twice, for AVX2 + FMA
   and for the baseline, the pair picked at import by CPU feature (PyInit__native).

   Threads (direct_conv2d): the output planes are split into contiguous ranges over `threads` POSIX threads
   (native.py asks for 1 by default, see its MAX_THREADS, and 1 whenever kiln's busy-host policy says so); the
   GIL is released throughout. A thread is created per call and joined: nothing spins between calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <sched.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_THREADS 64
#define MAX_STRIDE 16
#define CHUNK 2048  /* output floats per step of a run of planes (8 KB: it and its input rows stay in L1/L2) */

typedef struct {
    const float *x, *w, *bias;
    float *y;
    Py_ssize_t n, c, h, wd, m, oh, ow, kh, kw, group;
    Py_ssize_t sh, sw, dh, dw, pt, pl;
    int act;              /* the activation applied to each output after the bias: ACT_* */
    double alpha, beta;   /* its parameters */
    /* the phase images of one input plane (see prepare_plane): sh * sw images of hq rows of lq floats */
    Py_ssize_t hq, lq;
    Py_ssize_t chunk;  /* output floats computed per step: whole lq-wide rows, about CHUNK */
    Py_ssize_t col_lo[MAX_STRIDE], col_hi[MAX_STRIDE];  /* per column phase: its columns from the input */
    float *prepared;  /* every input plane's phase images (dense convs), or NULL: each thread makes its own */
    Py_ssize_t plane_begin, plane_end;
} conv_job;

/* x86-64: the hot loop is compiled twice, for AVX2 + FMA and for the baseline (SSE2), and picked once at
   run time by what the CPU has (feature bits, not CPU models: target_clones("arch=...") keys on models). */
#if defined(__GNUC__) && defined(__x86_64__)
#define KILN_X86_DISPATCH 1
#endif

static Py_ssize_t ceil_div(Py_ssize_t a, Py_ssize_t b) { return a >= 0 ? (a + b - 1) / b : -((-a) / b); }

#define BLOCK 32  /* outputs per register block: four 8-float vectors (AVX2: four ymm accumulators) */
typedef float v8sf __attribute__((vector_size(32)));
typedef int v8si __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8sf load8(const float *p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, v8sf v) { memcpy(p, &v, sizeof v); }

/* 16-lane vectors: only inside functions compiled for AVX-512 (target("avx512f")), where the inline helpers below
   that take them are inlined */
typedef float v16sf __attribute__((vector_size(64)));
typedef int v16si __attribute__((vector_size(64)));

/* lanes of u below lim (above lim) replaced by lim; NaN lanes compare false and stay NaN */
#define DEFINE_CLAMPS(VF, VI, SUFFIX)                                                                      \
    static inline __attribute__((always_inline)) VF raise_to##SUFFIX(VF u, VF lim) {                       \
        const VI m = u < lim;                                                                              \
        return (VF)(((VI)u & ~m) | ((VI)lim & m));                                                         \
    }                                                                                                      \
    static inline __attribute__((always_inline)) VF lower_to##SUFFIX(VF u, VF lim) {                       \
        const VI m = u > lim;                                                                              \
        return (VF)(((VI)u & ~m) | ((VI)lim & m));                                                         \
    }
DEFINE_CLAMPS(v8sf, v8si, )
DEFINE_CLAMPS(v16sf, v16si, 16)

/* Input plane `src` ([h, wd]) written zero-padded and split by stride phase into `dst` ([sh, sw, hq, lq]):
   phase (a, b) holds the padded rows a, a + sh, ... and columns b, b + sw, ... (padded row t is input row
   t - pt). Kernel tap (i, q) then reads, for every output (r, o), phase ((i*dh) % sh, (q*dw) % sw) at row
   r + (i*dh) / sh, column o + (q*dw) / sw: over the phase image flattened row by row, one contiguous run of
   oh * lq floats starting at ((i*dh) / sh) * lq + (q*dw) / sw (the columns past ow in each row are computed
   and dropped). So each tap is one long, branch-free, vectorized multiply-add. */
static inline __attribute__((always_inline)) void prepare_plane(const conv_job *j, const float *src, float *dst) {
    const Py_ssize_t sh = j->sh, sw = j->sw, hq = j->hq, lq = j->lq;
    for (Py_ssize_t a = 0; a < sh; a++) {
        for (Py_ssize_t k = 0; k < hq; k++) {
            const Py_ssize_t ih = a + k * sh - j->pt;
            for (Py_ssize_t b = 0; b < sw; b++) {
                float *restrict out = dst + ((a * sw + b) * hq + k) * lq;
                /* Loops, not memset/memcpy: rows are short (7-112 floats), where a libc call per row costs
                   more than the copy (pyproject.toml keeps gcc from turning the loops back into calls). */
                if (ih < 0 || ih >= j->h) {  /* a padding row */
                    for (Py_ssize_t kk = 0; kk < lq; kk++) out[kk] = 0.0f;
                    continue;
                }
                const Py_ssize_t lo = j->col_lo[b], hi = j->col_hi[b];
                const float *restrict in = src + ih * j->wd + b - j->pl;
                for (Py_ssize_t kk = 0; kk < lo; kk++) out[kk] = 0.0f;
                Py_ssize_t kk = lo;
                if (sw == 1) {
                    for (; kk < hi; kk++) out[kk] = in[kk];
                } else if (sw == 2) {  /* every other input column: two vectors in, their even lanes out */
                    for (; kk + 8 <= hi; kk += 8) {
                        const v8sf u = load8(in + 2 * kk), v = load8(in + 2 * kk + 8);
#if defined(__clang__)
                        store8(out + kk, __builtin_shufflevector(u, v, 0, 2, 4, 6, 8, 10, 12, 14));
#else
                        store8(out + kk, __builtin_shuffle(u, v, (v8si){0, 2, 4, 6, 8, 10, 12, 14}));
#endif
                    }
                    for (; kk < hi; kk++) out[kk] = in[2 * kk];
                } else {
                    for (; kk < hi; kk++) out[kk] = in[kk * sw];
                }
                for (kk = hi; kk < lq; kk++) out[kk] = 0.0f;
            }
        }
    }
}


#define MB 4  /* dense convs: output channels per register block */

/* Activations fused into the output pass (kiln.FusedEpilogue of a Conv and one of these ops; native.py):
   the ONNX ops' definitions in float32 (kiln's references compute HardSwish, HardSigmoid and LeakyRelu in
   double and round once: these may differ by an ulp or two; computed in double here they cost as much as the
   convolution), NaN propagated as the numpy kernels propagate it. */
enum { ACT_NONE, ACT_RELU, ACT_HARDSWISH, ACT_HARDSIGMOID, ACT_CLIP, ACT_LEAKYRELU, ACT_COUNT };

static inline __attribute__((always_inline)) float clamp01(float v) {
    v = v < 0.0f ? 0.0f : v;  /* two selects, not nested ones: the compiler turns each into a blend */
    return v > 1.0f ? 1.0f : v;  /* NaN stays NaN */
}

/* y[o] = act(a[o] + b0), o < n: one loop per activation (the switch outside it), so each vectorizes. y may be a
   (in place: gemm_out), so neither is restrict. */
static inline __attribute__((always_inline)) void finish_row(float *y, const float *a,
                                                             Py_ssize_t n, float b0, int act, double alpha,
                                                             double beta) {
    const float fa = (float)alpha, fb = (float)beta;
    switch (act) {
    case ACT_RELU:
        for (Py_ssize_t o = 0; o < n; o++) {
            const float t = a[o] + b0;
            y[o] = t < 0.0f ? 0.0f : t;
        }
        break;
    case ACT_HARDSWISH:
    case ACT_HARDSIGMOID: {  /* written with vector selects: the compiler does not if-convert these loops */
        const v8sf zero = {0}, one = zero + 1.0f, va = zero + fa, vb = zero + fb, vb0 = zero + b0;
        Py_ssize_t o = 0;
        for (; o + 8 <= n; o += 8) {
            const v8sf t = load8(a + o) + vb0, u = lower_to(raise_to(va * t + vb, zero), one);
            store8(y + o, act == ACT_HARDSWISH ? t * u : u);
        }
        for (; o < n; o++) {
            const float t = a[o] + b0, u = clamp01(fa * t + fb);
            y[o] = act == ACT_HARDSWISH ? t * u : u;
        }
        break;
    }
    case ACT_CLIP: {  /* max then min, as Clip's reference: min > max gives max everywhere */
        const float lo = (float)alpha, hi = (float)beta;
        const v8sf zero = {0}, vlo = zero + lo, vhi = zero + hi, vb0 = zero + b0;
        Py_ssize_t o = 0;
        for (; o + 8 <= n; o += 8) store8(y + o, lower_to(raise_to(load8(a + o) + vb0, vlo), vhi));
        for (; o < n; o++) {
            float t = a[o] + b0;
            t = t < lo ? lo : t;
            y[o] = t > hi ? hi : t;
        }
        break;
    }
    case ACT_LEAKYRELU:
        for (Py_ssize_t o = 0; o < n; o++) {
            const float t = a[o] + b0;
            y[o] = t < 0.0f ? fa * t : t;
        }
        break;
    default:
        for (Py_ssize_t o = 0; o < n; o++) y[o] = a[o] + b0;
    }
}


/* The output planes [plane_begin, plane_end): per block of BLOCK flat outputs, bias + every tap's
   w * run (held in registers across the taps: one store per output, not one per tap); then the first ow
   columns of each lq-wide row are the output row. `off` (taps entries) is each tap's run start within the
   group's phase images; `acc` has room for span rounded up to BLOCK, and the phase images BLOCK floats of
   slack past their end, so the last block reads and writes inside its buffers. */
static inline __attribute__((always_inline)) void compute_planes_body(const conv_job *j, float *scratch,
                                                                       float *restrict acc, Py_ssize_t *off) {
    const Py_ssize_t cpg = j->c / j->group, mpg = j->m / j->group;
    const Py_ssize_t sh = j->sh, sw = j->sw, hq = j->hq, lq = j->lq, plane_in = sh * sw * hq * lq;
    const Py_ssize_t taps = cpg * j->kh * j->kw, ow = j->ow;
    for (Py_ssize_t ci = 0, t = 0; ci < cpg; ci++)
        for (Py_ssize_t i = 0; i < j->kh; i++)
            for (Py_ssize_t q = 0; q < j->kw; q++, t++)
                off[t] = ci * plane_in + (((i * j->dh) % sh * sw + (q * j->dw) % sw) * hq + (i * j->dh) / sh) * lq +
                         (q * j->dw) / sw;
    /* Dense convs: MB output channels of one group and sample at a time, so each input vector loaded feeds
       MB multiply-adds (the GEMM micro-kernel's reuse); depthwise convs have one output per input plane.
       The planes reading one input (a run: same sample and group) are computed a chunk of output rows at a
       time, every MB block of the run per chunk, so the chunk's input stays in cache across the blocks
       instead of being streamed once per block. */
    const Py_ssize_t mb = j->prepared ? MB : 1, chunk_rows = j->chunk / lq, stride_acc = j->chunk + BLOCK;
    const double alpha = j->alpha, beta = j->beta;
    for (Py_ssize_t p = j->plane_begin; p < j->plane_end;) {
        const Py_ssize_t s = p / j->m, mo = p % j->m, g = mo / mpg;
        Py_ssize_t run = (g + 1) * mpg - mo;
        if (run > j->plane_end - p) run = j->plane_end - p;
        const float *in0;
        if (j->prepared) {
            in0 = j->prepared + (s * j->c + g * cpg) * plane_in;
        } else {  /* depthwise: the input plane is the output plane's channel */
            prepare_plane(j, j->x + (s * j->c + g) * j->h * j->wd, scratch);
            in0 = scratch;
        }
        for (Py_ssize_t r0 = 0; r0 < j->oh; r0 += chunk_rows) {
            const Py_ssize_t r1 = r0 + chunk_rows < j->oh ? r0 + chunk_rows : j->oh, f0 = r0 * lq, f1 = r1 * lq;
            for (Py_ssize_t e0 = 0; e0 < run; e0 += mb) {
                const Py_ssize_t cnt = run - e0 < mb ? run - e0 : mb, mc = mo + e0;
                if (cnt == MB) {
                    const float *w0 = j->w + mc * taps, *w1 = w0 + taps, *w2 = w1 + taps, *w3 = w2 + taps;
                    float *a0 = acc - f0, *a1 = a0 + stride_acc, *a2 = a1 + stride_acc, *a3 = a2 + stride_acc;
                    for (Py_ssize_t f = f0; f < f1; f += 16) {
                        v8sf x0 = {0}, y0 = x0, x1 = x0, y1 = x0, x2 = x0, y2 = x0, x3 = x0, y3 = x0;
                        for (Py_ssize_t t = 0; t < taps; t++) {
                            const float *src = in0 + off[t] + f;
                            const v8sf u = load8(src), v = load8(src + 8);
                            /* scalar * vector: a broadcast load (a vector initializer became lane inserts) */
                            x0 += w0[t] * u; y0 += w0[t] * v;
                            x1 += w1[t] * u; y1 += w1[t] * v;
                            x2 += w2[t] * u; y2 += w2[t] * v;
                            x3 += w3[t] * u; y3 += w3[t] * v;
                        }
                        store8(a0 + f, x0); store8(a0 + f + 8, y0);
                        store8(a1 + f, x1); store8(a1 + f + 8, y1);
                        store8(a2 + f, x2); store8(a2 + f + 8, y2);
                        store8(a3 + f, x3); store8(a3 + f + 8, y3);
                    }
                } else {
                    for (Py_ssize_t e = 0; e < cnt; e++) {
                        const float *wm = j->w + (mc + e) * taps;
                        float *ae = acc + e * stride_acc - f0;
                        for (Py_ssize_t f = f0; f < f1; f += BLOCK) {
                            v8sf v0 = {0}, v1 = v0, v2 = v0, v3 = v0;
                            for (Py_ssize_t t = 0; t < taps; t++) {
                                const float wv = wm[t];
                                const float *src = in0 + off[t] + f;
                                v0 += wv * load8(src);
                                v1 += wv * load8(src + 8);
                                v2 += wv * load8(src + 16);
                                v3 += wv * load8(src + 24);
                            }
                            store8(ae + f, v0);
                            store8(ae + f + 8, v1);
                            store8(ae + f + 16, v2);
                            store8(ae + f + 24, v3);
                        }
                    }
                }
                for (Py_ssize_t e = 0; e < cnt; e++) {  /* the first ow columns of each row, plus the bias */
                    float *restrict yp = j->y + (p + e0 + e) * j->oh * ow;
                    const float *restrict ae = acc + e * stride_acc;
                    const float b0 = j->bias ? j->bias[mc + e] : 0.0f;
                    for (Py_ssize_t r = r0; r < r1; r++)
                        finish_row(yp + r * ow, ae + (r - r0) * lq, ow, b0, j->act, alpha, beta);
                }
            }
        }
        p += run;
    }
}

static void compute_planes_base(const conv_job *j, float *scratch, float *acc, Py_ssize_t *off) {
    compute_planes_body(j, scratch, acc, off);
}

#ifdef KILN_X86_DISPATCH
__attribute__((target("avx2,fma"))) static void compute_planes_avx2(const conv_job *j, float *scratch, float *acc,
                                                                   Py_ssize_t *off) {
    compute_planes_body(j, scratch, acc, off);
}
#endif

static void (*compute_planes)(const conv_job *, float *, float *, Py_ssize_t *) = compute_planes_base;

/* Dense convs: every input plane's phase images, once, before the threads start (each is read by several
   output planes). Compiled twice as compute_planes is: its stride-2 deinterleave is 8-float vector code. */
static inline __attribute__((always_inline)) void prepare_all_body(const conv_job *j, float *dst) {
    const Py_ssize_t plane_in = j->sh * j->sw * j->hq * j->lq;
    for (Py_ssize_t k = 0; k < j->n * j->c; k++) prepare_plane(j, j->x + k * j->h * j->wd, dst + k * plane_in);
}

static void prepare_all_base(const conv_job *j, float *dst) { prepare_all_body(j, dst); }

#ifdef KILN_X86_DISPATCH
__attribute__((target("avx2,fma"))) static void prepare_all_avx2(const conv_job *j, float *dst) {
    prepare_all_body(j, dst);
}
#endif

static void (*prepare_all)(const conv_job *, float *) = prepare_all_base;

static void *conv_worker(void *arg) {
    const conv_job *j = (const conv_job *)arg;
    const size_t plane_in = (size_t)(j->sh * j->sw * j->hq * j->lq) + BLOCK;
    const size_t span = (size_t)j->chunk + BLOCK;  /* one plane's accumulator for a chunk (stride_acc) */
    const size_t taps = (size_t)((j->c / j->group) * j->kh * j->kw);
    float *acc = malloc(sizeof(float) * (j->prepared ? MB * span : span + plane_in));
    Py_ssize_t *off = malloc(sizeof(Py_ssize_t) * taps);
    if (!acc || !off) {
        free(acc);
        free(off);
        return (void *)1;
    }
    compute_planes(j, j->prepared ? NULL : acc + span, acc, off);
    free(acc);
    free(off);
    return NULL;
}


/* ------------------------------------------------------------------------------------------- row kernels
   Gelu (exact, erf), LayerNormalization and Softmax over the last axis: one or two passes over each row
   where numpy makes 5-15 (native.py binds them; the numpy kernels stay the fallback and the reference).

   exp8: Cephes' expf on 8 lanes (range reduction by ln 2 in two parts, a degree-5 polynomial, 2^n from the
   exponent bits): within 2 ulp of expf for results of at least FLT_MIN; results below it are 0 (no
   subnormals), above FLT_MAX inf; NaN stays NaN. */
#define DEFINE_EXP(NAME, VF, VI, SUFFIX)                                                                           \
    static inline __attribute__((always_inline)) VF NAME(VF x) {                                                  \
        const VF zero = {0}, hi = zero + 88.72283935546875f, lo = zero + -87.33654022216797f;                      \
        const VI over = x > hi, under = x < lo;                                                                    \
        VF t = raise_to##SUFFIX(lower_to##SUFFIX(x, hi), lo);                                                      \
        VF fx = t * 1.44269504088896341f + 0.5f;                                                                   \
        VI n = __builtin_convertvector(fx, VI);  /* truncation: floor for fx >= 0, one too high below */           \
        VF fn = __builtin_convertvector(n, VF);                                                                    \
        const VI above = fn > fx;                                                                                  \
        n = n + above;                                 /* true lanes are -1 */                                     \
        fn = __builtin_convertvector(n, VF);                                                                       \
        t = t - fn * 0.693359375f - fn * -2.12194440e-4f;                                                          \
        const VF z = t * t;                                                                                        \
        VF y = ((((1.9875691500e-4f * t + 1.3981999507e-3f) * t + 8.3334519073e-3f) * t + 4.1665795894e-2f) * t +  \
                  1.6666665459e-1f) * t + 5.0000001201e-1f;                                                        \
        y = y * z + t + 1.0f;                                                                                      \
        /* 2^n as 2^(n >> 1) * 2^(n - (n >> 1)): n reaches 128 just below the overflow bound, past the exponent  \
           field's range (a single factor made exp(88.5) inf); both products are exact */                          \
        const VI n1 = n >> 1, bits1 = (n1 + 127) << 23, bits2 = (n - n1 + 127) << 23;                               \
        VF p1, p2;                                                                                                 \
        memcpy(&p1, &bits1, sizeof p1);                                                                            \
        memcpy(&p2, &bits2, sizeof p2);                                                                            \
        y = y * p1 * p2;                                                                                           \
        const VF inf = zero + __builtin_inff();                                                                    \
        y = (VF)(((VI)y & ~over) | ((VI)inf & over));                                                              \
        y = (VF)((VI)y & ~under);                                                                                  \
        return y;                                                                                                  \
    }
DEFINE_EXP(exp8, v8sf, v8si, )
DEFINE_EXP(exp16, v16sf, v16si, 16)

/* Gelu(x) = x * Phi(x) = x / (1 + exp(-x * h(x^2))): activation.py's formula (its polynomial, negated: `negh`,
   highest power first), 8 (16) lanes at a time; a tail shorter than 8 goes through a zero-padded vector. */
#define DEFINE_GELU(NAME, VF, EXP)                                                                                \
    static inline __attribute__((always_inline)) VF NAME(VF x, const float *negh, int terms) {                    \
        const VF sq = x * x;                                                                                      \
        VF acc = sq * negh[0] + negh[1];                                                                          \
        for (int k = 2; k < terms; k++) acc = acc * sq + negh[k];                                                 \
        return x / (1.0f + EXP(acc * x));                                                                         \
    }
DEFINE_GELU(gelu8, v8sf, exp8)
DEFINE_GELU(gelu16, v16sf, exp16)

static inline __attribute__((always_inline)) void gelu_body(const float *x, float *y, Py_ssize_t n,
                                                            const float *negh, int terms) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {  /* two independent vectors in flight */
        const v8sf a = gelu8(load8(x + i), negh, terms), b = gelu8(load8(x + i + 8), negh, terms);
        store8(y + i, a);
        store8(y + i + 8, b);
    }
    for (; i + 8 <= n; i += 8) store8(y + i, gelu8(load8(x + i), negh, terms));
    if (i < n) {
        float in[8] = {0}, out[8];
        memcpy(in, x + i, sizeof(float) * (size_t)(n - i));
        store8(out, gelu8(load8(in), negh, terms));
        memcpy(y + i, out, sizeof(float) * (size_t)(n - i));
    }
}

#ifdef KILN_X86_DISPATCH
/* gelu_body on AVX-512: 16 lanes, four vectors in flight (the polynomial, exp and divide are one long dependency
   chain a vector: with two 8-lane vectors in flight the loop waited on latency, 0.8 ns a float on the Zen 5) */
__attribute__((target("avx512f"))) static void gelu_rows_avx512(const float *x, float *y, Py_ssize_t n,
                                                                 const float *negh, int terms) {
    Py_ssize_t i = 0;
    for (; i + 64 <= n; i += 64) {
        v16sf a, b, c, d;
        memcpy(&a, x + i, 64); memcpy(&b, x + i + 16, 64); memcpy(&c, x + i + 32, 64); memcpy(&d, x + i + 48, 64);
        a = gelu16(a, negh, terms); b = gelu16(b, negh, terms); c = gelu16(c, negh, terms); d = gelu16(d, negh, terms);
        memcpy(y + i, &a, 64); memcpy(y + i + 16, &b, 64); memcpy(y + i + 32, &c, 64); memcpy(y + i + 48, &d, 64);
    }
    for (; i < n; i += 16) {
        float in[16] = {0}, out[16];
        const size_t m = (size_t)(n - i < 16 ? n - i : 16);
        memcpy(in, x + i, sizeof(float) * m);
        v16sf v;
        memcpy(&v, in, 64);
        v = gelu16(v, negh, terms);
        memcpy(out, &v, 64);
        memcpy(y + i, out, sizeof(float) * m);
    }
}
#endif

static inline __attribute__((always_inline)) float hsum8(v8sf v) {
    float a[8];
    memcpy(a, &v, sizeof a);
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* The sum of n floats: 8 lanes x 2 vectors of float32 partial sums (each over n/16 terms, as short as a
   pairwise sum's leaves), added up in double. */
static inline __attribute__((always_inline)) double sum_floats(const float *x, Py_ssize_t n) {
    v8sf a = {0}, b = a;
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a += load8(x + i);
        b += load8(x + i + 8);
    }
    float la[8], lb[8];
    memcpy(la, &a, sizeof la);
    memcpy(lb, &b, sizeof lb);
    double s = 0.0;
    for (int k = 0; k < 8; k++) s += (double)la[k] + (double)lb[k];
    for (; i < n; i++) s += x[i];
    return s;
}

/* sum of (x - mean)^2 the same way */
static inline __attribute__((always_inline)) double sum_squares(const float *x, Py_ssize_t n, float mean) {
    const v8sf m = (v8sf){0} + mean;
    v8sf a = {0}, b = a;
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v8sf d = load8(x + i) - m, e = load8(x + i + 8) - m;
        a += d * d;
        b += e * e;
    }
    float la[8], lb[8];
    memcpy(la, &a, sizeof la);
    memcpy(lb, &b, sizeof lb);
    double s = 0.0;
    for (int k = 0; k < 8; k++) s += (double)la[k] + (double)lb[k];
    for (; i < n; i++) {
        const double d = (double)(x[i] - mean);
        s += d * d;
    }
    return s;
}

/* LayerNorm of each row of n: mean and variance from float32 partial sums added in double, then
   (x - mean) * (1 / sqrt(var + eps)) * scale + bias in float32 as the reference does. */
static inline __attribute__((always_inline)) void layer_norm_body(const float *x, float *y, Py_ssize_t rows,
                                                                  Py_ssize_t n, const float *scale,
                                                                  const float *bias, float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        const float mean = (float)(sum_floats(xr, n) / (double)n);
        const float var = (float)(sum_squares(xr, n, mean) / (double)n) + eps;
        const float inv = 1.0f / __builtin_sqrtf(var);
        if (bias) {
            for (Py_ssize_t i = 0; i < n; i++) yr[i] = (xr[i] - mean) * inv * scale[i] + bias[i];
        } else {
            for (Py_ssize_t i = 0; i < n; i++) yr[i] = (xr[i] - mean) * inv * scale[i];
        }
    }
}

/* Softmax of each row of n: exp(x - row max) / its sum (the sum in double). A row whose max is +-inf or NaN
   comes out as the reference's steps give it: NaN where inf - inf or NaN appears, exp(-inf) = 0 elsewhere. */
static inline __attribute__((always_inline)) void softmax_body(const float *x, float *y, Py_ssize_t rows,
                                                               Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        /* the row max, and whether a NaN is in the row (x != x), 8 lanes at a time */
        v8sf vm = (v8sf){0} - __builtin_inff();
        v8si bad = {0};
        Py_ssize_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8sf v = load8(xr + i);
            bad |= v != v;
            vm = raise_to(vm, v);
        }
        float lanes[8];
        memcpy(lanes, &vm, sizeof lanes);
        float mx = lanes[0];
        for (int k = 1; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
        int nan = 0;
        for (int k = 0; k < 8; k++) nan |= bad[k];
        for (; i < n; i++) {
            nan |= xr[i] != xr[i];
            mx = xr[i] > mx ? xr[i] : mx;
        }
        if (nan) mx = __builtin_nanf("");
        const v8sf vmx = (v8sf){0} + mx;
        v8sf acc = {0};
        i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8sf e = exp8(load8(xr + i) - vmx);
            store8(yr + i, e);
            acc += e;
        }
        double s = hsum8(acc);
        if (i < n) {
            float in[8], out[8];
            for (int k = 0; k < 8; k++) in[k] = i + k < n ? xr[i + k] : -__builtin_inff();
            store8(out, exp8(load8(in) - vmx));
            for (Py_ssize_t k = 0; i + k < n; k++) {
                yr[i + k] = out[k];
                s += out[k];
            }
        }
        const float inv = (float)(1.0 / s);
        for (i = 0; i < n; i++) yr[i] *= inv;
    }
}

#define DISPATCHED(name, params, args)                                                                     \
    static void name##_base params { name##_body args; }                                                    \
    DISPATCHED_AVX2(name, params, args)                                                                     \
    static void(*name) params = name##_base;
#ifdef KILN_X86_DISPATCH
#define DISPATCHED_AVX2(name, params, args) \
    __attribute__((target("avx2,fma"))) static void name##_avx2 params { name##_body args; }
#else
#define DISPATCHED_AVX2(name, params, args)
#endif

/* y = act(x) over n floats (finish_row with no bias): the standalone HardSwish/HardSigmoid/... of a model */
static inline __attribute__((always_inline)) void act_body(const float *x, float *y, Py_ssize_t n, int act,
                                                           double alpha, double beta) {
    finish_row(y, x, n, 0.0f, act, alpha, beta);
}

/* y[r] = mean of row r of n floats (GlobalAveragePool over contiguous [N*C, H*W]) */
static inline __attribute__((always_inline)) void mean_body(const float *x, float *y, Py_ssize_t rows, Py_ssize_t n) {
    for (Py_ssize_t r = 0; r < rows; r++) y[r] = (float)(sum_floats(x + r * n, n) / (double)n);
}

/* y[r, :] = x[r, :] * s[r] over rows of n floats (a squeeze-excite block's Mul: [N, C, H, W] by [N, C, 1, 1]);
   one correctly rounded product per element, numpy's multiply bit for bit */
static inline __attribute__((always_inline)) void scale_body(const float *x, float *y, Py_ssize_t rows, Py_ssize_t n,
                                                             const float *s) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float k = s[r];
        const float *xr = x + r * n;
        float *yr = y + r * n;
        for (Py_ssize_t i = 0; i < n; i++) yr[i] = xr[i] * k;
    }
}

#define act_rows_body act_body
#define mean_rows_body mean_body
#define scale_rows_body scale_body
DISPATCHED(act_rows, (const float *x, float *y, Py_ssize_t n, int act, double alpha, double beta),
           (x, y, n, act, alpha, beta))
DISPATCHED(mean_rows, (const float *x, float *y, Py_ssize_t rows, Py_ssize_t n), (x, y, rows, n))
DISPATCHED(scale_rows, (const float *x, float *y, Py_ssize_t rows, Py_ssize_t n, const float *s), (x, y, rows, n, s))

/* im2col of `size` samples x [size, c, h, w] into cols [c*kh*kw, size*oh*ow] (rows (channel, tap row, tap
   column) like the weights, columns (sample, output position)): the GEMM convolution's columns (gemm_conv2d in
   native.py) in one pass, padding as zeros, no phase images. A stride-1 row is one memcpy. */
typedef struct {
    Py_ssize_t size, c, h, w, kh, kw, sh, sw, dh, dw, pt, pl, oh, ow;
} cols_geometry;

static inline __attribute__((always_inline)) void im2col_body(const float *x, float *cols, const cols_geometry *g) {
    const Py_ssize_t span = g->oh * g->ow, ncols = g->size * span, plane = g->h * g->w;
    for (Py_ssize_t ci = 0; ci < g->c; ci++)
        for (Py_ssize_t i = 0; i < g->kh; i++)
            for (Py_ssize_t j = 0; j < g->kw; j++) {
                float *row = cols + ((ci * g->kh + i) * g->kw + j) * ncols;
                const Py_ssize_t shift = j * g->dw - g->pl;  /* input column = o * sw + shift */
                Py_ssize_t lo = ceil_div(-shift, g->sw), hi = ceil_div(g->w - shift, g->sw);
                lo = lo < 0 ? 0 : (lo > g->ow ? g->ow : lo);
                hi = hi < lo ? lo : (hi > g->ow ? g->ow : hi);
                for (Py_ssize_t s = 0; s < g->size; s++) {
                    const float *xs = x + (s * g->c + ci) * plane;
                    for (Py_ssize_t o = 0; o < g->oh; o++) {
                        float *d = row + s * span + o * g->ow;
                        const Py_ssize_t ih = o * g->sh - g->pt + i * g->dh;
                        if (ih < 0 || ih >= g->h) {
                            memset(d, 0, (size_t)g->ow * sizeof(float));
                            continue;
                        }
                        const float *src = xs + ih * g->w + shift;
                        for (Py_ssize_t q = 0; q < lo; q++) d[q] = 0.0f;
                        if (g->sw == 1) {
                            memcpy(d + lo, src + lo, (size_t)(hi - lo) * sizeof(float));
                        } else {
                            const Py_ssize_t sw = g->sw;
                            Py_ssize_t q = lo;
                            if (sw == 2) {  /* the even floats of 16, 8 at a time (the strided loop ran at 14 GB/s) */
                                const v8si evens = {0, 2, 4, 6, 8, 10, 12, 14};
                                /* q + 8 < hi: the last vector's 16th float, src[2q + 15], is inside the row */
                                for (; q + 8 < hi; q += 8)
                                    store8(d + q, __builtin_shuffle(load8(src + 2 * q), load8(src + 2 * q + 8), evens));
                            }
                            for (; q < hi; q++) d[q] = src[q * sw];
                        }
                        for (Py_ssize_t q = hi; q < g->ow; q++) d[q] = 0.0f;
                    }
                }
            }
}

/* y[s, mm, :] = act(acc[mm, s*span : (s+1)*span] + bias[mm]): the GEMM's [M, size*span] result out to NCHW with
   the bias and the activation in the same pass (in place where size is 1 and acc is y). */
static inline __attribute__((always_inline)) void gemm_out_body(const float *acc, float *y, const float *bias,
                                                                Py_ssize_t m, Py_ssize_t size, Py_ssize_t span,
                                                                int act, double alpha, double beta) {
    for (Py_ssize_t mm = 0; mm < m; mm++)
        for (Py_ssize_t s = 0; s < size; s++)
            finish_row(y + (s * m + mm) * span, acc + (mm * size + s) * span, span, bias ? bias[mm] : 0.0f, act,
                       alpha, beta);
}

#define im2col_rows_body im2col_body
#define gemm_out_rows_body gemm_out_body
DISPATCHED(im2col_rows, (const float *x, float *cols, const cols_geometry *g), (x, cols, g))
DISPATCHED(gemm_out_rows, (const float *acc, float *y, const float *bias, Py_ssize_t m, Py_ssize_t size,
                           Py_ssize_t span, int act, double alpha, double beta),
           (acc, y, bias, m, size, span, act, alpha, beta))

/* ------------------------------------------------------------------------------------------- sgemm (AVX-512)
   C[m, n] = act(A @ B + bias) in float32 for CPUs with AVX-512F, where numpy's OpenBLAS may run AVX2 kernels
   (OPENBLAS_CORETYPE set by the host, or a CPU it does not know: kiln/blas_env.py). GotoBLAS's loop order: per
   thread (threads split the column panels), per block of GEMM_NC columns and GEMM_KC rows of B, B's panels of
   GEMM_NR columns ([kc][NR], zero-padded) and, per block of GEMM_MC rows, A's panels of GEMM_MR rows ([kc][MR]);
   each B panel held in L1 while the block's A panels stream past it from L2, through an MR x NR micro-kernel of
   16 zmm accumulators. A constant operand (a conv's or a Linear layer's weights) comes packed once at load
   (mode 1: A as [ceil(m/MR), k, MR], B as [ceil(n/NR), k, NR]); the other is packed per block from row-major
   memory (mode 0), B also from its transpose (mode 2: Bt [n, k]). The bias (per row or per column) and the
   activation are applied to each tile after its last k block, while it is in cache. */
#define GEMM_MR 12
#define GEMM_NR 32
#define GEMM_KC 256
#define GEMM_MC 256
#define GEMM_NC 512

enum { OPERAND_ROWS, OPERAND_PACKED, OPERAND_TRANSPOSED };
enum { BIAS_NONE, BIAS_ROWS, BIAS_COLS };

typedef struct {
    const float *a, *b, *bias;
    float *c;
    Py_ssize_t m, n, k;
    int a_mode, b_mode, bias_mode, act;
    double alpha, beta;
    Py_ssize_t col_begin, col_end;  /* this thread's columns */
    Py_ssize_t row_begin, row_end;  /* and rows (a multiple of GEMM_MR from row_begin) */
    Py_ssize_t item_begin, item_end;  /* and products of a batch */
    Py_ssize_t stride_a, stride_b, stride_c;  /* floats from one product's operand to the next (0: shared) */
    Py_ssize_t lda, ldb;  /* row strides of unpacked A and B (B's transpose in mode 2), in floats */
    const long long *a_offsets, *b_offsets;  /* or each product's operand at these offsets (NULL: the strides) */
    float *ap, *bp;  /* packing buffers */
} gemm_job;

#ifdef KILN_X86_DISPATCH
#include <immintrin.h>

__attribute__((target("avx512f"))) static inline void gemm_tile(Py_ssize_t kc, const float *restrict a,
                                                              const float *restrict b, float *c, Py_ssize_t ldc,
                                                              int accumulate, Py_ssize_t rows, Py_ssize_t cols,
                                                              const float *pf, const float *pfb) {
    __m512 acc[GEMM_MR][2];
#pragma GCC unroll 12
    for (int r = 0; r < GEMM_MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (Py_ssize_t q = 0; q < kc; q++) {
        if (pf && (q & 3) == 0) {  /* the next A panel from memory, 3 lines every 4 steps (its 48 floats) */
            _mm_prefetch((const char *)(pf + q * GEMM_MR), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + q * GEMM_MR + 16), _MM_HINT_T0);
            _mm_prefetch((const char *)(pf + q * GEMM_MR + 32), _MM_HINT_T0);
        }
        if (pfb) {  /* the next packed B panel, its 2 lines of this step */
            _mm_prefetch((const char *)(pfb + q * GEMM_NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(pfb + q * GEMM_NR + 16), _MM_HINT_T0);
        }
        const __m512 b0 = _mm512_loadu_ps(b + q * GEMM_NR), b1 = _mm512_loadu_ps(b + q * GEMM_NR + 16);
        const float *aq = a + q * GEMM_MR;
#pragma GCC unroll 12
        for (int r = 0; r < GEMM_MR; r++) {  /* the broadcast folds into the FMA's memory operand ({1to16}) */
            const __m512 ar = _mm512_set1_ps(aq[r]);
            acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);
        }
    }
    if (rows == GEMM_MR && cols == GEMM_NR) {
#pragma GCC unroll 12
        for (int r = 0; r < GEMM_MR; r++) {
            float *cr = c + r * ldc;
            if (accumulate) {
                acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(cr));
                acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(cr + 16));
            }
            _mm512_storeu_ps(cr, acc[r][0]);
            _mm512_storeu_ps(cr + 16, acc[r][1]);
        }
        return;
    }
    float tile[GEMM_MR][GEMM_NR];
    memcpy(tile, acc, sizeof tile);
    for (Py_ssize_t r = 0; r < rows; r++)
        for (Py_ssize_t q = 0; q < cols; q++) c[r * ldc + q] = accumulate ? c[r * ldc + q] + tile[r][q] : tile[r][q];
}

/* Tiles of fewer rows (a panel's last rows: a batch-1 Linear's 1 row, a ViT-style model's 17 tokens = 12 + 5):
   the 12-row micro-kernel computed every row of the zero-padded panel, 12x the work for one row; these compute the
   R rows there are, still reading the 12-row packed A panel. */
#define GEMM_TILE_ROWS(R)                                                                                              \
__attribute__((target("avx512f"))) static void gemm_tile_##R(Py_ssize_t kc, const float *restrict a,                   \
                                                             const float *restrict b, float *c, Py_ssize_t ldc,        \
                                                             int accumulate, Py_ssize_t rows, Py_ssize_t cols) {       \
    __m512 acc[R][2];                                                                                                  \
    _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                  \
    for (Py_ssize_t q = 0; q < kc; q++) {                                                                              \
        const __m512 b0 = _mm512_loadu_ps(b + q * GEMM_NR), b1 = _mm512_loadu_ps(b + q * GEMM_NR + 16);                \
        const float *aq = a + q * GEMM_MR;                                                                             \
        _Pragma("GCC unroll 12") for (int r = 0; r < R; r++) {                                                         \
            const __m512 ar = _mm512_set1_ps(aq[r]);                                                                   \
            acc[r][0] = _mm512_fmadd_ps(ar, b0, acc[r][0]);                                                            \
            acc[r][1] = _mm512_fmadd_ps(ar, b1, acc[r][1]);                                                            \
        }                                                                                                              \
    }                                                                                                                  \
    float tile[R][GEMM_NR];                                                                                            \
    memcpy(tile, acc, sizeof tile);                                                                                    \
    for (Py_ssize_t r = 0; r < rows; r++)                                                                              \
        for (Py_ssize_t q = 0; q < cols; q++) c[r * ldc + q] = accumulate ? c[r * ldc + q] + tile[r][q] : tile[r][q];  \
}
GEMM_TILE_ROWS(1) GEMM_TILE_ROWS(2) GEMM_TILE_ROWS(3) GEMM_TILE_ROWS(4) GEMM_TILE_ROWS(5) GEMM_TILE_ROWS(6)
GEMM_TILE_ROWS(7) GEMM_TILE_ROWS(8) GEMM_TILE_ROWS(9) GEMM_TILE_ROWS(10) GEMM_TILE_ROWS(11)
typedef void (*gemm_tile_fn)(Py_ssize_t, const float *, const float *, float *, Py_ssize_t, int, Py_ssize_t,
                             Py_ssize_t);
static const gemm_tile_fn gemm_tiles_short[GEMM_MR] = {NULL, gemm_tile_1, gemm_tile_2, gemm_tile_3, gemm_tile_4,
                                                       gemm_tile_5, gemm_tile_6, gemm_tile_7, gemm_tile_8,
                                                       gemm_tile_9, gemm_tile_10, gemm_tile_11};

/* B[pc:pc+kc, j0:j0+w] (w <= NR) as one panel [kc][NR], zero columns past w */
static void pack_b_panel(const gemm_job *j, Py_ssize_t pc, Py_ssize_t kc, Py_ssize_t j0, Py_ssize_t w, float *dst) {
    if (j->b_mode == OPERAND_TRANSPOSED) {  /* Bt [n, k]: column jj of the panel is row j0 + jj of Bt */
        if (w < GEMM_NR) memset(dst, 0, sizeof(float) * (size_t)(kc * GEMM_NR));
        for (Py_ssize_t jj = 0; jj < w; jj++) {
            const float *src = j->b + (j0 + jj) * j->ldb + pc;
            for (Py_ssize_t q = 0; q < kc; q++) dst[q * GEMM_NR + jj] = src[q];
        }
        return;
    }
    const float *src = j->b + pc * j->ldb + j0;
    for (Py_ssize_t q = 0; q < kc; q++) {
        memcpy(dst + q * GEMM_NR, src + q * j->ldb, (size_t)w * sizeof(float));
        if (w < GEMM_NR) memset(dst + q * GEMM_NR + w, 0, (size_t)(GEMM_NR - w) * sizeof(float));
    }
}

/* A[i0:i0+rows, pc:pc+kc] (row-major [m, k]) as panels [kc][MR], zero rows past m */
static void pack_a_block(const gemm_job *j, Py_ssize_t i0, Py_ssize_t rows, Py_ssize_t pc, Py_ssize_t kc,
                         float *dst) {
    for (Py_ssize_t p = 0; p < rows; p += GEMM_MR) {
        float *panel = dst + (p / GEMM_MR) * kc * GEMM_MR;
        const Py_ssize_t live = rows - p < GEMM_MR ? rows - p : GEMM_MR;
        if (live < GEMM_MR) memset(panel, 0, sizeof(float) * (size_t)(kc * GEMM_MR));
        for (Py_ssize_t r = 0; r < live; r++) {
            const float *src = j->a + (i0 + p + r) * j->lda + pc;
            for (Py_ssize_t q = 0; q < kc; q++) panel[q * GEMM_MR + r] = src[q];
        }
    }
}

__attribute__((target("avx512f"))) static void gemm_product(const gemm_job *j) {
    const Py_ssize_t mc_max = j->a_mode == OPERAND_PACKED ? j->row_end - j->row_begin : GEMM_MC;
    float *bp = j->bp, *ap = j->ap;
    for (Py_ssize_t jc = j->col_begin; jc < j->col_end; jc += GEMM_NC) {
        const Py_ssize_t nc = j->col_end - jc < GEMM_NC ? j->col_end - jc : GEMM_NC;
        const Py_ssize_t npanels = (nc + GEMM_NR - 1) / GEMM_NR;
        for (Py_ssize_t pc = 0; pc < j->k; pc += GEMM_KC) {
            const Py_ssize_t kc = j->k - pc < GEMM_KC ? j->k - pc : GEMM_KC;
            const int last = pc + kc >= j->k;
            if (bp)
                for (Py_ssize_t p = 0; p < npanels; p++) {
                    const Py_ssize_t j0 = jc + p * GEMM_NR;
                    pack_b_panel(j, pc, kc, j0, j->col_end - j0 < GEMM_NR ? j->col_end - j0 : GEMM_NR,
                                 bp + p * kc * GEMM_NR);
                }
            for (Py_ssize_t ic = j->row_begin; ic < j->row_end; ic += mc_max) {
                const Py_ssize_t mc = j->row_end - ic < mc_max ? j->row_end - ic : mc_max;
                if (ap) pack_a_block(j, ic, mc, pc, kc, ap);
                for (Py_ssize_t p = 0; p < npanels; p++) {
                    const Py_ssize_t j0 = jc + p * GEMM_NR, w = j->col_end - j0 < GEMM_NR ? j->col_end - j0 : GEMM_NR;
                    const float *bpanel = bp ? bp + p * kc * GEMM_NR : j->b + ((j0 / GEMM_NR) * j->k + pc) * GEMM_NR;
                    for (Py_ssize_t i0 = ic; i0 < ic + mc; i0 += GEMM_MR) {
                        const Py_ssize_t rows = ic + mc - i0 < GEMM_MR ? ic + mc - i0 : GEMM_MR;
                        const float *apanel = ap ? ap + ((i0 - ic) / GEMM_MR) * kc * GEMM_MR
                                                 : j->a + ((i0 / GEMM_MR) * j->k + pc) * GEMM_MR;
                        float *c = j->c + i0 * j->n + j0;
                        /* packed A streams from memory on the first column panel: its next panel is prefetched */
                        const float *pf = !ap && p == 0 && i0 + 2 * GEMM_MR <= ic + mc ? apanel + j->k * GEMM_MR : NULL;
                        /* packed B (a Linear layer's weights): the first row tile of each column panel, if a full
                           one, prefetches the next panel (this block's next, or the next k block's first). Tiles of
                           fewer rows do not: one row's product is a single stream the hardware prefetcher keeps up
                           with, and two more instructions a step cost a batch-1 MLP 0.036 -> 0.046 ms */
                        const float *pfb = NULL;
                        if (!bp && i0 == ic && rows == GEMM_MR) {
                            if (p + 1 < npanels) pfb = bpanel + j->k * GEMM_NR;
                            else if (pc + kc < j->k) pfb = j->b + ((jc / GEMM_NR) * j->k + pc + kc) * GEMM_NR;
                        }
                        if (rows == GEMM_MR) gemm_tile(kc, apanel, bpanel, c, j->n, pc > 0, rows, w, pf, pfb);
                        else gemm_tiles_short[rows](kc, apanel, bpanel, c, j->n, pc > 0, rows, w);
                        if (!last || (j->bias_mode == BIAS_NONE && j->act == ACT_NONE)) continue;
                        for (Py_ssize_t r = 0; r < rows; r++) {
                            float *cr = c + r * j->n;
                            if (j->bias_mode == BIAS_COLS) {
                                const float *bc = j->bias + j0;
                                for (Py_ssize_t q = 0; q < w; q++) cr[q] += bc[q];
                            }
                            if (j->bias_mode == BIAS_ROWS || j->act != ACT_NONE)
                                finish_row(cr, cr, w, j->bias_mode == BIAS_ROWS ? j->bias[i0 + r] : 0.0f, j->act,
                                           j->alpha, j->beta);
                        }
                    }
                }
            }
        }
    }
}

/* Packing buffers, kept between calls on a free list: malloc'd afresh in each call's new threads they were
   mmap'd and page-faulted every time (a 128x64x784 product took 86-107 us on two threads, 57 on one). */
typedef struct pack_buffers {
    struct pack_buffers *next;
    float *a, *b;
} pack_buffers;
static pack_buffers *free_buffers;
static pthread_mutex_t buffers_lock = PTHREAD_MUTEX_INITIALIZER;

static pack_buffers *take_buffers(void) {
    pthread_mutex_lock(&buffers_lock);
    pack_buffers *p = free_buffers;
    if (p) free_buffers = p->next;
    pthread_mutex_unlock(&buffers_lock);
    if (p) return p;
    p = malloc(sizeof *p);
    if (!p) return NULL;
    p->a = malloc(sizeof(float) * GEMM_KC * (GEMM_MC + GEMM_MR));
    p->b = malloc(sizeof(float) * GEMM_KC * GEMM_NC);
    if (!p->a || !p->b) {
        free(p->a);
        free(p->b);
        free(p);
        return NULL;
    }
    return p;
}

static void give_buffers(pack_buffers *p) {
    pthread_mutex_lock(&buffers_lock);
    p->next = free_buffers;
    free_buffers = p;
    pthread_mutex_unlock(&buffers_lock);
}

static void *gemm_worker(void *arg) {
    gemm_job j = *(const gemm_job *)arg;
    pack_buffers *buffers = take_buffers();
    if (!buffers) return (void *)1;
    j.bp = j.b_mode == OPERAND_PACKED ? NULL : buffers->b;
    j.ap = j.a_mode == OPERAND_PACKED ? NULL : buffers->a;
    const float *a = j.a, *b = j.b;
    float *c = j.c;
    for (Py_ssize_t item = j.item_begin; item < j.item_end; item++) {
        j.a = a + (j.a_offsets ? j.a_offsets[item] : item * j.stride_a);
        j.b = b + (j.b_offsets ? j.b_offsets[item] : item * j.stride_b);
        j.c = c + item * j.stride_c;
        gemm_product(&j);
    }
    give_buffers(buffers);
    return NULL;
}
#endif

/* ------------------------------------------------------------------------------------------- a thread pool
   The sgemm's threads: created on first use and kept; between calls each spins for at most POOL_SPIN_NS, then
   blocks on a condition variable (a call wakes them with one broadcast). Threads created and joined per call
   cost more than they saved on this VM: a 32x784x512 product took 190 us on two fresh threads, 163 on one, 90
   on two pool threads. The workers' affinity leaves out the dispatching thread's CPU (see run_tasks). A call's
   tasks are claimed one at a time by whichever thread asks first, the caller included (run_tasks). One call
   uses the pool at a time; a call that finds it taken (several Python threads running programs at once)
   creates threads of its own. After fork() the child has no pool threads: pthread_atfork resets the pool. */
typedef void *(*task_fn)(void *);
static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_t threads[MAX_THREADS];
    int size;          /* threads created */
    int busy;          /* a call has the pool */
    int tasks;         /* this generation's tasks: args[0 .. tasks - 1] */
    int next;          /* the next task not yet claimed */
    int running;       /* tasks claimed by workers and not finished */
    int failed;        /* a task returned non-NULL */
    unsigned long generation;
    unsigned long born[MAX_THREADS];  /* the generation at each worker's creation: it waits for a later one */
    int caller_cpu;    /* the CPU the dispatching thread was on (-1: unknown) */
    pid_t tids[MAX_THREADS];       /* the workers' thread ids (0 until each has started) */
    int kept_off[MAX_THREADS];     /* the CPU each worker's affinity now leaves out (-1: none) */
    task_fn fn;
    void *args[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

/* How long a worker keeps looking for the next task before it blocks: a model's products follow each other within
   microseconds, and waking a blocked thread on an idle vCPU took ~40 us here (a 128x64x784 product: 75 us on two
   threads that blocked, against 62 on one). Bounded, so an idle pool costs nothing. */
#define POOL_SPIN_NS 100000
#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause()
#else
#define cpu_relax() ((void)0)
#endif

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Spin while *word == value, for at most POOL_SPIN_NS, and not at all on the CPU of the thread that dispatched
   the last tasks (it would take that thread's CPU: both stayed on one CPU, the other idle, for whole runs). */
static void spin_while_equal(const unsigned long *word, unsigned long value, int caller_cpu) {
    const long long end = now_ns() + POOL_SPIN_NS;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == value) {
#ifdef __linux__
        if (sched_getcpu() == caller_cpu) break;
#endif
        for (int i = 0; i < 64; i++) cpu_relax();
        if (now_ns() > end) break;
    }
}

/* Claim and run this generation's tasks until none is left; called with the lock held, returns with it held. */
static void run_claimed(void) {
    while (pool.next < pool.tasks) {
        void *task = pool.args[pool.next++];
        task_fn fn = pool.fn;
        pool.running++;
        pthread_mutex_unlock(&pool.lock);
        void *rc = fn(task);
        pthread_mutex_lock(&pool.lock);
        pool.running--;
        pool.failed |= rc != NULL;
    }
}

static void *pool_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.lock);
#ifdef __linux__
    pool.tids[index] = (pid_t)syscall(SYS_gettid);
#endif
    unsigned long seen = pool.born[index];
    for (;;) {
        if (pool.generation == seen) {
            const int caller_cpu = pool.caller_cpu;
            pthread_mutex_unlock(&pool.lock);
            spin_while_equal(&pool.generation, seen, caller_cpu);
            pthread_mutex_lock(&pool.lock);
        }
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        run_claimed();  /* nothing left when this worker woke late: the caller ran them */
        if (pool.running == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.size = pool.busy = pool.tasks = pool.next = pool.running = pool.failed = 0;
}

/* fn(args[t]) for t < n; nonzero if any returned non-NULL. The tasks are handed out one at a time to whichever
   thread asks first, this one included: a worker that has not woken by the time this thread has finished its own
   task never holds the call up, this thread claims the rest (on a busy host a worker blocked in the scheduler's
   queue made every parallel op wait for it: a ViT-style model ran at 152 ms against 0.8 quiet with two threads a
   run, before tasks were claimed; see docs/NOTES.md). The call then waits only for tasks a worker has started. */
static int run_tasks(task_fn fn, void **args, int n) {
    int workers = 0, failed = 0;
    if (n > 1) {
        pthread_mutex_lock(&pool.lock);
        if (!pool.busy) {
            while (pool.size < n - 1 && pool.size < MAX_THREADS) {
                pool.born[pool.size] = pool.generation;
                pool.tids[pool.size] = 0;
                pool.kept_off[pool.size] = -1;
                if (pthread_create(&pool.threads[pool.size], NULL, pool_main, (void *)(intptr_t)pool.size) != 0) break;
                pool.size++;
            }
            workers = pool.size < n - 1 ? pool.size : n - 1;
            if (workers > 0) {
                pool.busy = 1;
                pool.fn = fn;
                for (int t = 0; t < n; t++) pool.args[t] = args[t];
                pool.tasks = n;
                pool.next = 1;  /* task 0 is this thread's */
                pool.running = 1;
                pool.failed = 0;
#ifdef __linux__
                /* The workers' affinity leaves out this thread's CPU, set before they are woken: the scheduler
                   woke them on this CPU here, and kept this thread and a worker on one CPU call after call, the
                   other idle (a two-thread product then took twice the one-thread time: the worker ran only when
                   this thread waited). Set again only when this thread has moved. */
                pool.caller_cpu = sched_getcpu();
                cpu_set_t allowed;
                if (pool.caller_cpu >= 0 && sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
                    CPU_CLR(pool.caller_cpu, &allowed);
                    for (int t = 0; t < workers; t++)
                        if (pool.tids[t] && pool.kept_off[t] != pool.caller_cpu && CPU_COUNT(&allowed) > 0
                            && sched_setaffinity(pool.tids[t], sizeof allowed, &allowed) == 0)
                            pool.kept_off[t] = pool.caller_cpu;
                }
#else
                pool.caller_cpu = -1;
#endif
                __atomic_add_fetch(&pool.generation, 1, __ATOMIC_RELEASE);
                pthread_cond_broadcast(&pool.wake);
            }
        }
        pthread_mutex_unlock(&pool.lock);
    }
    if (workers > 0) {
        void *rc = fn(args[0]);
        pthread_mutex_lock(&pool.lock);
        pool.running--;
        pool.failed |= rc != NULL;
        run_claimed();
        while (pool.running > 0) {  /* only tasks a worker started */
            pthread_mutex_unlock(&pool.lock);
            const long long end = now_ns() + POOL_SPIN_NS;
            /* yielding: a worker the scheduler put on this CPU gets it */
            while (__atomic_load_n(&pool.running, __ATOMIC_ACQUIRE) > 0 && now_ns() < end) sched_yield();
            pthread_mutex_lock(&pool.lock);
            if (pool.running > 0) pthread_cond_wait(&pool.done, &pool.lock);
        }
        failed = pool.failed;
        pool.tasks = pool.next = 0;
        pool.busy = 0;
        pthread_mutex_unlock(&pool.lock);
        return failed;
    }
    /* no pool (it is taken by another call, or one task): the tasks on threads of their own, the first on this one */
    pthread_t own[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 1; t < n; t++) started[t] = pthread_create(&own[t], NULL, fn, args[t]) == 0;
    failed |= fn(args[0]) != NULL;
    for (int t = 1; t < n; t++) {
        void *rc;
        if (started[t]) pthread_join(own[t], &rc);
        else rc = fn(args[t]);
        failed |= rc != NULL;
    }
    return failed;
}

/* ------------------------------------------------------------------------------------------- Winograd F(2x2, 3x3)
   A 3x3, stride-1 convolution as 16 products: each 2x2 output tile is A^T [(G g G^T) . (B^T d B)] A over the
   4x4 input tile d it reads, so the products multiply 16 [M, C] transformed weights by 16 [C, tiles] transformed
   inputs: 16 * tiles = 4 * H * W columns against im2col's 9 * H * W (2.25x fewer multiply-adds). The transforms
   are adds only (B^T d B: rows then columns), written here; the weights' (G g G^T, with halves) is made once at
   load in float64 (native.py). */
typedef struct {
    Py_ssize_t n, c, h, w, pt, pl, th, tw;  /* samples, channels, input size, pads (top, left), tiles */
    Py_ssize_t kstride;  /* floats from one of the 16 transformed planes to the next (at least channels x tiles) */
} wino_geometry;

/* V[k, ci, t] (k = 4 * row + column of the transformed tile, t = (s * th + ty) * tw + tx) */
static inline __attribute__((always_inline)) void wino_input_body(const float *x, float *v, const wino_geometry *g,
                                                                 float *scratch) {
    const Py_ssize_t th = g->th, tw = g->tw, half = tw + 1;  /* even and odd columns of the padded rows */
    const Py_ssize_t tiles = g->n * th * tw, rows = 2 * th + 2;
    float *even = scratch, *odd = scratch + rows * half;  /* the padded plane split by column parity */
    float *te = odd + rows * half, *to = te + 4 * half;   /* the 4 rows of B^T d, split the same way */
    for (Py_ssize_t s = 0; s < g->n; s++)
        for (Py_ssize_t ci = 0; ci < g->c; ci++) {
            const float *plane = x + (s * g->c + ci) * g->h * g->w;
            for (Py_ssize_t r = 0; r < rows; r++) {
                const Py_ssize_t ir = r - g->pt;
                float *er = even + r * half, *or_ = odd + r * half;
                if (ir < 0 || ir >= g->h) {
                    for (Py_ssize_t q = 0; q < half; q++) er[q] = or_[q] = 0.0f;
                    continue;
                }
                const float *src = plane + ir * g->w;
                /* q in [lo, hi): both of its columns 2q - pl and 2q + 1 - pl inside the row (no checks) */
                Py_ssize_t lo = (g->pl + 1) / 2, hi = (g->w + g->pl - 1) / 2;
                if (hi > half) hi = half;
                if (lo > hi) lo = hi;
                for (Py_ssize_t q = 0; q < lo; q++) {
                    const Py_ssize_t c0 = 2 * q - g->pl, c1 = c0 + 1;
                    er[q] = c0 >= 0 && c0 < g->w ? src[c0] : 0.0f;
                    or_[q] = c1 >= 0 && c1 < g->w ? src[c1] : 0.0f;
                }
                const float *base = src - g->pl;
                Py_ssize_t q = lo;
                {   /* 8 pairs at a time: the even and odd floats of 16 (reads stay inside the row: 2q + 15 < w + pl) */
                    const v8si evens = {0, 2, 4, 6, 8, 10, 12, 14}, odds = {1, 3, 5, 7, 9, 11, 13, 15};
                    for (; q + 8 <= hi; q += 8) {
                        const v8sf a = load8(base + 2 * q), b = load8(base + 2 * q + 8);
                        store8(er + q, __builtin_shuffle(a, b, evens));
                        store8(or_ + q, __builtin_shuffle(a, b, odds));
                    }
                }
                for (; q < hi; q++) {
                    er[q] = base[2 * q];
                    or_[q] = base[2 * q + 1];
                }
                for (Py_ssize_t q = hi; q < half; q++) {
                    const Py_ssize_t c0 = 2 * q - g->pl, c1 = c0 + 1;
                    er[q] = c0 >= 0 && c0 < g->w ? src[c0] : 0.0f;
                    or_[q] = c1 >= 0 && c1 < g->w ? src[c1] : 0.0f;
                }
            }
            if (tw >= 8) {  /* 8 tiles at a time, all in registers; the last block overlaps the one before */
                for (Py_ssize_t ty = 0; ty < th; ty++) {
                    const Py_ssize_t t0 = (s * th + ty) * tw;
                    for (Py_ssize_t b = 0; b < tw; b += 8) {
                        const Py_ssize_t tx = b + 8 <= tw ? b : tw - 8;
                        /* per column group (columns 2tx, 2tx+1, 2tx+2, 2tx+3 of each tile: E[tx], O[tx], E[tx+1],
                           O[tx+1]), B^T d down the 4 rows: d0 - d2, d1 + d2, d2 - d1, d1 - d3 */
                        v8sf t[4][4];
                        for (int grp = 0; grp < 4; grp++) {
                            const float *base = (grp & 1 ? odd : even) + 2 * ty * half + tx + (grp >> 1);
                            const v8sf d0 = load8(base), d1 = load8(base + half), d2 = load8(base + 2 * half),
                                       d3 = load8(base + 3 * half);
                            t[0][grp] = d0 - d2;
                            t[1][grp] = d1 + d2;
                            t[2][grp] = d2 - d1;
                            t[3][grp] = d1 - d3;
                        }
                        /* (B^T d) B along the row: u0 - u2, u1 + u2, u2 - u1, u1 - u3 (u: groups 0, 1, 2, 3) */
                        for (int i = 0; i < 4; i++) {
                            float *vi = v + (4 * i) * g->kstride + ci * tiles + t0 + tx;
                            const Py_ssize_t step = g->kstride;
                            store8(vi, t[i][0] - t[i][2]);
                            store8(vi + step, t[i][1] + t[i][2]);
                            store8(vi + 2 * step, t[i][2] - t[i][1]);
                            store8(vi + 3 * step, t[i][1] - t[i][3]);
                        }
                    }
                }
                continue;
            }
            for (Py_ssize_t ty = 0; ty < th; ty++) {
                /* B^T d: rows 2ty .. 2ty+3 -> d0 - d2, d1 + d2, d2 - d1, d1 - d3, for even and odd columns */
                for (int par = 0; par < 2; par++) {
                    const float *pl = (par ? odd : even) + 2 * ty * half;
                    float *out = par ? to : te;
                    const float *d0 = pl, *d1 = pl + half, *d2 = pl + 2 * half, *d3 = pl + 3 * half;
                    for (Py_ssize_t q = 0; q < half; q++) {
                        out[q] = d0[q] - d2[q];
                        out[half + q] = d1[q] + d2[q];
                        out[2 * half + q] = d2[q] - d1[q];
                        out[3 * half + q] = d1[q] - d3[q];
                    }
                }
                /* (B^T d) B: columns 2tx .. 2tx+3 are E[tx], O[tx], E[tx+1], O[tx+1] */
                const Py_ssize_t t0 = (s * th + ty) * tw;
                for (int i = 0; i < 4; i++) {
                    const float *e = te + i * half, *o = to + i * half;
                    float *v0 = v + (4 * i + 0) * g->kstride + ci * tiles + t0, *v1 = v + (4 * i + 1) * g->kstride + ci * tiles + t0;
                    float *v2 = v + (4 * i + 2) * g->kstride + ci * tiles + t0, *v3 = v + (4 * i + 3) * g->kstride + ci * tiles + t0;
                    for (Py_ssize_t tx = 0; tx < tw; tx++) {
                        v0[tx] = e[tx] - e[tx + 1];
                        v1[tx] = o[tx] + e[tx + 1];
                        v2[tx] = e[tx + 1] - o[tx];
                        v3[tx] = o[tx] - o[tx + 1];
                    }
                }
            }
        }
}

/* y[s, mo, 2ty + a, 2tx + b] = act(bias[mo] + (A^T M A)[a, b]) from the products M[k, mo, t] */
static inline __attribute__((always_inline)) void wino_output_body(const float *mp, float *y, const float *bias,
                                                                  Py_ssize_t mch, Py_ssize_t oh, Py_ssize_t ow,
                                                                  const wino_geometry *g, int act, double alpha,
                                                                  double beta, float *scratch) {
    const Py_ssize_t th = g->th, tw = g->tw, tiles = g->n * th * tw;
    float *r0 = scratch, *r1 = scratch + 2 * tw;  /* one tile row's two output rows, 2 * tw wide */
    for (Py_ssize_t s = 0; s < g->n; s++)
        for (Py_ssize_t mo = 0; mo < mch; mo++) {
            float *plane = y + (s * mch + mo) * oh * ow;
            const float b0 = bias ? bias[mo] : 0.0f;
            for (Py_ssize_t ty = 0; ty < th; ty++) {
                const Py_ssize_t t0 = (s * th + ty) * tw;
                const float *m[16];
                for (int k = 0; k < 16; k++) m[k] = mp + k * g->kstride + mo * tiles + t0;
                Py_ssize_t done = 0;
                if (tw >= 8) {  /* 8 tiles at a time; the last block overlaps the one before */
                    const v8si lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
                    for (Py_ssize_t b = 0; b < tw; b += 8) {
                        const Py_ssize_t tx = b + 8 <= tw ? b : tw - 8;
                        v8sf a[4], c[4];
                        for (int j = 0; j < 4; j++) {
                            const v8sf m0 = load8(m[j] + tx), m1 = load8(m[4 + j] + tx), m2 = load8(m[8 + j] + tx),
                                       m3 = load8(m[12 + j] + tx);
                            a[j] = m0 + m1 + m2;
                            c[j] = m1 - m2 - m3;
                        }
                        const v8sf y00 = a[0] + a[1] + a[2], y01 = a[1] - a[2] - a[3];
                        const v8sf y10 = c[0] + c[1] + c[2], y11 = c[1] - c[2] - c[3];
                        store8(r0 + 2 * tx, __builtin_shuffle(y00, y01, lo));
                        store8(r0 + 2 * tx + 8, __builtin_shuffle(y00, y01, hi));
                        store8(r1 + 2 * tx, __builtin_shuffle(y10, y11, lo));
                        store8(r1 + 2 * tx + 8, __builtin_shuffle(y10, y11, hi));
                    }
                    done = tw;
                }
                for (Py_ssize_t tx = done; tx < tw; tx++) {
                    /* A^T M: rows 0 + 1 + 2 and 1 - 2 - 3, per column j */
                    float a[4], b[4];
                    for (int j = 0; j < 4; j++) {
                        a[j] = m[j][tx] + m[4 + j][tx] + m[8 + j][tx];
                        b[j] = m[4 + j][tx] - m[8 + j][tx] - m[12 + j][tx];
                    }
                    r0[2 * tx] = a[0] + a[1] + a[2];
                    r0[2 * tx + 1] = a[1] - a[2] - a[3];
                    r1[2 * tx] = b[0] + b[1] + b[2];
                    r1[2 * tx + 1] = b[1] - b[2] - b[3];
                }
                const Py_ssize_t oy = 2 * ty;
                finish_row(plane + oy * ow, r0, ow, b0, act, alpha, beta);
                if (oy + 1 < oh) finish_row(plane + (oy + 1) * ow, r1, ow, b0, act, alpha, beta);
            }
        }
}

/* ------------------------------------------------------------------------------------------- MaxPool
   2-D max pooling of float32 planes, separable as the numpy kernel is (pool.py): per output row the max over the
   kernel's row taps across the whole input row (contiguous, vectorized), then per output column the max over the
   column taps of that row. Padding takes no part; a position no tap reaches is -inf. NaN propagates (np.maximum's
   rule): a NaN tap makes the result NaN. */
typedef struct {
    Py_ssize_t planes, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl;
} pool_geometry;

static inline __attribute__((always_inline)) float max_nan(float m, float v) { return (v > m || v != v) ? v : m; }

/* 8 lanes of max_nan, with masks (the compiler did not if-convert the scalar form: 2.7 ms for ResNet's pool) */
static inline __attribute__((always_inline)) v8sf max_nan8(v8sf m, v8sf v) {
    const v8si take = (v > m) | (v != v);
    return (v8sf)(((v8si)v & take) | ((v8si)m & ~take));
}

/* dst[q] = max_nan(dst[q], src[q]) for q < n */
static inline __attribute__((always_inline)) void max_into(float *dst, const float *src, Py_ssize_t n) {
    Py_ssize_t q = 0;
    for (; q + 8 <= n; q += 8) store8(dst + q, max_nan8(load8(dst + q), load8(src + q)));
    for (; q < n; q++) dst[q] = max_nan(dst[q], src[q]);
}

/* scratch: (w + 2 * span) floats for a padded row, then 2 * (span / 2 + 2) for its even and odd halves */
static inline __attribute__((always_inline)) void max_pool_body(const float *x, float *y, const pool_geometry *g,
                                                               float *scratch, Py_ssize_t plane_begin,
                                                               Py_ssize_t plane_end) {
    const float lowest = -__builtin_inff();
    /* the row, padded with -inf: column taps read padded[ox*sw + j*dw] with no bounds checks */
    const Py_ssize_t span = (g->ow - 1) * g->sw + (g->kw - 1) * g->dw + 1;
    const Py_ssize_t padded_len = span > g->pl + g->w ? span : g->pl + g->w;
    float *padded = scratch, *row = padded + g->pl;
    const Py_ssize_t halves = padded_len / 2 + 2;
    float *even = padded + padded_len + 8, *odd = even + halves;
    for (Py_ssize_t q = 0; q < padded_len; q++) padded[q] = lowest;
    for (Py_ssize_t q = 0; q < halves; q++) even[q] = odd[q] = lowest;
    const Py_ssize_t live = g->pl + g->w < padded_len ? g->w : padded_len - g->pl;  /* row columns any tap reads */
    for (Py_ssize_t p = plane_begin; p < plane_end; p++) {
        const float *plane = x + p * g->h * g->w;
        float *out = y + p * g->oh * g->ow;
        for (Py_ssize_t oy = 0; oy < g->oh; oy++) {
            int first = 1;
            for (Py_ssize_t i = 0; i < g->kh; i++) {
                const Py_ssize_t iy = oy * g->sh - g->pt + i * g->dh;
                if (iy < 0 || iy >= g->h) continue;
                if (first) memcpy(row, plane + iy * g->w, sizeof(float) * (size_t)live);
                else max_into(row, plane + iy * g->w, live);
                first = 0;
            }
            if (first)
                for (Py_ssize_t q = 0; q < live; q++) row[q] = lowest;
            float *o = out + oy * g->ow;
            if (g->sw == 1) {
                memcpy(o, padded, sizeof(float) * (size_t)g->ow);
                for (Py_ssize_t j = 1; j < g->kw; j++) max_into(o, padded + j * g->dw, g->ow);
            } else if (g->sw == 2) {
                /* even and odd columns apart (8 at a time), then every tap is a contiguous run of one of them */
                const v8si evens = {0, 2, 4, 6, 8, 10, 12, 14}, odds = {1, 3, 5, 7, 9, 11, 13, 15};
                Py_ssize_t k = 0;
                for (; 2 * k + 16 <= padded_len; k += 8) {
                    const v8sf lo = load8(padded + 2 * k), hi = load8(padded + 2 * k + 8);
                    store8(even + k, __builtin_shuffle(lo, hi, evens));
                    store8(odd + k, __builtin_shuffle(lo, hi, odds));
                }
                for (; 2 * k < padded_len; k++) {
                    even[k] = padded[2 * k];
                    odd[k] = 2 * k + 1 < padded_len ? padded[2 * k + 1] : lowest;
                }
                for (Py_ssize_t j = 0; j < g->kw; j++) {
                    const Py_ssize_t off = j * g->dw;
                    const float *src = off % 2 ? odd + off / 2 : even + off / 2;
                    if (j == 0) memcpy(o, src, sizeof(float) * (size_t)g->ow);
                    else max_into(o, src, g->ow);
                }
            } else {
                for (Py_ssize_t ox = 0; ox < g->ow; ox++) {
                    float m = padded[ox * g->sw];
                    for (Py_ssize_t j = 1; j < g->kw; j++) m = max_nan(m, padded[ox * g->sw + j * g->dw]);
                    o[ox] = m;
                }
            }
        }
    }
}

#define max_pool_rows_body max_pool_body
DISPATCHED(max_pool_rows, (const float *x, float *y, const pool_geometry *g, float *row, Py_ssize_t plane_begin,
                           Py_ssize_t plane_end),
           (x, y, g, row, plane_begin, plane_end))

#define wino_input_rows_body wino_input_body
#define wino_output_rows_body wino_output_body
DISPATCHED(wino_input_rows, (const float *x, float *v, const wino_geometry *g, float *scratch), (x, v, g, scratch))
DISPATCHED(wino_output_rows, (const float *mp, float *y, const float *bias, Py_ssize_t mch, Py_ssize_t oh,
                              Py_ssize_t ow, const wino_geometry *g, int act, double alpha, double beta,
                              float *scratch),
           (mp, y, bias, mch, oh, ow, g, act, alpha, beta, scratch))

static int as_float32(PyObject *obj, Py_buffer *view, const char *what, int writable);

PyDoc_STRVAR(winograd_weights_doc,
"winograd_weights(w, u, m, c)\n\n"
"The transformed weights of a 3x3 conv for winograd_conv2d, packed as the sgemm's A operand of each of the 16\n"
"products: u[k, p, ci, r] = (G g G^T)[k] of w[p*12 + r, ci] (zero for rows past m), G's rows g0, (g0+g1+g2)/2,\n"
"(g0-g1+g2)/2, g2 applied to the kernel's rows, then its columns, in double, rounded once to float (numpy's\n"
"float64 formula, bit for bit). w: float32 [m, c, 3, 3]; u: float32 [16, ceil(m/12), c, 12]. One pass, where\n"
"numpy's made six full-size temporaries (half of ResNet-18's first run).");

static PyObject *winograd_weights(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *wo, *uo;
    Py_ssize_t m, c;
    if (!PyArg_ParseTuple(args, "OOnn", &wo, &uo, &m, &c)) return NULL;
    if (m < 0 || c < 0) {
        PyErr_SetString(PyExc_ValueError, "winograd_weights: bad sizes");
        return NULL;
    }
    Py_buffer wb, ub;
    if (as_float32(wo, &wb, "w", 0) < 0) return NULL;
    if (as_float32(uo, &ub, "u", 1) < 0) { PyBuffer_Release(&wb); return NULL; }
    const Py_ssize_t panels = (m + 11) / 12, plane = panels * c * 12;
    if (wb.len / 4 != m * c * 9 || ub.len / 4 != 16 * plane) {
        PyErr_SetString(PyExc_ValueError, "winograd_weights: a buffer's size does not match");
        PyBuffer_Release(&wb); PyBuffer_Release(&ub);
        return NULL;
    }
    const float *w = wb.buf;
    float *u = ub.buf;
    /* one row panel at a time into `local` ([16][c][12]), then each of its 16 planes copied out whole: written
       directly, the 16 planes' streams (4 KiB multiples apart at 256 channels) thrashed L1 (3.5 ms for 256x256) */
    const Py_ssize_t lstride = c * 12 + 16;  /* local's planes: not a 4 KiB multiple apart either */
    float *local = malloc(sizeof(float) * 16 * (size_t)lstride);
    if (!local) {
        PyBuffer_Release(&wb); PyBuffer_Release(&ub);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < panels; p++) {
        for (Py_ssize_t r = 0; r < 12; r++) {
            const Py_ssize_t row = p * 12 + r;
            for (Py_ssize_t ci = 0; ci < c; ci++) {
                float *out = local + ci * 12 + r;  /* + k * lstride */
                if (row >= m) {
                    for (int k = 0; k < 16; k++) out[k * lstride] = 0.0f;
                    continue;
                }
                const float *g = w + (row * c + ci) * 9;
                double t[4][3];
                for (int j = 0; j < 3; j++) {  /* G g: the kernel's rows */
                    const double g0 = g[j], g1 = g[3 + j], g2 = g[6 + j];
                    t[0][j] = g0;
                    t[1][j] = (g0 + g1 + g2) * 0.5;
                    t[2][j] = (g0 - g1 + g2) * 0.5;
                    t[3][j] = g2;
                }
                for (int i = 0; i < 4; i++) {  /* (G g) G^T: its columns */
                    const double a0 = t[i][0], a1 = t[i][1], a2 = t[i][2];
                    out[(i * 4 + 0) * lstride] = (float)a0;
                    out[(i * 4 + 1) * lstride] = (float)((a0 + a1 + a2) * 0.5);
                    out[(i * 4 + 2) * lstride] = (float)((a0 - a1 + a2) * 0.5);
                    out[(i * 4 + 3) * lstride] = (float)a2;
                }
            }
        }
        for (int k = 0; k < 16; k++)
            memcpy(u + k * plane + p * c * 12, local + k * lstride, sizeof(float) * 12 * (size_t)c);
    }
    Py_END_ALLOW_THREADS
    free(local);
    PyBuffer_Release(&wb); PyBuffer_Release(&ub);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(winograd_input_doc,
"winograd_input(x, v, n, c, h, w, pad_top, pad_left, th, tw, kstride=0)\n\n"
"The transformed input tiles of a 3x3 stride-1 conv, F(2x2, 3x3): v[k, ci, (s*th + ty)*tw + tx] = (B^T d B)[k]\n"
"for the 4x4 tile d at input row 2ty - pad_top, column 2tx - pad_left (zeros outside); v's 16 planes kstride\n"
"floats apart (0: c*tiles). float32, C-contiguous.");

static PyObject *winograd_input(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *vo;
    wino_geometry g = {0};
    if (!PyArg_ParseTuple(args, "OOnnnnnnnn|n", &xo, &vo, &g.n, &g.c, &g.h, &g.w, &g.pt, &g.pl, &g.th, &g.tw,
                          &g.kstride))
        return NULL;
    if (g.kstride == 0) g.kstride = g.c * g.n * g.th * g.tw;
    if (g.n < 0 || g.c < 0 || g.h < 0 || g.w < 0 || g.pt < 0 || g.pl < 0 || g.th < 0 || g.tw < 0) {
        PyErr_SetString(PyExc_ValueError, "winograd_input: bad geometry");
        return NULL;
    }
    Py_buffer xb, vb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(vo, &vb, "v", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    PyObject *result = NULL;
    const Py_ssize_t half = g.tw + 1, rows = 2 * g.th + 2;
    float *scratch = NULL;
    if (g.kstride < g.c * g.n * g.th * g.tw || xb.len / 4 != g.n * g.c * g.h * g.w || vb.len / 4 != 16 * g.kstride) {
        PyErr_SetString(PyExc_ValueError, "winograd_input: a buffer's size does not match");
    } else if (!(scratch = malloc(sizeof(float) * (size_t)(2 * rows * half + 8 * half + 16)))) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        wino_input_rows(xb.buf, vb.buf, &g, scratch);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    free(scratch);
    PyBuffer_Release(&xb); PyBuffer_Release(&vb);
    return result;
}

PyDoc_STRVAR(winograd_output_doc,
"winograd_output(m, y, bias, n, mch, oh, ow, th, tw, act, alpha, beta, kstride=0)\n\n"
"y[s, mo, 2ty + a, 2tx + b] = act(bias[mo] + (A^T M A)[a, b]) from the 16 products m[k, mo, tile] of the\n"
"transformed weights and winograd_input's tiles; rows and columns past oh, ow dropped. bias may be None.");

static PyObject *winograd_output(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *mo, *yo, *bo;
    wino_geometry g = {0};
    Py_ssize_t mch, oh, ow;
    int act;
    double alpha, beta;
    if (!PyArg_ParseTuple(args, "OOOnnnnnnidd|n", &mo, &yo, &bo, &g.n, &mch, &oh, &ow, &g.th, &g.tw, &act, &alpha,
                          &beta, &g.kstride))
        return NULL;
    if (g.kstride == 0) g.kstride = mch * g.n * g.th * g.tw;
    if (act < ACT_NONE || act >= ACT_COUNT || g.n < 0 || mch < 0 || oh < 0 || ow < 0 || g.th != (oh + 1) / 2
        || g.tw != (ow + 1) / 2) {
        PyErr_SetString(PyExc_ValueError, "winograd_output: bad arguments");
        return NULL;
    }
    Py_buffer mb, yb, bb;
    const int has_bias = bo != Py_None;
    if (as_float32(mo, &mb, "m", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&mb); return NULL; }
    if (has_bias && as_float32(bo, &bb, "bias", 0) < 0) { PyBuffer_Release(&mb); PyBuffer_Release(&yb); return NULL; }
    PyObject *result = NULL;
    float *scratch = NULL;
    if (g.kstride < mch * g.n * g.th * g.tw || mb.len / 4 != 16 * g.kstride || yb.len / 4 != g.n * mch * oh * ow
        || (has_bias && bb.len / 4 != mch)) {
        PyErr_SetString(PyExc_ValueError, "winograd_output: a buffer's size does not match");
    } else if (!(scratch = malloc(sizeof(float) * (size_t)(4 * g.tw + 16)))) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        wino_output_rows(mb.buf, yb.buf, has_bias ? bb.buf : NULL, mch, oh, ow, &g, act, alpha, beta, scratch);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    free(scratch);
    PyBuffer_Release(&mb); PyBuffer_Release(&yb);
    if (has_bias) PyBuffer_Release(&bb);
    return result;
}

typedef struct {
    const float *x;
    float *y;
    const pool_geometry *g;
    Py_ssize_t begin, end;
} pool_task;

static void *pool_worker(void *arg) {
    const pool_task *t = (const pool_task *)arg;
    const pool_geometry *g = t->g;
    const Py_ssize_t span = (g->ow - 1) * g->sw + (g->kw - 1) * g->dw + 1;
    const Py_ssize_t padded_len = span > g->pl + g->w ? span : g->pl + g->w;
    float *scratch = malloc(sizeof(float) * (size_t)(2 * padded_len + 32));
    if (!scratch) return (void *)1;
    max_pool_rows(t->x, t->y, g, scratch, t->begin, t->end);
    free(scratch);
    return NULL;
}

PyDoc_STRVAR(max_pool_doc,
"max_pool(x, y, planes, h, w, oh, ow, kh, kw, sh, sw, dh, dw, pad_top, pad_left, threads=1)\n\n"
"y[p, oy, ox] = the max over the kernel taps inside the input of x[p, oy*sh - pad_top + i*dh, ox*sw - pad_left +\n"
"j*dw] (-inf where none is; NaN propagates). float32, C-contiguous; `threads` split the planes.");

static PyObject *max_pool(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *yo;
    pool_geometry g;
    Py_ssize_t threads = 1;
    if (!PyArg_ParseTuple(args, "OOnnnnnnnnnnnnn|n", &xo, &yo, &g.planes, &g.h, &g.w, &g.oh, &g.ow, &g.kh, &g.kw,
                          &g.sh, &g.sw, &g.dh, &g.dw, &g.pt, &g.pl, &threads))
        return NULL;
    if (g.planes < 0 || g.h < 0 || g.w < 0 || g.oh < 0 || g.ow < 0 || g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1
        || g.dh < 1 || g.dw < 1) {
        PyErr_SetString(PyExc_ValueError, "max_pool: bad geometry");
        return NULL;
    }
    Py_buffer xb, yb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    PyObject *result = NULL;
    if (xb.len / 4 != g.planes * g.h * g.w || yb.len / 4 != g.planes * g.oh * g.ow) {
        PyErr_SetString(PyExc_ValueError, "max_pool: a buffer's size does not match");
    } else {
        if (threads < 1) threads = 1;
        if (threads > MAX_THREADS) threads = MAX_THREADS;
        if (threads > g.planes) threads = g.planes > 0 ? g.planes : 1;
        pool_task tasks[MAX_THREADS];
        void *targs[MAX_THREADS];
        for (Py_ssize_t t = 0; t < threads; t++) {
            tasks[t] = (pool_task){xb.buf, yb.buf, &g, g.planes * t / threads, g.planes * (t + 1) / threads};
            targs[t] = &tasks[t];
        }
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = run_tasks(pool_worker, targs, (int)threads);
        Py_END_ALLOW_THREADS
        if (failed) PyErr_NoMemory();
        else { Py_INCREF(Py_None); result = Py_None; }
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&yb);
    return result;
}

PyDoc_STRVAR(pack_doc,
"pack(src, dst, rows, cols, width, by_rows)\n\n"
"sgemm's packed operands from a C-contiguous float32 src [rows, cols], in one pass. by_rows: panels of `width`\n"
"rows, dst[p, c, r] = src[p*width + r, c] ([ceil(rows/width), cols, width]); else panels of `width` columns,\n"
"dst[p, r, j] = src[r, p*width + j] ([ceil(cols/width), rows, width]). Zeros past the edge.");

static PyObject *pack(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *so, *dobj;
    Py_ssize_t rows, cols, width;
    int by_rows;
    if (!PyArg_ParseTuple(args, "OOnnnp", &so, &dobj, &rows, &cols, &width, &by_rows)) return NULL;
    if (rows < 0 || cols < 0 || width < 1) {
        PyErr_SetString(PyExc_ValueError, "pack: bad sizes");
        return NULL;
    }
    Py_buffer sb, db;
    if (as_float32(so, &sb, "src", 0) < 0) return NULL;
    if (as_float32(dobj, &db, "dst", 1) < 0) { PyBuffer_Release(&sb); return NULL; }
    const Py_ssize_t panels = ((by_rows ? rows : cols) + width - 1) / width;
    PyObject *result = NULL;
    if (sb.len / 4 != rows * cols || db.len / 4 != panels * width * (by_rows ? cols : rows)) {
        PyErr_SetString(PyExc_ValueError, "pack: a buffer's size does not match");
    } else {
        const float *src = sb.buf;
        float *dst = db.buf;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t p = 0; p < panels; p++) {
            const Py_ssize_t first = p * width, live = ((by_rows ? rows : cols) - first) < width
                                                      ? (by_rows ? rows : cols) - first : width;
            if (by_rows) {
                float *panel = dst + p * cols * width;
                if (live < width) memset(panel, 0, sizeof(float) * (size_t)(cols * width));
                /* column by column: the writes run contiguously, the reads as `live` sequential streams (row by
                   row, every write was `width` floats from the last: 49 ms for ResNet-18's weights) */
                const float *rows_at = src + first * cols;
                if (live == width) {
                    for (Py_ssize_t c = 0; c < cols; c++)
                        for (Py_ssize_t r = 0; r < width; r++) panel[c * width + r] = rows_at[r * cols + c];
                } else {
                    for (Py_ssize_t c = 0; c < cols; c++)
                        for (Py_ssize_t r = 0; r < live; r++) panel[c * width + r] = rows_at[r * cols + c];
                }
            } else {
                float *panel = dst + p * rows * width;
                for (Py_ssize_t r = 0; r < rows; r++) {
                    memcpy(panel + r * width, src + r * cols + first, sizeof(float) * (size_t)live);
                    if (live < width) memset(panel + r * width + live, 0, sizeof(float) * (size_t)(width - live));
                }
            }
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&sb); PyBuffer_Release(&db);
    return result;
}

#ifdef KILN_X86_DISPATCH
/* Runs the products `proto` describes (its thread ranges ignored) over `threads` threads of the pool: threads split
   the columns, each reading all of A and its share of B, or, where A is the larger operand (m > n: a late conv
   layer's weights against a 7x7 map), the rows, each reading its share of A; a batch of at least as many products
   as threads, whole products per thread. Nonzero when a packing buffer could not be had. Called without the GIL. */
static int gemm_dispatch(const gemm_job *proto, Py_ssize_t batch, Py_ssize_t threads) {
    const Py_ssize_t m = proto->m, n = proto->n;
    const int by_items = batch >= threads && batch > 1, by_rows = !by_items && m > n;
    const Py_ssize_t panels = by_items ? batch : by_rows ? (m + GEMM_MR - 1) / GEMM_MR : (n + GEMM_NR - 1) / GEMM_NR;
    const Py_ssize_t unit = by_items ? 1 : by_rows ? GEMM_MR : GEMM_NR, extent = by_items ? batch : by_rows ? m : n;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > panels) threads = panels;
    gemm_job jobs[MAX_THREADS];
    void *tasks[MAX_THREADS];
    for (Py_ssize_t t = 0; t < threads; t++) {
        gemm_job *g = &jobs[t];
        *g = *proto;
        tasks[t] = g;
        const Py_ssize_t begin = (panels * t / threads) * unit;
        const Py_ssize_t end = t + 1 == threads ? extent : (panels * (t + 1) / threads) * unit;
        const int by_cols = !by_items && !by_rows;
        g->col_begin = by_cols ? begin : 0;
        g->col_end = by_cols ? end : n;
        g->row_begin = by_rows ? begin : 0;
        g->row_end = by_rows ? end : m;
        g->item_begin = by_items ? begin : 0;
        g->item_end = by_items ? end : batch;
    }
    return run_tasks(gemm_worker, tasks, (int)threads);
}
#endif

PyDoc_STRVAR(sgemm_doc,
"sgemm(a, b, c, bias, m, n, k, a_mode, b_mode, bias_mode, act, alpha, beta, threads, batch=1, stride_a=0,\n"
"      stride_b=0, stride_c=0, lda=0, ldb=0, a_offsets=None, b_offsets=None)\n\n"
"c[m, n] = act(A @ B + bias), float32, C-contiguous buffers. a_mode: 0 a is A [m, k]; 1 a is A packed in panels\n"
"of 12 rows, [ceil(m/12), k, 12], zero rows past m. b_mode: 0 b is B [k, n]; 1 b is B packed in panels of 32\n"
"columns, [ceil(n/32), k, 32], zero columns past n; 2 b is B's transpose [n, k]. bias_mode: 0 none (bias None),\n"
"1 bias[m] per row, 2 bias[n] per column; act as in direct_conv2d. batch products at once: a and b hold batch\n"
"operands at stride_a/stride_b floats (0: one operand shared by all; at least the operand's size), c batch results\n"
"at stride_c floats (0: m*n). Unpacked A and B may be strided: row strides lda, ldb (0: dense) and, instead of\n"
"the strides, each product's operand at its own offset (int64 buffers of batch floats offsets). Only where the\n"
"CPU has\n"
"AVX-512F (the module's has_sgemm); `threads` split the batch, or one product's rows or columns.");

static int has_avx512;

static PyObject *sgemm(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ao, *bo, *co, *biaso;
    Py_ssize_t m, n, k, threads;
    int a_mode, b_mode, bias_mode, act;
    double alpha, beta;
    Py_ssize_t batch = 1, stride_a = 0, stride_b = 0, stride_c = 0, lda = 0, ldb = 0;
    PyObject *aoffo = Py_None, *boffo = Py_None;
    if (!PyArg_ParseTuple(args, "OOOOnnniiiiddn|nnnnnnOO", &ao, &bo, &co, &biaso, &m, &n, &k, &a_mode, &b_mode,
                          &bias_mode, &act, &alpha, &beta, &threads, &batch, &stride_a, &stride_b, &stride_c, &lda,
                          &ldb, &aoffo, &boffo))
        return NULL;
    if (!has_avx512) {
        PyErr_SetString(PyExc_RuntimeError, "sgemm: this CPU has no AVX-512F");
        return NULL;
    }
    if (stride_c == 0) stride_c = m * n;
    if (batch < 1 || (stride_a != 0 && stride_a < (a_mode == OPERAND_PACKED ? (m + GEMM_MR - 1) / GEMM_MR * GEMM_MR * k : m * k))
        || (stride_b != 0 && stride_b < (b_mode == OPERAND_PACKED ? (n + GEMM_NR - 1) / GEMM_NR * GEMM_NR * k : n * k))
        || stride_c < m * n) {
        PyErr_SetString(PyExc_ValueError, "sgemm: a batch stride is neither 0 (shared) nor at least the operand's size");
        return NULL;
    }
    if (act < ACT_NONE || act >= ACT_COUNT || m < 0 || n < 0 || k < 1 || a_mode < 0 || a_mode > 1 || b_mode < 0
        || b_mode > 2 || bias_mode < 0 || bias_mode > 2 || (bias_mode == BIAS_NONE) != (biaso == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "sgemm: bad arguments");
        return NULL;
    }
    /* unpacked operands may be strided views: row strides lda/ldb (0: dense), and each product's operand at an
       offset of its own (aoff/boff: int64 buffers of batch entries, or None); all checked to lie in the buffer */
    if (lda == 0) lda = k;
    if (ldb == 0) ldb = b_mode == OPERAND_TRANSPOSED ? k : n;
    if ((a_mode == OPERAND_PACKED && (lda != k || aoffo != Py_None)) || (b_mode == OPERAND_PACKED && boffo != Py_None)
        || lda < k || ldb < (b_mode == OPERAND_TRANSPOSED ? k : n)) {
        PyErr_SetString(PyExc_ValueError, "sgemm: bad row strides or offsets for the operands' modes");
        return NULL;
    }
    Py_buffer aob, bob;
    const int has_aoff = aoffo != Py_None, has_boff = boffo != Py_None;
    if (has_aoff) {
        if (PyObject_GetBuffer(aoffo, &aob, PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if (aob.itemsize != 8 || aob.len / 8 != batch) {
            PyBuffer_Release(&aob);
            PyErr_SetString(PyExc_ValueError, "sgemm: a_offsets must be batch int64s");
            return NULL;
        }
    }
    if (has_boff) {
        if (PyObject_GetBuffer(boffo, &bob, PyBUF_C_CONTIGUOUS) < 0) { if (has_aoff) PyBuffer_Release(&aob); return NULL; }
        if (bob.itemsize != 8 || bob.len / 8 != batch) {
            PyBuffer_Release(&bob);
            if (has_aoff) PyBuffer_Release(&aob);
            PyErr_SetString(PyExc_ValueError, "sgemm: b_offsets must be batch int64s");
            return NULL;
        }
    }
    Py_buffer ab, bb, cb, biasb;
    const int has_bias = biaso != Py_None;
    if (as_float32(ao, &ab, "a", 0) < 0) goto offsets_done;
    if (as_float32(bo, &bb, "b", 0) < 0) { PyBuffer_Release(&ab); goto offsets_done; }
    if (as_float32(co, &cb, "c", 1) < 0) { PyBuffer_Release(&ab); PyBuffer_Release(&bb); goto offsets_done; }
    if (has_bias && as_float32(biaso, &biasb, "bias", 0) < 0) {
        PyBuffer_Release(&ab); PyBuffer_Release(&bb); PyBuffer_Release(&cb);
        goto offsets_done;
    }
    PyObject *result = NULL;
    /* the floats one operand spans, and whether every product's operand lies inside its buffer */
    const Py_ssize_t a_len = a_mode == OPERAND_PACKED ? (m + GEMM_MR - 1) / GEMM_MR * GEMM_MR * k
                                                      : (m > 0 ? (m - 1) * lda + k : 0);
    const Py_ssize_t b_rows = b_mode == OPERAND_TRANSPOSED ? n : k, b_cols = b_mode == OPERAND_TRANSPOSED ? k : n;
    const Py_ssize_t b_len = b_mode == OPERAND_PACKED ? (n + GEMM_NR - 1) / GEMM_NR * GEMM_NR * k
                                                      : (b_rows > 0 ? (b_rows - 1) * ldb + b_cols : 0);
    int inside = 1;
    if (has_aoff)
        for (Py_ssize_t i = 0; i < batch; i++) {
            const long long o = ((const long long *)aob.buf)[i];
            inside &= o >= 0 && o + a_len <= ab.len / 4;
        }
    if (has_boff)
        for (Py_ssize_t i = 0; i < batch; i++) {
            const long long o = ((const long long *)bob.buf)[i];
            inside &= o >= 0 && o + b_len <= bb.len / 4;
        }
    const int dense = lda == k && ldb == (b_mode == OPERAND_TRANSPOSED ? k : n);
    if (!inside
        || (!has_aoff && (dense ? ab.len / 4 != (stride_a ? batch * stride_a : a_len)
                                : ab.len / 4 < (stride_a ? (batch - 1) * stride_a : 0) + a_len))
        || (!has_boff && (dense ? bb.len / 4 != (stride_b ? batch * stride_b : b_len)
                                : bb.len / 4 < (stride_b ? (batch - 1) * stride_b : 0) + b_len))
        || cb.len / 4 != (batch > 1 ? batch * stride_c : m * n)
        || (has_bias && biasb.len / 4 != (bias_mode == BIAS_ROWS ? m : n))) {
        PyErr_SetString(PyExc_ValueError, "sgemm: a buffer's size does not match m, n, k and the modes");
    } else if (m > 0 && n > 0) {
#ifdef KILN_X86_DISPATCH
        gemm_job proto = {0};
        proto.a = ab.buf; proto.b = bb.buf; proto.c = cb.buf; proto.bias = has_bias ? biasb.buf : NULL;
        proto.m = m; proto.n = n; proto.k = k;
        proto.a_mode = a_mode; proto.b_mode = b_mode; proto.bias_mode = bias_mode;
        proto.stride_a = stride_a; proto.stride_b = stride_b; proto.stride_c = stride_c;
        proto.lda = lda; proto.ldb = ldb;
        proto.a_offsets = has_aoff ? aob.buf : NULL;
        proto.b_offsets = has_boff ? bob.buf : NULL;
        proto.act = act; proto.alpha = alpha; proto.beta = beta;
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = gemm_dispatch(&proto, batch, threads);
        Py_END_ALLOW_THREADS
        if (failed) PyErr_NoMemory();
        else { Py_INCREF(Py_None); result = Py_None; }
#endif
    } else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&ab); PyBuffer_Release(&bb); PyBuffer_Release(&cb);
    if (has_bias) PyBuffer_Release(&biasb);
    if (has_aoff) PyBuffer_Release(&aob);
    if (has_boff) PyBuffer_Release(&bob);
    return result;
offsets_done:
    if (has_aoff) PyBuffer_Release(&aob);
    if (has_boff) PyBuffer_Release(&bob);
    return NULL;
}

static int float32_format(const Py_buffer *view) {
    const char *f = view->format;
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f++;
    return view->itemsize == 4 && f != NULL && strcmp(f, "f") == 0;
}

PyDoc_STRVAR(matmul_doc,
"matmul(a, b, c, threads) -> bool\n\n"
"c = a @ b through the sgemm for float32 arrays a [*lead, m, k] and b [*lead, k, n] of any strides, read in\n"
"place (attention's heads split from [batch, seq, heads, dim] memory, K^T as a transposed view): each product's\n"
"operands are found from the arrays' own strides, A read by rows, B by rows or as a transpose. The leading dims\n"
"are equal, or absent on one side (that operand shared). c: a C-contiguous float32 [*lead, m, n], k >= 1.\n"
"False, with nothing written, where an operand has neither of its last two axes at unit stride (or a stride that\n"
"is not a whole number of floats): the caller then copies it. AVX-512F only (has_sgemm).");

static PyObject *matmul_strided(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ao, *bo, *co;
    Py_ssize_t threads;
    if (!PyArg_ParseTuple(args, "OOOn", &ao, &bo, &co, &threads)) return NULL;
    if (!has_avx512) {
        PyErr_SetString(PyExc_RuntimeError, "matmul: this CPU has no AVX-512F");
        return NULL;
    }
    Py_buffer ab, bb, cb;
    if (PyObject_GetBuffer(ao, &ab, PyBUF_STRIDES | PyBUF_FORMAT) < 0) return NULL;
    if (PyObject_GetBuffer(bo, &bb, PyBUF_STRIDES | PyBUF_FORMAT) < 0) { PyBuffer_Release(&ab); return NULL; }
    if (as_float32(co, &cb, "c", 1) < 0) { PyBuffer_Release(&ab); PyBuffer_Release(&bb); return NULL; }
    PyObject *result = NULL;
    long long *offsets = NULL;
    if (!float32_format(&ab) || !float32_format(&bb) || ab.ndim < 2 || bb.ndim < 2) {
        PyErr_SetString(PyExc_TypeError, "matmul: a and b must be float32 arrays of at least 2 dims");
        goto done;
    }
    const int na = ab.ndim, nb = bb.ndim, la = na - 2, lb = nb - 2;
    const Py_ssize_t m = ab.shape[na - 2], k = ab.shape[na - 1], n = bb.shape[nb - 1];
    int same = !la || !lb || la == lb;
    for (int d = 0; same && la && lb && d < la; d++) same = ab.shape[d] == bb.shape[d];
    const int lead = la ? la : lb;
    const Py_ssize_t *lead_shape = la ? ab.shape : bb.shape;
    Py_ssize_t batch = 1;
    for (int d = 0; d < lead; d++) batch *= lead_shape[d];
    if (!same || bb.shape[nb - 2] != k || k < 1 || cb.len / 4 != batch * m * n) {
        PyErr_SetString(PyExc_ValueError, "matmul: the operands' shapes do not match (or c's size, or k = 0)");
        goto done;
    }
    for (int d = 0; d < na; d++)
        if (ab.strides[d] % 4) { Py_INCREF(Py_False); result = Py_False; goto done; }
    for (int d = 0; d < nb; d++)
        if (bb.strides[d] % 4) { Py_INCREF(Py_False); result = Py_False; goto done; }
    /* an axis of one element has no stride that matters */
    const int a_unit = k == 1 || ab.strides[na - 1] == 4;
    const int b_rows = n == 1 || bb.strides[nb - 1] == 4, b_cols = k == 1 || bb.strides[nb - 2] == 4;
    if (!a_unit || (!b_rows && !b_cols)) { Py_INCREF(Py_False); result = Py_False; goto done; }
    if (m == 0 || n == 0 || batch == 0) { Py_INCREF(Py_True); result = Py_True; goto done; }
    gemm_job proto = {0};
    proto.a = ab.buf; proto.b = bb.buf; proto.c = cb.buf;
    proto.m = m; proto.n = n; proto.k = k;
    proto.a_mode = OPERAND_ROWS;
    proto.b_mode = b_rows ? OPERAND_ROWS : OPERAND_TRANSPOSED;
    proto.bias_mode = BIAS_NONE;
    proto.act = ACT_NONE;
    proto.lda = m == 1 ? k : ab.strides[na - 2] / 4;
    proto.ldb = b_rows ? (k == 1 ? n : bb.strides[nb - 2] / 4) : (n == 1 ? k : bb.strides[nb - 1] / 4);
    proto.stride_c = m * n;
    if (batch > 1) {  /* each product's operand offsets (floats from buf), from the leading strides; 0: shared */
        offsets = malloc(sizeof(long long) * 2 * (size_t)batch);
        if (!offsets) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t i = 0; i < batch; i++) {
            Py_ssize_t rest = i;
            long long oa = 0, ob = 0;
            for (int d = lead - 1; d >= 0; d--) {
                const Py_ssize_t idx = rest % lead_shape[d];
                rest /= lead_shape[d];
                if (la) oa += (long long)idx * (ab.strides[d] / 4);
                if (lb) ob += (long long)idx * (bb.strides[d] / 4);
            }
            offsets[i] = oa;
            offsets[batch + i] = ob;
        }
        proto.a_offsets = offsets;
        proto.b_offsets = offsets + batch;
    }
    int failed;
#ifdef KILN_X86_DISPATCH
    Py_BEGIN_ALLOW_THREADS
    failed = gemm_dispatch(&proto, batch, threads);
    Py_END_ALLOW_THREADS
#else
    failed = 1;
#endif
    if (failed) PyErr_NoMemory();
    else { Py_INCREF(Py_True); result = Py_True; }
done:
    free(offsets);
    PyBuffer_Release(&ab); PyBuffer_Release(&bb); PyBuffer_Release(&cb);
    return result;
}

#define gelu_rows_body gelu_body
#define layer_norm_rows_body layer_norm_body
#define softmax_rows_body softmax_body
DISPATCHED(gelu_rows, (const float *x, float *y, Py_ssize_t n, const float *negh, int terms),
           (x, y, n, negh, terms))
DISPATCHED(layer_norm_rows, (const float *x, float *y, Py_ssize_t rows, Py_ssize_t n, const float *scale,
                             const float *bias, float eps), (x, y, rows, n, scale, bias, eps))
DISPATCHED(softmax_rows, (const float *x, float *y, Py_ssize_t rows, Py_ssize_t n), (x, y, rows, n))



/* ------------------------------------------------------------------------------------------- elementwise
   A FusedElementwise body as a little program over float32 registers, run chunk by chunk (CHUNK floats: every
   register's chunk stays in L1), so a chain of k ops makes one pass over memory instead of k, and one call
   instead of k numpy calls (native.py compiles the body; only these ops, each correctly rounded in IEEE, so the
   answers are the unfused numpy kernels' bit for bit). Registers: the first `nin` are the inputs (each full size,
   a scalar, or periodic: a suffix of the output's shape, repeated), the rest temporaries; instructions are
   (op, dst, a, b) int32 quadruples; the outputs are registers copied out.
   Exp, Sigmoid and Tanh are the exceptions to "bit for bit": exp8/exp16 (within 2 ulp of expf; 0 where the result
   would be subnormal), 1 / (1 + exp(-x)) and tanh8/tanh16 (below), a few ulp from numpy's kernels
   (tests/runtime/test_native.py). */
enum { EW_ADD, EW_SUB, EW_MUL, EW_DIV, EW_MAX, EW_MIN, EW_NEG, EW_ABS, EW_RELU, EW_SQRT, EW_EXP, EW_SIGMOID, EW_TANH,
       EW_COUNT };

#define DEFINE_SIGMOID(SUFFIX, VF, EXP)                                                                         \
    static inline __attribute__((always_inline)) VF sigmoid##SUFFIX(VF x) { return 1.0f / (1.0f + EXP(-x)); }
DEFINE_SIGMOID(8, v8sf, exp8)
DEFINE_SIGMOID(16, v16sf, exp16)

/* tanh as Eigen's and onnxruntime's MLAS float tanh: an odd degree-13 over an even degree-6 polynomial on x clamped to
   +-7.905, within 6 ulp of tanh (numpy's own AVX-512 tanh, ~1 ulp, is no faster to beat through exp: Cephes' tanhf
   on exp took 3x its time); x itself below |x| 0.0004 (so +-0 and tiny values exactly), +-1 from |x| 9 (where
   float32's tanh rounds to 1), NaN stays NaN */
#define DEFINE_TANH(SUFFIX, VF, VI, CS)                                                                           \
    static inline __attribute__((always_inline)) VF tanh##SUFFIX(VF x) {                                        \
        const VF zero = {0};                                                                                    \
        const VI sign = (VI)x & ((VI){0} + (-2147483647 - 1));                                                 \
        const VF ax = (VF)((VI)x & ~sign);                                                                      \
        const VF c = raise_to##CS(lower_to##CS(x, zero + 7.90531110763549805f), zero - 7.90531110763549805f);         \
        const VF x2 = c * c;                                                                                    \
        VF p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;                                             \
        p = p * x2 + -8.60467152213735e-11f;                                                                    \
        p = p * x2 + 5.12229709037114e-08f;                                                                     \
        p = p * x2 + 1.48572235717979e-05f;                                                                     \
        p = p * x2 + 6.37261928875436e-04f;                                                                     \
        p = (p * x2 + 4.89352455891786e-03f) * c;                                                               \
        VF q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;                                             \
        q = q * x2 + 2.26843463243900e-03f;                                                                     \
        q = q * x2 + 4.89352518554385e-03f;                                                                     \
        VF y = p / q;                                                                                           \
        const VI tiny = ax < 0.0004f, big = ax >= 9.0f;                                                         \
        const VF one = (VF)((VI)(zero + 1.0f) | sign);                                                          \
        y = (VF)(((VI)x & tiny) | ((VI)y & ~tiny));                                                             \
        return (VF)(((VI)one & big) | ((VI)y & ~big));                                                          \
    }
DEFINE_TANH(8, v8sf, v8si, )
DEFINE_TANH(16, v16sf, v16si, 16)

#ifdef KILN_X86_DISPATCH
/* The same on AVX-512 where the CPU has it: 16 lanes, four vectors in flight (AVX2's 8 lanes took 0.53 ns a float
   for exp, numpy's own AVX-512 loop 0.33) */
#define DEFINE_UNARY16(NAME, F)                                                                                   \
    __attribute__((target("avx512f"))) static void NAME(float *d, const float *a, Py_ssize_t n) {               \
        Py_ssize_t i = 0;                                                                                         \
        for (; i + 64 <= n; i += 64) {                                                                            \
            v16sf r0, r1, r2, r3;                                                                                 \
            memcpy(&r0, a + i, 64); memcpy(&r1, a + i + 16, 64); memcpy(&r2, a + i + 32, 64);                     \
            memcpy(&r3, a + i + 48, 64);                                                                          \
            r0 = F(r0); r1 = F(r1); r2 = F(r2); r3 = F(r3);                                                       \
            memcpy(d + i, &r0, 64); memcpy(d + i + 16, &r1, 64); memcpy(d + i + 32, &r2, 64);                     \
            memcpy(d + i + 48, &r3, 64);                                                                          \
        }                                                                                                         \
        for (; i < n; i += 16) {                                                                                  \
            float in[16] = {0}, out[16];                                                                          \
            const size_t m = (size_t)(n - i < 16 ? n - i : 16);                                                   \
            memcpy(in, a + i, sizeof(float) * m);                                                                 \
            v16sf v;                                                                                              \
            memcpy(&v, in, 64);                                                                                   \
            v = F(v);                                                                                             \
            memcpy(out, &v, 64);                                                                                  \
            memcpy(d + i, out, sizeof(float) * m);                                                                \
        }                                                                                                         \
    }
DEFINE_UNARY16(ew_exp_avx512, exp16)
DEFINE_UNARY16(ew_sigmoid_avx512, sigmoid16)
DEFINE_UNARY16(ew_tanh_avx512, tanh16)
#define EW_AVX512(FN) if (wide) { FN(d, a, n); break; }
#else
#define EW_AVX512(FN)
#endif

/* d[i] = f(a[i]) for i < n, 8 lanes at a time, four vectors an iteration (on the Zen 5 no faster than one: exp
   0.53 ns a float either way, throughput-bound; 16 lanes are what helped); a tail shorter than 8 through a
   zero-padded vector */
#define EW_UNARY8(F)                                                                                        \
    do {                                                                                                    \
        Py_ssize_t i = 0;                                                                                   \
        for (; i + 32 <= n; i += 32) {                                                                      \
            const v8sf r0 = F(load8(a + i)), r1 = F(load8(a + i + 8)), r2 = F(load8(a + i + 16)),           \
                       r3 = F(load8(a + i + 24));                                                           \
            store8(d + i, r0); store8(d + i + 8, r1); store8(d + i + 16, r2); store8(d + i + 24, r3);       \
        }                                                                                                   \
        for (; i + 8 <= n; i += 8) store8(d + i, F(load8(a + i)));                                          \
        if (i < n) {                                                                                        \
            float in[8] = {0}, out[8];                                                                      \
            memcpy(in, a + i, sizeof(float) * (size_t)(n - i));                                             \
            store8(out, F(load8(in)));                                                                      \
            memcpy(d + i, out, sizeof(float) * (size_t)(n - i));                                            \
        }                                                                                                   \
    } while (0)
enum { KIND_FULL, KIND_SCALAR, KIND_PERIODIC };

/* d may be a or b (a register reused once its value is dead): element i reads only element i */
static inline __attribute__((always_inline)) void ew_op(int op, int wide, float *d, const float *a, const float *b,
                                                        Py_ssize_t n) {
    switch (op) {
    case EW_ADD: for (Py_ssize_t i = 0; i < n; i++) d[i] = a[i] + b[i]; break;
    case EW_SUB: for (Py_ssize_t i = 0; i < n; i++) d[i] = a[i] - b[i]; break;
    case EW_MUL: for (Py_ssize_t i = 0; i < n; i++) d[i] = a[i] * b[i]; break;
    case EW_DIV: for (Py_ssize_t i = 0; i < n; i++) d[i] = a[i] / b[i]; break;
    /* numpy's maximum/minimum (its SIMD loops, x86 maxps/minps): NaN if either is NaN, else the second operand
       where the two compare equal (so maximum(-0, +0) is +0 and maximum(+0, -0) is -0) */
    case EW_MAX:
        for (Py_ssize_t i = 0; i < n; i++) {
            const float x = a[i], y = b[i];
            d[i] = (x != x || y != y) ? x + y : (x > y ? x : y);
        }
        break;
    case EW_MIN:
        for (Py_ssize_t i = 0; i < n; i++) {
            const float x = a[i], y = b[i];
            d[i] = (x != x || y != y) ? x + y : (x < y ? x : y);
        }
        break;
    case EW_NEG: for (Py_ssize_t i = 0; i < n; i++) d[i] = -a[i]; break;
    case EW_ABS: for (Py_ssize_t i = 0; i < n; i++) d[i] = __builtin_fabsf(a[i]); break;
    case EW_RELU:  /* numpy.maximum(x, 0): NaN stays, -0 becomes +0 */
        for (Py_ssize_t i = 0; i < n; i++) {
            const float x = a[i];
            d[i] = x != x ? x : (x > 0.0f ? x : 0.0f);
        }
        break;
    case EW_SQRT: for (Py_ssize_t i = 0; i < n; i++) d[i] = __builtin_sqrtf(a[i]); break;
    case EW_EXP: EW_AVX512(ew_exp_avx512) EW_UNARY8(exp8); break;
    case EW_SIGMOID: EW_AVX512(ew_sigmoid_avx512) EW_UNARY8(sigmoid8); break;
    case EW_TANH: EW_AVX512(ew_tanh_avx512) EW_UNARY8(tanh8); break;
    default: break;
    }
}

typedef struct {
    int nin, nreg, nprog, nout;
    const int *prog, *outs, *kind;
    const Py_ssize_t *period;
    const float *const *in;
    float *const *out;
    Py_ssize_t total, chunk;  /* chunk: floats per register, min(CHUNK, total) */
    Py_ssize_t begin, end;    /* this part of [0, total): whole chunks but the last */
    float *regs;
    const float **src;
    int wide;                 /* Exp, Sigmoid, Tanh on AVX-512's 16 lanes (else 8) */
} ew_job;

static inline __attribute__((always_inline)) void ew_body(const ew_job *j, float *regs, const float **src) {
    /* regs: nreg chunks of `chunk` floats; input registers point into the inputs where they can (full size) */
    const Py_ssize_t chunk = j->chunk;
    for (Py_ssize_t c0 = j->begin; c0 < j->end; c0 += chunk) {
        const Py_ssize_t n = j->end - c0 < chunk ? j->end - c0 : chunk;
        for (int r = 0; r < j->nin; r++) {
            float *buf = regs + (Py_ssize_t)r * chunk;
            if (j->kind[r] == KIND_FULL) {
                src[r] = j->in[r] + c0;
            } else if (j->kind[r] == KIND_SCALAR) {
                if (c0 == j->begin)
                    for (Py_ssize_t i = 0; i < chunk; i++) buf[i] = j->in[r][0];
                src[r] = buf;
            } else {
                const Py_ssize_t p = j->period[r];
                Py_ssize_t k = c0 % p;
                for (Py_ssize_t i = 0; i < n; i++) {
                    buf[i] = j->in[r][k];
                    if (++k == p) k = 0;
                }
                src[r] = buf;
            }
        }
        for (int r = j->nin; r < j->nreg; r++) src[r] = regs + (Py_ssize_t)r * chunk;
        for (int k = 0; k < j->nprog; k++) {
            const int *ins = j->prog + 4 * k;
            ew_op(ins[0], j->wide, (float *)src[ins[1]], src[ins[2]], src[ins[3] >= 0 ? ins[3] : ins[2]], n);
        }
        for (int o = 0; o < j->nout; o++) memcpy(j->out[o] + c0, src[j->outs[o]], sizeof(float) * (size_t)n);
    }
}

#define ew_run_body ew_body
DISPATCHED(ew_run, (const ew_job *j, float *regs, const float **src), (j, regs, src))

static void *ew_worker(void *arg) {
    const ew_job *j = (const ew_job *)arg;
    ew_run(j, j->regs, j->src);
    return NULL;
}

static int as_float32(PyObject *obj, Py_buffer *view, const char *what, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    const char *f = view->format;  /* "f", or with a native/little-endian prefix ("<f" from numpy's '<f4') */
    if (f != NULL && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f++;
    if (view->itemsize != 4 || f == NULL || strcmp(f, "f") != 0) {
        PyErr_Format(PyExc_TypeError, "%s: a C-contiguous float32 buffer is needed", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------- AVX-512 direct conv
   direct_conv2d's kernel where the CPU has AVX-512F: no phase images, no accumulator buffer. Each step computes
   a register tile of OCB output channels x V vectors of 16 adjacent outputs of one output row, reading the input
   rows in place: per kernel tap, V input vectors (stride 1: a masked load; stride 2: two masked loads and one
   permute that keeps the even lanes; other strides: a masked gather), each fed to OCB multiply-adds against
   broadcast weights; the masks (padding, the row's ends) are made once per tile and tap column, so every
   tap is branch-free. The bias and the activation are applied in registers and the tile stored masked to the
   row's width. Dense convs take OCB = 8 or 16 (each input vector feeds 8-16 FMAs: the stem, 1x1 convs over
   few channels), depthwise convs OCB = 1 (load-bound: their 9 or 25 taps per output are L1 hits).
   Threads take contiguous ranges of (sample, channel block, output row) items. */
#ifdef KILN_X86_DISPATCH
typedef struct {
    const float *x, *w, *bias;
    float *y;
    Py_ssize_t n, c, h, wd, m, oh, ow, kh, kw, group, sh, sw, dh, dw, pt, pl;
    int act;
    float alpha, beta;
    Py_ssize_t ocb, v, blocks;      /* register tile: output channels (1: depthwise), vectors; blocks per group */
    const float *wp;                /* dense: the weights as [group * blocks][taps][ocb], zeros past a group's end */
    int prefetch;                   /* the input and output exceed DCONV_PREFETCH_BYTES: the tiles prefetch rows */
    Py_ssize_t item_begin, item_end;
} dconv_job;

/* lanes e (0..15) with 0 <= start + e < limit */
static inline __attribute__((always_inline)) __mmask16 lanes_within(Py_ssize_t start, Py_ssize_t limit) {
    Py_ssize_t lo = -start, hi = limit - start;
    if (lo < 0) lo = 0;
    if (hi > 16) hi = 16;
    if (hi <= lo) return 0;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

__attribute__((target("avx512f"))) static inline __m512 dconv_act(__m512 t, int act, float alpha, float beta) {
    const __m512 zero = _mm512_setzero_ps();
    switch (act) {  /* NaN kept: max/min return their second operand when either is NaN */
    case ACT_RELU:
        return _mm512_max_ps(zero, t);
    case ACT_HARDSWISH:
    case ACT_HARDSIGMOID: {
        __m512 u = _mm512_fmadd_ps(_mm512_set1_ps(alpha), t, _mm512_set1_ps(beta));
        u = _mm512_min_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(zero, u));
        return act == ACT_HARDSWISH ? _mm512_mul_ps(t, u) : u;
    }
    case ACT_CLIP:  /* max then min, as Clip's reference: min > max gives max everywhere */
        return _mm512_min_ps(_mm512_set1_ps(beta), _mm512_max_ps(_mm512_set1_ps(alpha), t));
    case ACT_LEAKYRELU:
        return _mm512_mask_mul_ps(t, _mm512_cmp_ps_mask(t, zero, _CMP_LT_OQ), t, _mm512_set1_ps(alpha));
    default:
        return t;
    }
}

/* The tiles, one function per shape (a macro: the accumulators are an array of that exact size, which the compiler
   keeps in registers; one array shared by every size was kept on the stack and stored back at every tap). SW is the
   column stride: 1 and 2 have their own loads, 0 any other (gathers). A strip is 16 V adjacent output columns; its
   masks (one per vector and tap column: padding and the row's ends) are made once for all its rows, and a strip
   whose every load is inside the row (interior) takes plain loads (masked ones cost a third more here).
   Dense tiles (dconv_*): OCB output channels x V vectors of one row, weights packed [block][tap][OCB] (wp), so
   each tap's OCB broadcasts are adjacent; each input vector feeds OCB FMAs. Depthwise tiles (dwconv_*): one
   channel, R rows x V vectors, R x V independent accumulators (a tap feeds one FMA per input vector; one row's V
   chains alone would wait on the FMA's latency); rows above or below the input read a zero row (zrow).
   Rows are the outer loop, strips the inner one, and each row (tile of rows) prefetches the input and output rows
   of the one after next: with the data out of cache (a batch's 5-11 MB, as in a model run), the stem's 25 streams
   (9 input rows, 16 output planes) defeated the hardware prefetchers. MobileNetV3-style b8's stem, 2 threads, after
   the caches were swept: 1.23 ms strips outer, 0.53 rows outer with prefetches; the model b8 3.9 -> 2.0-2.9 ms. */
/* A tile's vector stored: a plain store where every lane is in the row (masked stores are slow on AMD's cores: a
   tile of masked stores ran at half the speed of plain ones on Zen 5), else masked to the row's end. */
__attribute__((target("avx512f"))) static inline void dconv_store(float *p, __mmask16 m, __m512 v) {
    if (m == 0xFFFF) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, m, v);
}

#define DCONV_AHEAD 2  /* dense tiles prefetch the rows this many output rows on */
/* Convs whose input and output take at least this many bytes prefetch (below it they are in cache after the
   op before, and the prefetches cost ~4%: MobileNetV3-style b1 0.296 -> 0.310 ms with them everywhere) */
#define DCONV_PREFETCH_BYTES (4 << 20)
#define DCONV_UNROLL _Pragma("GCC unroll 16")
#define DCONV_LOAD(MASKED, SW, v, q, at)                                                                               \
    ((SW) == 1 ? ((MASKED) ? _mm512_maskz_loadu_ps(mlo[v][q], (at) + 16 * (v)) : _mm512_loadu_ps((at) + 16 * (v)))     \
     : (SW) == 2 ? _mm512_permutex2var_ps(                                                                             \
                       (MASKED) ? _mm512_maskz_loadu_ps(mlo[v][q], (at) + 32 * (v)) : _mm512_loadu_ps((at) + 32 * (v)), \
                       even,                                                                                           \
                       (MASKED) ? _mm512_maskz_loadu_ps(mhi[v][q], (at) + 32 * (v) + 16)                               \
                                : _mm512_loadu_ps((at) + 32 * (v) + 16))                                               \
     : _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mlo[v][q],                                                        \
                                _mm512_add_epi32(vstride, _mm512_set1_epi32((int)(16 * (v) * sw))), (at), 4))

#define DCONV_PROLOGUE(V, SW)                                                                                          \
    const Py_ssize_t kh = j->kh, kw = j->kw, sw = SW ? SW : j->sw, step = j->dw;                                       \
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);                  \
    const __m512i vstride = _mm512_mullo_epi32(                                                                        \
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)sw));           \
    __mmask16 mlo[V][64], mhi[V][64];                                                                                  \
    (void)even; (void)vstride; (void)mhi;

#define DCONV_STRIP_MASKS(V, SW)                                                                                       \
    const Py_ssize_t left = x0 * sw - j->pl;  /* the strip's first input column at tap column 0 */                     \
    int interior = 1;                                                                                                  \
    DCONV_UNROLL for (int v = 0; v < V; v++)                                                                           \
        for (Py_ssize_t q = 0; q < kw; q++) {                                                                          \
            const Py_ssize_t ix0 = left + 16 * v * sw + q * step;                                                      \
            if (SW == 0) {  /* lanes e with 0 <= ix0 + sw * e < wd */                                                  \
                const __m512i idx = _mm512_add_epi32(vstride, _mm512_set1_epi32((int)ix0));                            \
                mlo[v][q] = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512()) &                                     \
                            _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32((int)j->wd));                               \
            } else {                                                                                                   \
                mlo[v][q] = lanes_within(ix0, j->wd);                                                                  \
                mhi[v][q] = SW == 2 ? lanes_within(ix0 + 16, j->wd) : 0xFFFF;                                          \
            }                                                                                                          \
            interior &= mlo[v][q] == 0xFFFF && (SW != 2 || mhi[v][q] == 0xFFFF);                                       \
        }                                                                                                              \
    __mmask16 out[V];                                                                                                  \
    DCONV_UNROLL for (int v = 0; v < V; v++) out[v] = lanes_within(x0 + 16 * v, j->ow);

#define DCONV_TAPS(MASKED, OCB, V, SW)                                                                                 \
    for (Py_ssize_t ci = 0; ci < cpg; ci++)                                                                            \
        for (Py_ssize_t i = 0; i < kh; i++) {                                                                          \
            const Py_ssize_t iy = oy * j->sh - j->pt + i * j->dh;                                                      \
            if (iy < 0 || iy >= j->h) continue;                                                                        \
            const float *row = xin + (ci * j->h + iy) * j->wd + left;                                                  \
            const float *wt = wb + (ci * kh + i) * kw * OCB;                                                           \
            for (Py_ssize_t q = 0; q < kw; q++) {                                                                      \
                const float *at = row + q * step;                                                                      \
                __m512 xv[V];                                                                                          \
                DCONV_UNROLL for (int v = 0; v < V; v++) xv[v] = DCONV_LOAD(MASKED, SW, v, q, at);                     \
                DCONV_UNROLL for (int o = 0; o < OCB; o++) {                                                           \
                    const __m512 wv = _mm512_set1_ps(wt[q * OCB + o]);                                                 \
                    DCONV_UNROLL for (int v = 0; v < V; v++) acc[o][v] = _mm512_fmadd_ps(wv, xv[v], acc[o][v]);        \
                }                                                                                                      \
            }                                                                                                          \
        }

#define DCONV_DEFINE(OCB, V, SW)                                                                                       \
__attribute__((target("avx512f"))) static void dconv_##OCB##_##V##_##SW(                                               \
        const dconv_job *j, const float *xin, Py_ssize_t b, Py_ssize_t oc0, Py_ssize_t cnt, Py_ssize_t oy0,            \
        Py_ssize_t oy1, float *yplane, const float *zrow) {                                                            \
    (void)zrow;                                                                                                        \
    DCONV_PROLOGUE(V, SW)                                                                                               \
    const Py_ssize_t cpg = j->c / j->group, plane = j->oh * j->ow;                                                     \
    const float *wb = j->wp + b * cpg * kh * kw * OCB;                                                                 \
    __m512 bias[OCB];                                                                                                  \
    DCONV_UNROLL for (int o = 0; o < OCB; o++)                                                                         \
        bias[o] = _mm512_set1_ps(j->bias && o < cnt ? j->bias[oc0 + o] : 0.0f);                                        \
    for (Py_ssize_t oy = oy0; oy < oy1; oy++) {  /* rows outer: a row's input rows and output runs stay in cache across its strips */ \
        if (j->prefetch) {  /* the input rows and output rows DCONV_AHEAD rows on, on their way to L1 */           \
            const Py_ssize_t ny = oy + DCONV_AHEAD;                                                                    \
            if (ny < j->oh) {                                                                                          \
                for (Py_ssize_t ci = 0; ci < cpg; ci++)                                                                \
                    for (Py_ssize_t i = 0; i < kh; i++) {                                                              \
                        const Py_ssize_t iy = ny * j->sh - j->pt + i * j->dh;                                          \
                        if (iy < 0 || iy >= j->h) continue;                                                            \
                        const char *r = (const char *)(xin + (ci * j->h + iy) * j->wd);                                \
                        for (Py_ssize_t o = 0; o < j->wd * 4; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);               \
                    }                                                                                                  \
                for (Py_ssize_t o = 0; o < OCB && o < cnt; o++) {                                                      \
                    const char *r = (const char *)(yplane + o * plane + ny * j->ow);                                   \
                    for (Py_ssize_t q = 0; q < j->ow * 4; q += 64) _mm_prefetch(r + q, _MM_HINT_T0);                   \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (Py_ssize_t x0 = 0; x0 < j->ow; x0 += 16 * V) {                                                            \
            DCONV_STRIP_MASKS(V, SW)                                                                                   \
            __m512 acc[OCB][V];                                                                                        \
            DCONV_UNROLL for (int o = 0; o < OCB; o++)                                                                 \
                DCONV_UNROLL for (int v = 0; v < V; v++) acc[o][v] = _mm512_setzero_ps();                              \
            if (interior) {                                                                                            \
                DCONV_TAPS(0, OCB, V, SW)                                                                              \
            } else {                                                                                                   \
                DCONV_TAPS(1, OCB, V, SW)                                                                              \
            }                                                                                                          \
            float *yr = yplane + oy * j->ow + x0;                                                                      \
            DCONV_UNROLL for (int o = 0; o < OCB; o++) {                                                               \
                if (o >= cnt) break;                                                                                   \
                DCONV_UNROLL for (int v = 0; v < V; v++)                                                               \
                    dconv_store(yr + o * plane + 16 * v, out[v],                                             \
                                          dconv_act(_mm512_add_ps(acc[o][v], bias[o]), j->act, j->alpha, j->beta));    \
            }                                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
}

/* A depthwise tile's rows stored (those before oy1), with the bias and the activation. */
#define DWCONV_STORE_ROWS(R, V)                                                                                        \
    DCONV_UNROLL for (int r = 0; r < R; r++) {                                                                         \
        if (oy + r >= oy1) break;                                                                                      \
        float *yr = yplane + (oy + r) * j->ow + x0;                                                                    \
        DCONV_UNROLL for (int v = 0; v < V; v++)                                                                       \
            dconv_store(yr + 16 * v, out[v], dconv_act(_mm512_add_ps(acc[r][v], bias), j->act, j->alpha, j->beta));    \
    }

#define DWCONV_TAPS(MASKED, R, V, SW)                                                                                  \
    for (Py_ssize_t i = 0; i < kh; i++) {                                                                              \
        const float *rp[R];                                                                                            \
        DCONV_UNROLL for (int r = 0; r < R; r++) {                                                                     \
            const Py_ssize_t iy = (oy + r) * j->sh - j->pt + i * j->dh;                                             \
            rp[r] = (iy >= 0 && iy < j->h ? xin + iy * j->wd : zrow) + left;                                           \
        }                                                                                                              \
        const float *wi = wk + i * kw;                                                                                 \
        for (Py_ssize_t q = 0; q < kw; q++) {                                                                          \
            const __m512 wv = _mm512_set1_ps(wi[q]);                                                                   \
            DCONV_UNROLL for (int r = 0; r < R; r++) {                                                                 \
                const float *at = rp[r] + q * step;                                                                    \
                DCONV_UNROLL for (int v = 0; v < V; v++)                                                               \
                    acc[r][v] = _mm512_fmadd_ps(wv, DCONV_LOAD(MASKED, SW, v, q, at), acc[r][v]);                      \
            }                                                                                                          \
        }                                                                                                              \
    }

#define DWCONV_DEFINE(R, V, SW)                                                                                           \
__attribute__((target("avx512f"))) static void dwconv_##R##_##V##_##SW(                                                      \
        const dconv_job *j, const float *xin, Py_ssize_t b, Py_ssize_t oc0, Py_ssize_t cnt, Py_ssize_t oy0,            \
        Py_ssize_t oy1, float *yplane, const float *zrow) {                                                            \
    (void)b; (void)cnt;                                                                                                \
    DCONV_PROLOGUE(V, SW)                                                                                                 \
    const float *wk = j->w + oc0 * kh * kw;                                                                            \
    const __m512 bias = _mm512_set1_ps(j->bias ? j->bias[oc0] : 0.0f);                                                 \
    for (Py_ssize_t x0 = 0; x0 < j->ow; x0 += 16 * V) {                                                                \
        DCONV_STRIP_MASKS(V, SW)                                                                                       \
        for (Py_ssize_t oy = oy0; oy < oy1; oy += R) {                                                                 \
            __m512 acc[R][V];                                                                                          \
            DCONV_UNROLL for (int r = 0; r < R; r++)                                                                   \
                DCONV_UNROLL for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();                              \
            if (interior) {                                                                                            \
                DWCONV_TAPS(0, R, V, SW)                                                                               \
            } else {                                                                                                   \
                DWCONV_TAPS(1, R, V, SW)                                                                               \
            }                                                                                                          \
            DWCONV_STORE_ROWS(R, V)                                                                                    \
        }                                                                                                              \
    }                                                                                                                  \
}

#define DWCONV_STRIDES(R, V) DWCONV_DEFINE(R, V, 1) DWCONV_DEFINE(R, V, 2) DWCONV_DEFINE(R, V, 0)
DWCONV_STRIDES(8, 1) DWCONV_STRIDES(4, 2) DWCONV_STRIDES(2, 4)
#define DCONV_STRIDES(OCB, V) DCONV_DEFINE(OCB, V, 1) DCONV_DEFINE(OCB, V, 2) DCONV_DEFINE(OCB, V, 0)
DCONV_STRIDES(4, 1) DCONV_STRIDES(4, 2)
DCONV_STRIDES(8, 1) DCONV_STRIDES(8, 2)
DCONV_STRIDES(16, 1)
typedef void (*dconv_fn)(const dconv_job *, const float *, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t,
                          float *, const float *);

/* Depthwise K x K (3, 5), stride S = 1 or 2 in both directions, no dilation: each input row a tile reads is loaded
   once, V + 1 vectors (stride 2: 2 (V + 1), split into even and odd columns by two permutes), and every tap's
   shifted vector made from those registers by valignd: a tap per load became a load per row, and the rows are
   shared by the tile's R output rows. Unaligned loads at every tap had bound the simpler tiles (dwconv_*) to
   ~1.6 cycles a vector FMA here; these approach the FMA's throughput. */
__attribute__((target("avx512f"))) static inline __m512 dw_shift(__m512 lo, __m512 hi, int n) {
    switch (n) {  /* lanes n .. 15 of lo, then 0 .. n - 1 of hi (n a constant where it is inlined) */
    case 1: return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), 1));
    case 2: return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), 2));
    case 3: return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), 3));
    case 4: return _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), 4));
    default: return lo;
    }
}

#define DWK_DEFINE(R, V, S, K)                                                                                         \
__attribute__((target("avx512f"))) static void dwk_##R##_##V##_##S##_##K(                                              \
        const dconv_job *j, const float *xin, Py_ssize_t b, Py_ssize_t oc0, Py_ssize_t cnt, Py_ssize_t oy0,            \
        Py_ssize_t oy1, float *yplane, const float *zrow) {                                                            \
    (void)b; (void)cnt;                                                                                                \
    enum { NL = S == 1 ? V + 1 : 2 * (V + 1), IR = (R - 1) * S + K };                                                  \
    const float *wk = j->w + oc0 * K * K;                                                                              \
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);                  \
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);                   \
    (void)even; (void)odd;                                                                                             \
    const __m512 bias = _mm512_set1_ps(j->bias ? j->bias[oc0] : 0.0f);                                                 \
    for (Py_ssize_t oy = oy0; oy < oy1; oy += R) {  /* rows outer, as dconv_* */                                       \
        if (j->prefetch) {  /* the next tile's input and output rows, on their way to L1 */                                 \
            const Py_ssize_t ny = oy + R;                                                                              \
            if (ny < j->oh) {                                                                                          \
                for (int ir = 0; ir < IR; ir++) {                                                                      \
                    const Py_ssize_t iy = ny * S - j->pt + ir;                                                         \
                    if (iy < 0 || iy >= j->h) continue;                                                                \
                    const char *r = (const char *)(xin + iy * j->wd);                                                  \
                    for (Py_ssize_t o = 0; o < j->wd * 4; o += 64) _mm_prefetch(r + o, _MM_HINT_T0);                   \
                }                                                                                                      \
                for (Py_ssize_t rr = ny; rr < ny + R && rr < j->oh; rr++) {                                            \
                    const char *r = (const char *)(yplane + rr * j->ow);                                               \
                    for (Py_ssize_t q = 0; q < j->ow * 4; q += 64) _mm_prefetch(r + q, _MM_HINT_T0);                   \
                }                                                                                                      \
            }                                                                                                          \
        }                                                                                                              \
        for (Py_ssize_t x0 = 0; x0 < j->ow; x0 += 16 * V) {                                                            \
        const Py_ssize_t left = x0 * S - j->pl;                                                                        \
        __mmask16 lm[NL], out[V];                                                                                      \
        DCONV_UNROLL for (int u = 0; u < NL; u++) lm[u] = lanes_within(left + 16 * u, j->wd);                          \
        DCONV_UNROLL for (int v = 0; v < V; v++) out[v] = lanes_within(x0 + 16 * v, j->ow);                            \
            __m512 acc[R][V];                                                                                          \
            DCONV_UNROLL for (int r = 0; r < R; r++)                                                                   \
                DCONV_UNROLL for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();                              \
            DCONV_UNROLL for (int ir = 0; ir < IR; ir++) {                                                             \
                const Py_ssize_t iy = oy * S - j->pt + ir;                                                             \
                const float *row = (iy >= 0 && iy < j->h ? xin + iy * j->wd : zrow) + left;                            \
                __m512 a[NL], ev[V + 1], od[V + 1];                                                                    \
                DCONV_UNROLL for (int u = 0; u < NL; u++) a[u] = _mm512_maskz_loadu_ps(lm[u], row + 16 * u);           \
                DCONV_UNROLL for (int u = 0; u <= V; u++) {                                                            \
                    if (S == 1) {                                                                                      \
                        ev[u] = a[u];                                                                                  \
                        od[u] = a[u];                                                                                  \
                    } else {                                                                                           \
                        ev[u] = _mm512_permutex2var_ps(a[2 * u], even, a[2 * u + 1 < NL ? 2 * u + 1 : 0]);             \
                        od[u] = _mm512_permutex2var_ps(a[2 * u], odd, a[2 * u + 1 < NL ? 2 * u + 1 : 0]);              \
                    }                                                                                                  \
                }                                                                                                      \
                /* per vector and tap column, its shifted vector, used at once by every row it feeds */                \
                DCONV_UNROLL for (int v = 0; v < V; v++)                                                               \
                    DCONV_UNROLL for (int q = 0; q < K; q++) {                                                         \
                        const __m512 s = S == 1 ? dw_shift(ev[v], ev[v + 1], q)                                        \
                                                : q % 2 ? dw_shift(od[v], od[v + 1], q / 2)                            \
                                                        : dw_shift(ev[v], ev[v + 1], q / 2);                           \
                        DCONV_UNROLL for (int r = 0; r < R; r++) {                                                     \
                            const int i = ir - r * S;                                                                  \
                            if (i < 0 || i >= K) continue;                                                             \
                            acc[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(wk[i * K + q]), s, acc[r][v]);                  \
                        }                                                                                              \
                    }                                                                                                  \
            }                                                                                                          \
            DWCONV_STORE_ROWS(R, V)                                                                                    \
        }                                                                                                              \
    }                                                                                                                  \
}
#define DWK_SHAPES(S, K) DWK_DEFINE(8, 1, S, K) DWK_DEFINE(4, 2, S, K) DWK_DEFINE(2, 4, S, K)
DWK_SHAPES(1, 3) DWK_SHAPES(1, 5) DWK_SHAPES(2, 3) DWK_SHAPES(2, 5)

static dconv_fn dwk_pick(Py_ssize_t v, Py_ssize_t s, Py_ssize_t k) {
#define DWK_CASE(S, K) \
    if (s == S && k == K) return v == 1 ? dwk_8_1_##S##_##K : v == 2 ? dwk_4_2_##S##_##K : dwk_2_4_##S##_##K;
    DWK_CASE(1, 3) DWK_CASE(1, 5) DWK_CASE(2, 3) DWK_CASE(2, 5)
#undef DWK_CASE
    return NULL;
}


static dconv_fn dconv_pick(Py_ssize_t ocb, Py_ssize_t v, Py_ssize_t sw) {
#define DCONV_CASE(OCB, V) \
    case OCB * 8 + V: return sw == 1 ? dconv_##OCB##_##V##_1 : sw == 2 ? dconv_##OCB##_##V##_2 : dconv_##OCB##_##V##_0;
    switch (ocb * 8 + v) {
    DCONV_CASE(4, 1) DCONV_CASE(4, 2) DCONV_CASE(8, 1) DCONV_CASE(8, 2) DCONV_CASE(16, 1)
    default: return NULL;
    }
#undef DCONV_CASE
}

/* depthwise tiles of any kernel, stride and dilation (dwk_pick's cover the common shapes) */
static dconv_fn dwconv_pick(Py_ssize_t v, Py_ssize_t sw) {
#define DWCONV_CASE(R, V) \
    case V: return sw == 1 ? dwconv_##R##_##V##_1 : sw == 2 ? dwconv_##R##_##V##_2 : dwconv_##R##_##V##_0;
    switch (v) {
    DWCONV_CASE(8, 1) DWCONV_CASE(4, 2) DWCONV_CASE(2, 4)
    default: return NULL;
    }
#undef DWCONV_CASE
}

/* Items: (sample, group, chunk of DCONV_ROWS output rows); a dense conv's item computes every channel block of its
   group on those rows, so the rows' input stays in L1 across the blocks. */
#define DCONV_ROWS 8
static void *dconv_worker(void *arg) {
    const dconv_job *j = (const dconv_job *)arg;
    const Py_ssize_t cpg = j->c / j->group, mpg = j->m / j->group, chunks = (j->oh + DCONV_ROWS - 1) / DCONV_ROWS;
    /* depthwise 3x3 or 5x5 without dilation at stride 1 or 2 both ways: the tiles that load each input row once */
    const Py_ssize_t k = j->kh == j->kw && j->dh == 1 && j->dw == 1 && (j->kh == 3 || j->kh == 5) ? j->kh : 0;
    const dconv_fn fn = j->ocb > 1 ? dconv_pick(j->ocb, j->v, j->sw)
                        : k && j->sh == j->sw && (j->sw == 1 || j->sw == 2) ? dwk_pick(j->v, j->sw, k)
                        : dwconv_pick(j->v, j->sw);
    float *zrow = calloc((size_t)j->wd, sizeof(float));  /* the rows above and below the input */
    if (!fn || !zrow) {
        free(zrow);
        return (void *)1;
    }
    for (Py_ssize_t it = j->item_begin; it < j->item_end; it++) {
        const Py_ssize_t chunk = it % chunks, g = (it / chunks) % j->group, s = it / (chunks * j->group);
        const Py_ssize_t oy0 = chunk * DCONV_ROWS, oy1 = oy0 + DCONV_ROWS < j->oh ? oy0 + DCONV_ROWS : j->oh;
        const float *xin = j->x + (s * j->c + g * cpg) * j->h * j->wd;
        for (Py_ssize_t b = 0; b < j->blocks; b++) {
            const Py_ssize_t oc0 = g * mpg + b * j->ocb;
            const Py_ssize_t cnt = (g + 1) * mpg - oc0 < j->ocb ? (g + 1) * mpg - oc0 : j->ocb;
            fn(j, xin, g * j->blocks + b, oc0, cnt, oy0, oy1, j->y + (s * j->m + oc0) * j->oh * j->ow, zrow);
        }
    }
    free(zrow);
    return NULL;
}
#endif

PyDoc_STRVAR(direct_conv2d_doc,
"direct_conv2d(x, w, bias, y, n, c, h, w_in, m, oh, ow, kh, kw, group, sh, sw, dh, dw, pad_top, pad_left, threads,\n"
"              act=0, alpha=0, beta=0, impl=0)\n\n"
"y[n, m, oh, ow] = act(bias[m] + sum over the group's input channels and the kernel taps of w * x) (NCHW,\n"
"float32, C-contiguous buffers; bias may be None). act: 0 none, 1 Relu, 2 HardSwish (alpha, beta), 3\n"
"HardSigmoid (alpha, beta), 4 Clip (min alpha, max beta), 5 LeakyRelu (alpha). Sizes are the caller's,\n"
"checked against the buffers here. impl: 0 the AVX-512 kernel where the CPU has it, 1 the 8-float kernel.");

static PyObject *direct_conv2d_body(const conv_job *jp, PyObject *xo, PyObject *wo, PyObject *bo, PyObject *yo,
                                    Py_ssize_t threads, int impl);

static PyObject *direct_conv2d(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *wo, *bo, *yo;
    conv_job j;
    Py_ssize_t threads;
    int impl = 0;
    j.act = ACT_NONE;
    j.alpha = j.beta = 0.0;
    if (!PyArg_ParseTuple(args, "OOOOnnnnnnnnnnnnnnnnn|iddi", &xo, &wo, &bo, &yo, &j.n, &j.c, &j.h, &j.wd, &j.m,
                          &j.oh, &j.ow, &j.kh, &j.kw, &j.group, &j.sh, &j.sw, &j.dh, &j.dw, &j.pt, &j.pl, &threads,
                          &j.act, &j.alpha, &j.beta, &impl))
        return NULL;
    return direct_conv2d_body(&j, xo, wo, bo, yo, threads, impl);
}

PyDoc_STRVAR(direct_conv2d_fast_doc,
"direct_conv2d_fast(x, w, bias, y, geometry, threads, act, alpha, beta)\n\n"
"direct_conv2d with its sizes as one tuple, geometry = (n, c, h, wd, m, oh, ow, kh, kw, group, sh, sw, dh, dw, pt,\n"
"pl), made once per input size by the caller, and a vectorcall: a small conv's call took 0.75 us, mostly parsing\n"
"25 arguments (MobileNetV3-style b1 makes 27 of them).");

static PyObject *direct_conv2d_fast(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyTuple_CheckExact(args[4]) || PyTuple_GET_SIZE(args[4]) != 16) {
        PyErr_SetString(PyExc_TypeError, "direct_conv2d_fast(x, w, bias, y, geometry (16 ints), threads, act, alpha, beta)");
        return NULL;
    }
    conv_job j;
    Py_ssize_t *sizes[16] = {&j.n, &j.c, &j.h, &j.wd, &j.m, &j.oh, &j.ow, &j.kh, &j.kw, &j.group, &j.sh, &j.sw,
                             &j.dh, &j.dw, &j.pt, &j.pl};
    for (int i = 0; i < 16; i++) {
        *sizes[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[4], i));
        if (*sizes[i] == -1 && PyErr_Occurred()) return NULL;
    }
    const Py_ssize_t threads = PyLong_AsSsize_t(args[5]);
    const long act = PyLong_AsLong(args[6]);
    j.alpha = PyFloat_AsDouble(args[7]);
    j.beta = PyFloat_AsDouble(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (act < INT_MIN || act > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "direct_conv2d: unknown activation");
        return NULL;
    }
    j.act = (int)act;
    return direct_conv2d_body(&j, args[0], args[1], args[2], args[3], threads, 0);
}

static PyObject *direct_conv2d_body(const conv_job *jp, PyObject *xo, PyObject *wo, PyObject *bo, PyObject *yo,
                                    Py_ssize_t threads, int impl) {
    conv_job j = *jp;
    if (j.act < 0 || j.act >= ACT_COUNT) {
        PyErr_SetString(PyExc_ValueError, "direct_conv2d: unknown activation");
        return NULL;
    }
    if (j.n < 0 || j.c <= 0 || j.h <= 0 || j.wd <= 0 || j.m <= 0 || j.oh < 0 || j.ow < 0 || j.kh <= 0 || j.kw <= 0 ||
        j.group <= 0 || j.c % j.group || j.m % j.group || j.sh <= 0 || j.sw <= 0 || j.dh <= 0 || j.dw <= 0 ||
        j.kw > 64 || j.sw > MAX_STRIDE) {
        PyErr_SetString(PyExc_ValueError, "direct_conv2d: sizes out of range");
        return NULL;
    }
    Py_buffer xb, wb, bb, yb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(wo, &wb, "w", 0) < 0) { PyBuffer_Release(&xb); return NULL; }
    int has_bias = bo != Py_None;
    if (has_bias && as_float32(bo, &bb, "bias", 0) < 0) { PyBuffer_Release(&xb); PyBuffer_Release(&wb); return NULL; }
    if (as_float32(yo, &yb, "y", 1) < 0) {
        PyBuffer_Release(&xb); PyBuffer_Release(&wb); if (has_bias) PyBuffer_Release(&bb);
        return NULL;
    }
    PyObject *result = NULL;
    if (xb.len != (Py_ssize_t)4 * j.n * j.c * j.h * j.wd || wb.len != (Py_ssize_t)4 * j.m * (j.c / j.group) * j.kh * j.kw ||
        (has_bias && bb.len != (Py_ssize_t)4 * j.m) || yb.len != (Py_ssize_t)4 * j.n * j.m * j.oh * j.ow) {
        PyErr_SetString(PyExc_ValueError, "direct_conv2d: a buffer's size does not match the sizes given");
        goto done;
    }
    j.x = xb.buf; j.w = wb.buf; j.bias = has_bias ? bb.buf : NULL; j.y = yb.buf;
#ifdef KILN_X86_DISPATCH
    if (has_avx512 && impl == 0) {
        dconv_job d = {j.x, j.w, j.bias, j.y, j.n, j.c, j.h, j.wd, j.m, j.oh, j.ow, j.kh, j.kw, j.group, j.sh, j.sw,
                       j.dh, j.dw, j.pt, j.pl, j.act, (float)j.alpha, (float)j.beta, 1, 1, 1, NULL, 0, 0, 0};
        d.prefetch = xb.len + yb.len >= DCONV_PREFETCH_BYTES;
        const Py_ssize_t mpg = j.m / j.group, cpg = j.c / j.group, taps = cpg * j.kh * j.kw;
        if (j.kh == 1 && j.kw == 1 && j.sh == 1 && j.sw == 1 && j.pt == 0 && j.pl == 0 && j.oh == j.h && j.ow == j.wd) {
            /* a pointwise conv without padding reads each plane as one flat run: seen as rows of 64, 32 or 16 (the
               first that divides it), its strips are full vectors with no masked loads (a 56 x 56 map's rows of 56
               left a quarter of every second strip's lanes idle) */
            const Py_ssize_t flat = j.h * j.wd;
            for (Py_ssize_t width = 64; width >= 16; width /= 2)
                if (flat % width == 0 && flat / width >= 2) {
                    d.h = d.oh = flat / width;
                    d.wd = d.ow = width;
                    break;
                }
        }
        if (mpg == 1 && cpg == 1) {  /* depthwise: one channel, R rows x V vectors (dwconv_pick) */
            d.ocb = 1;
            d.v = d.ow <= 16 ? 1 : d.ow <= 32 ? 2 : 4;
        } else {  /* OCB channels x V vectors; the last block of a group is padded with zero weights */
            d.v = d.ow <= 16 ? 1 : 2;
            /* at stride 2 each vector costs two loads and a permute: 16 channels x 1 vector feeds each 16 FMAs
               (the 3-channel stem, 224x224 -> 112x112, one thread: 79 us, against 90 as 8 x 2) */
            if (j.sw == 2 && mpg % 16 == 0) d.v = 1;
            d.ocb = mpg <= 4 ? 4 : d.v == 1 && mpg % 16 == 0 ? 16 : 8;
        }
        d.blocks = (mpg + d.ocb - 1) / d.ocb;
        float *wp = NULL;
        if (d.ocb > 1) {
            wp = calloc((size_t)(j.group * d.blocks * taps * d.ocb), sizeof(float));
            if (!wp) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t g = 0; g < j.group; g++)
                for (Py_ssize_t o = 0; o < mpg; o++)
                    for (Py_ssize_t t = 0; t < taps; t++)
                        wp[((g * d.blocks + o / d.ocb) * taps + t) * d.ocb + o % d.ocb] = j.w[(g * mpg + o) * taps + t];
            d.wp = wp;
        }
        const Py_ssize_t items = j.n * j.group * ((d.oh + DCONV_ROWS - 1) / DCONV_ROWS);
        if (threads < 1) threads = 1;
        if (threads > MAX_THREADS) threads = MAX_THREADS;
        if (threads > items) threads = items > 0 ? items : 1;
        dconv_job djobs[MAX_THREADS];
        void *dtasks[MAX_THREADS];
        int dfailed = 0;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t t = 0; t < threads; t++) {
            djobs[t] = d;
            djobs[t].item_begin = items * t / threads;
            djobs[t].item_end = items * (t + 1) / threads;
            dtasks[t] = &djobs[t];
        }
        if (items > 0 && d.ow > 0) dfailed = run_tasks(dconv_worker, dtasks, (int)threads);
        Py_END_ALLOW_THREADS
        free(wp);
        if (dfailed) {
            PyErr_NoMemory();
            goto done;
        }
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
#endif
    /* phase image sizes: the output plus the largest tap shift, and one spare row for the last tap's run */
    j.hq = j.oh + ((j.kh - 1) * j.dh) / j.sh + 1;
    j.lq = j.ow + ((j.kw - 1) * j.dw) / j.sw;
    j.chunk = j.lq >= CHUNK ? j.lq : (CHUNK / j.lq) * j.lq;
    for (Py_ssize_t b = 0; b < j.sw; b++) {  /* columns kk with 0 <= b + kk*sw - pl < wd come from the input */
        Py_ssize_t lo = ceil_div(j.pl - b, j.sw), hi = ceil_div(j.wd + j.pl - b, j.sw);
        if (lo < 0) lo = 0;
        if (hi > j.lq) hi = j.lq;
        if (hi < lo) hi = lo;
        j.col_lo[b] = lo;
        j.col_hi[b] = hi;
    }
    j.prepared = NULL;
    Py_ssize_t planes = j.n * j.m;
    int failed = 0;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > planes) threads = planes > 0 ? planes : 1;
    conv_job jobs[MAX_THREADS];
    void *tasks[MAX_THREADS];
    Py_BEGIN_ALLOW_THREADS
    if (j.c / j.group > 1 && j.n * j.m > 0) {  /* dense: each input plane is read by several output planes */
        const Py_ssize_t plane_in = j.sh * j.sw * j.hq * j.lq;
        /* malloc, not calloc: prepare_plane writes every element, padding included; only the slack is zeroed */
        j.prepared = malloc(sizeof(float) * (size_t)(j.n * j.c * plane_in + BLOCK));
        if (j.prepared) {
            memset(j.prepared + j.n * j.c * plane_in, 0, sizeof(float) * BLOCK);
            prepare_all(&j, j.prepared);
        } else {
            failed = 1;
        }
    }
    for (Py_ssize_t t = 0; t < threads; t++) {
        jobs[t] = j;
        jobs[t].plane_begin = planes * t / threads;
        jobs[t].plane_end = planes * (t + 1) / threads;
        tasks[t] = &jobs[t];
    }
    if (!failed) failed = run_tasks(conv_worker, tasks, (int)threads);  /* the sgemm's pool */
    free(j.prepared);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&xb); PyBuffer_Release(&wb); if (has_bias) PyBuffer_Release(&bb); PyBuffer_Release(&yb);
    return result;
}

/* Python entry points of the row kernels: float32 C-contiguous buffers, sizes checked against them. */
PyDoc_STRVAR(gelu_doc, "gelu(x, y, negh, threads=1): y = Gelu(x) (exact), float32 buffers of one size; negh: the polynomial.");

/* The row kernels over several threads (the sgemm's pool): whole rows per thread (flat kernels: runs of 64
   floats), for the large tensors of batched encoders (a [32, 128, 512] Gelu took 1.7 ms on one thread). */
enum { ROWS_GELU, ROWS_LAYER_NORM, ROWS_SOFTMAX, ROWS_ACT, ROWS_MEAN, ROWS_SCALE };
typedef struct {
    int kind;
    const float *x;
    float *y;
    Py_ssize_t rows, n;  /* flat kinds: rows floats, n 1 */
    const float *a, *b;  /* gelu: negh; layer norm: scale, bias */
    int terms, act;
    float eps;
    double alpha, beta;
} rows_task;

static void *rows_worker(void *arg) {
    const rows_task *t = (const rows_task *)arg;
    switch (t->kind) {
    case ROWS_GELU: gelu_rows(t->x, t->y, t->rows, t->a, t->terms); break;
    case ROWS_LAYER_NORM: layer_norm_rows(t->x, t->y, t->rows, t->n, t->a, t->b, t->eps); break;
    case ROWS_SOFTMAX: softmax_rows(t->x, t->y, t->rows, t->n); break;
    case ROWS_ACT: act_rows(t->x, t->y, t->rows, t->act, t->alpha, t->beta); break;
    case ROWS_MEAN: mean_rows(t->x, t->y, t->rows, t->n); break;
    case ROWS_SCALE: scale_rows(t->x, t->y, t->rows, t->n, t->a); break;
    }
    return NULL;
}

/* `whole` split into `threads` parts of whole rows (flat kinds: of 64 floats), run on the pool */
static void run_rows(const rows_task *whole, Py_ssize_t threads) {
    const int flat = whole->kind == ROWS_GELU || whole->kind == ROWS_ACT;
    const Py_ssize_t unit = flat ? 64 : 1, units = (whole->rows + unit - 1) / unit;
    if (threads > units) threads = units;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) {
        rows_worker((void *)whole);
        return;
    }
    rows_task parts[MAX_THREADS];
    void *args[MAX_THREADS];
    const Py_ssize_t out_row = whole->kind == ROWS_MEAN ? 1 : (flat ? 1 : whole->n), in_row = flat ? 1 : whole->n;
    for (Py_ssize_t t = 0; t < threads; t++) {
        const Py_ssize_t begin = units * t / threads * unit, end = t + 1 == threads ? whole->rows : units * (t + 1) / threads * unit;
        parts[t] = *whole;
        parts[t].x = whole->x + begin * in_row;
        parts[t].y = whole->y + begin * out_row;
        parts[t].rows = end - begin;
        if (whole->kind == ROWS_SCALE) parts[t].a = whole->a + begin;  /* a factor a row */
        args[t] = &parts[t];
    }
    run_tasks(rows_worker, args, (int)threads);
}

static PyObject *gelu(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *yo, *ho;
    Py_ssize_t threads = 1;
    if (!PyArg_ParseTuple(args, "OOO|n", &xo, &yo, &ho, &threads)) return NULL;
    Py_buffer xb, yb, hb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    if (as_float32(ho, &hb, "negh", 0) < 0) { PyBuffer_Release(&xb); PyBuffer_Release(&yb); return NULL; }
    PyObject *result = NULL;
    const int terms = (int)(hb.len / 4);
    if (xb.len != yb.len || terms < 2 || terms > 16) {
        PyErr_SetString(PyExc_ValueError, "gelu: x and y must have one size, negh 2 to 16 terms");
    } else {
        Py_BEGIN_ALLOW_THREADS
        const rows_task t = {.kind = ROWS_GELU, .x = xb.buf, .y = yb.buf, .rows = xb.len / 4, .n = 1, .a = hb.buf,
                             .terms = terms};
        run_rows(&t, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&yb); PyBuffer_Release(&hb);
    return result;
}

PyDoc_STRVAR(layer_norm_doc, "layer_norm(x, y, n, scale, bias, eps, threads=1): LayerNorm over rows of n (bias may be None).");

static PyObject *layer_norm(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *yo, *so, *bo;
    Py_ssize_t n, threads = 1;
    float eps;
    if (!PyArg_ParseTuple(args, "OOnOOf|n", &xo, &yo, &n, &so, &bo, &eps, &threads)) return NULL;
    Py_buffer xb, yb, sb, bb;
    int has_bias = bo != Py_None;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    if (as_float32(so, &sb, "scale", 0) < 0) { PyBuffer_Release(&xb); PyBuffer_Release(&yb); return NULL; }
    if (has_bias && as_float32(bo, &bb, "bias", 0) < 0) {
        PyBuffer_Release(&xb); PyBuffer_Release(&yb); PyBuffer_Release(&sb);
        return NULL;
    }
    PyObject *result = NULL;
    if (n <= 0 || xb.len != yb.len || xb.len % (4 * n) || sb.len != 4 * n || (has_bias && bb.len != 4 * n)) {
        PyErr_SetString(PyExc_ValueError, "layer_norm: x and y of one size, a multiple of n; scale and bias of n");
    } else {
        Py_BEGIN_ALLOW_THREADS
        const rows_task t = {.kind = ROWS_LAYER_NORM, .x = xb.buf, .y = yb.buf, .rows = xb.len / (4 * n), .n = n,
                             .a = sb.buf, .b = has_bias ? bb.buf : NULL, .eps = eps};
        run_rows(&t, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&yb); PyBuffer_Release(&sb); if (has_bias) PyBuffer_Release(&bb);
    return result;
}

/* The entry points over rows of n floats, (x, y, n): y as large as x (per_row 0) or one float a row (1). */
static PyObject *rows_entry(PyObject *args, const char *name, int per_row, int kind) {
    PyObject *xo, *yo;
    Py_ssize_t n, threads = 1;
    if (!PyArg_ParseTuple(args, "OOn|n", &xo, &yo, &n, &threads)) return NULL;
    Py_buffer xb, yb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    PyObject *result = NULL;
    if (n <= 0 || xb.len % (4 * n) || yb.len != (per_row ? xb.len / n : xb.len)) {
        PyErr_Format(PyExc_ValueError, "%s: x must be rows of n floats, and y %s", name,
                     per_row ? "one float a row" : "as large as x");
    } else {
        Py_BEGIN_ALLOW_THREADS
        const rows_task t = {.kind = kind, .x = xb.buf, .y = yb.buf, .rows = xb.len / (4 * n), .n = n};
        run_rows(&t, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&yb);
    return result;
}

PyDoc_STRVAR(softmax_doc, "softmax(x, y, n, threads=1): Softmax over rows of n.");

static PyObject *softmax(PyObject *Py_UNUSED(self), PyObject *args) { return rows_entry(args, "softmax", 0, ROWS_SOFTMAX); }


PyDoc_STRVAR(elementwise_doc,
"elementwise(inputs, kinds, periods, outputs, program, nreg, total, threads=1, impl=0): run a compiled\n"
"FusedElementwise body (native.py). inputs: float32 buffers; kinds: 0 full (total floats), 1 scalar, 2 periodic\n"
"(periods[i] floats repeated); outputs: float32 buffers of total floats; program: int32 (op, dst, a, b)\n"
"quadruples then the output registers; nreg: registers in all (inputs first). impl: 0 Exp, Sigmoid and Tanh on\n"
"AVX-512 where the CPU has it, 1 on 8 lanes (what a CPU without it runs).");

static PyObject *elementwise(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ins, *kinds, *periods, *outs, *progo;
    int nreg;
    Py_ssize_t total;
    Py_ssize_t threads = 1;
    int impl = 0;
    if (!PyArg_ParseTuple(args, "OOOOOin|ni", &ins, &kinds, &periods, &outs, &progo, &nreg, &total, &threads, &impl))
        return NULL;
    if (!PyList_Check(ins) || !PyList_Check(kinds) || !PyList_Check(periods) || !PyList_Check(outs)) {
        PyErr_SetString(PyExc_TypeError, "elementwise: inputs, kinds, periods and outputs are lists");
        return NULL;
    }
    const Py_ssize_t nin = PyList_GET_SIZE(ins), nout = PyList_GET_SIZE(outs);
    if (nin > 65536 || nout > 65536 || nreg > 1 << 20 || nreg < nin || total < 0 ||
        PyList_GET_SIZE(kinds) != nin || PyList_GET_SIZE(periods) != nin) {
        PyErr_SetString(PyExc_ValueError, "elementwise: too many registers, or lists of different lengths");
        return NULL;
    }
    Py_buffer pb;
    int held = 0, have_prog = 0;
    PyObject *result = NULL;
    float *regs = NULL;
    const float **src = NULL;
    Py_buffer *bufs = calloc((size_t)(nin + nout + 1), sizeof(Py_buffer));
    const float **inp = calloc((size_t)nin + 1, sizeof(float *));
    float **outp = calloc((size_t)nout + 1, sizeof(float *));
    int *kind = calloc((size_t)nin + 1, sizeof(int)), *outreg = calloc((size_t)nout + 1, sizeof(int));
    Py_ssize_t *period = calloc((size_t)nin + 1, sizeof(Py_ssize_t));
    if (!bufs || !inp || !outp || !kind || !outreg || !period) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nin; i++) {
        if (as_float32(PyList_GET_ITEM(ins, i), &bufs[held], "input", 0) < 0) goto done;
        inp[i] = bufs[held].buf;
        kind[i] = (int)PyLong_AsLong(PyList_GET_ITEM(kinds, i));
        period[i] = PyLong_AsSsize_t(PyList_GET_ITEM(periods, i));
        const Py_ssize_t len = bufs[held].len / 4;
        held++;
        if (PyErr_Occurred()) goto done;
        if ((kind[i] == KIND_FULL && len != total) || (kind[i] == KIND_SCALAR && len < 1) ||
            (kind[i] == KIND_PERIODIC && (period[i] < 1 || len != period[i])) || kind[i] < 0 || kind[i] > 2) {
            PyErr_SetString(PyExc_ValueError, "elementwise: an input's size does not match its kind");
            goto done;
        }
    }
    for (Py_ssize_t o = 0; o < nout; o++) {
        if (as_float32(PyList_GET_ITEM(outs, o), &bufs[held], "output", 1) < 0) goto done;
        outp[o] = bufs[held].buf;
        if (bufs[held++].len / 4 != total) {
            PyErr_SetString(PyExc_ValueError, "elementwise: an output's size is not total");
            goto done;
        }
    }
    if (PyObject_GetBuffer(progo, &pb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
    have_prog = 1;
    if (pb.itemsize != 4 || (pb.len / 4 - nout) % 4 != 0 || pb.len / 4 < nout) {
        PyErr_SetString(PyExc_ValueError, "elementwise: program must be int32 quadruples then the outputs");
        goto done;
    }
    const int *prog = pb.buf;
    const int nprog = (int)((pb.len / 4 - nout) / 4);
    for (int k = 0; k < nprog; k++) {
        const int *q = prog + 4 * k;
        if (q[0] < 0 || q[0] >= EW_COUNT || q[1] < nin || q[1] >= nreg || q[2] < 0 || q[2] >= nreg || q[3] >= nreg) {
            PyErr_SetString(PyExc_ValueError, "elementwise: an instruction names an unknown op or register");
            goto done;
        }
    }
    for (Py_ssize_t o = 0; o < nout; o++) {
        outreg[o] = prog[4 * nprog + o];
        if (outreg[o] < 0 || outreg[o] >= nreg) {
            PyErr_SetString(PyExc_ValueError, "elementwise: an output names an unknown register");
            goto done;
        }
    }
    const Py_ssize_t chunk = total < CHUNK ? (total > 0 ? total : 1) : CHUNK;
    const Py_ssize_t chunks = (total + chunk - 1) / chunk;
    if (threads > chunks) threads = chunks;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    regs = malloc(sizeof(float) * (size_t)threads * (size_t)nreg * (size_t)chunk);
    src = malloc(sizeof(float *) * (size_t)threads * (size_t)nreg);
    if (!regs || !src) {
        PyErr_NoMemory();
        goto done;
    }
    /* parts of whole chunks, one a thread (the sgemm's pool); each with its own registers */
    ew_job parts[MAX_THREADS];
    void *tasks[MAX_THREADS];
    for (Py_ssize_t t = 0; t < threads; t++) {
        parts[t] = (ew_job){(int)nin, nreg, nprog, (int)nout, prog, outreg, kind, period, inp, (float *const *)outp,
                            total, chunk, chunks * t / threads * chunk,
                            t + 1 == threads ? total : chunks * (t + 1) / threads * chunk,
                            regs + t * nreg * chunk, (const float **)src + t * nreg, has_avx512 && impl == 0};
        tasks[t] = &parts[t];
    }
    Py_BEGIN_ALLOW_THREADS
    run_tasks(ew_worker, tasks, (int)threads);
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    free(regs);
    free(src);
    if (have_prog) PyBuffer_Release(&pb);
    for (int i = 0; i < held; i++) PyBuffer_Release(&bufs[i]);
    free(bufs);
    free(inp);
    free(outp);
    free(kind);
    free(outreg);
    free(period);
    return result;
}


PyDoc_STRVAR(activation_doc, "activation(x, y, act, alpha, beta, threads=1): y = act(x) (direct_conv2d's activation codes).");

static PyObject *activation(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *yo;
    int act;
    double alpha, beta;
    Py_ssize_t threads = 1;
    if (!PyArg_ParseTuple(args, "OOidd|n", &xo, &yo, &act, &alpha, &beta, &threads)) return NULL;
    if (act <= ACT_NONE || act >= ACT_COUNT) {
        PyErr_SetString(PyExc_ValueError, "activation: unknown activation");
        return NULL;
    }
    Py_buffer xb, yb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    PyObject *result = NULL;
    if (xb.len != yb.len || xb.buf == yb.buf) {
        PyErr_SetString(PyExc_ValueError, "activation: x and y must be of one size, and distinct");
    } else {
        Py_BEGIN_ALLOW_THREADS
        const rows_task t = {.kind = ROWS_ACT, .x = xb.buf, .y = yb.buf, .rows = xb.len / 4, .n = 1, .act = act,
                             .alpha = alpha, .beta = beta};
        run_rows(&t, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&yb);
    return result;
}

PyDoc_STRVAR(scale_doc, "scale(x, s, y, n, threads=1): y[r, :] = x[r, :] * s[r] over rows of n floats (y may be x).");

static PyObject *scale(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *so, *yo;
    Py_ssize_t n, threads = 1;
    if (!PyArg_ParseTuple(args, "OOOn|n", &xo, &so, &yo, &n, &threads)) return NULL;
    Py_buffer xb, sb, yb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(so, &sb, "s", 0) < 0) { PyBuffer_Release(&xb); return NULL; }
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&xb); PyBuffer_Release(&sb); return NULL; }
    PyObject *result = NULL;
    if (n <= 0 || xb.len % (4 * n) || yb.len != xb.len || sb.len != xb.len / n) {
        PyErr_SetString(PyExc_ValueError, "scale: x must be rows of n floats, s one float a row, y as large as x");
    } else {
        Py_BEGIN_ALLOW_THREADS
        const rows_task t = {.kind = ROWS_SCALE, .x = xb.buf, .y = yb.buf, .rows = xb.len / (4 * n), .n = n,
                             .a = sb.buf};
        run_rows(&t, threads);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&sb); PyBuffer_Release(&yb);
    return result;
}

PyDoc_STRVAR(mean_doc, "mean(x, y, n, threads=1): y[r] = the mean of row r of n floats of x.");

static PyObject *mean(PyObject *Py_UNUSED(self), PyObject *args) { return rows_entry(args, "mean", 1, ROWS_MEAN); }

PyDoc_STRVAR(im2col_doc,
"im2col(x, cols, size, c, h, w, kh, kw, sh, sw, dh, dw, pad_top, pad_left, oh, ow)\n\n"
"cols[(ci, i, j), (s, oy, ox)] = x[s, ci, oy*sh - pad_top + i*dh, ox*sw - pad_left + j*dw], 0 outside the input\n"
"(float32, C-contiguous; cols has c*kh*kw rows of size*oh*ow).");

static PyObject *im2col(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *co;
    cols_geometry g;
    if (!PyArg_ParseTuple(args, "OOnnnnnnnnnnnnnn", &xo, &co, &g.size, &g.c, &g.h, &g.w, &g.kh, &g.kw, &g.sh, &g.sw,
                          &g.dh, &g.dw, &g.pt, &g.pl, &g.oh, &g.ow))
        return NULL;
    if (g.size < 0 || g.c < 0 || g.h < 0 || g.w < 0 || g.kh < 1 || g.kw < 1 || g.sh < 1 || g.sw < 1 || g.dh < 1
        || g.dw < 1 || g.oh < 0 || g.ow < 0) {
        PyErr_SetString(PyExc_ValueError, "im2col: bad geometry");
        return NULL;
    }
    Py_buffer xb, cb;
    if (as_float32(xo, &xb, "x", 0) < 0) return NULL;
    if (as_float32(co, &cb, "cols", 1) < 0) { PyBuffer_Release(&xb); return NULL; }
    PyObject *result = NULL;
    if (xb.len / 4 != g.size * g.c * g.h * g.w || cb.len / 4 < g.c * g.kh * g.kw * g.size * g.oh * g.ow) {
        PyErr_SetString(PyExc_ValueError, "im2col: a buffer's size does not match the geometry");
    } else {
        Py_BEGIN_ALLOW_THREADS
        im2col_rows(xb.buf, cb.buf, &g);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&xb); PyBuffer_Release(&cb);
    return result;
}

PyDoc_STRVAR(gemm_out_doc,
"gemm_out(acc, y, bias, m, size, span, act, alpha, beta)\n\n"
"y[s, mm, :span] = act(acc[mm, s*span:(s+1)*span] + bias[mm]) (bias may be None; acc may be y where size is 1;\n"
"act as in direct_conv2d).");

static PyObject *gemm_out(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *ao, *yo, *bo;
    Py_ssize_t m, size, span;
    int act;
    double alpha, beta;
    if (!PyArg_ParseTuple(args, "OOOnnnidd", &ao, &yo, &bo, &m, &size, &span, &act, &alpha, &beta)) return NULL;
    if (act < ACT_NONE || act >= ACT_COUNT || m < 0 || size < 0 || span < 0) {
        PyErr_SetString(PyExc_ValueError, "gemm_out: bad arguments");
        return NULL;
    }
    Py_buffer ab, yb, bb;
    int has_bias = bo != Py_None;
    if (as_float32(ao, &ab, "acc", 0) < 0) return NULL;
    if (as_float32(yo, &yb, "y", 1) < 0) { PyBuffer_Release(&ab); return NULL; }
    if (has_bias && as_float32(bo, &bb, "bias", 0) < 0) { PyBuffer_Release(&ab); PyBuffer_Release(&yb); return NULL; }
    PyObject *result = NULL;
    const Py_ssize_t total = m * size * span;
    if (ab.len / 4 != total || yb.len / 4 != total || (has_bias && bb.len / 4 != m)
        || (ab.buf == yb.buf && size != 1)) {
        PyErr_SetString(PyExc_ValueError, "gemm_out: a buffer's size does not match (or acc is y with size > 1)");
    } else {
        Py_BEGIN_ALLOW_THREADS
        gemm_out_rows(ab.buf, yb.buf, has_bias ? bb.buf : NULL, m, size, span, act, alpha, beta);
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&ab); PyBuffer_Release(&yb);
    if (has_bias) PyBuffer_Release(&bb);
    return result;
}

static PyMethodDef methods[] = {
    {"sgemm", sgemm, METH_VARARGS, sgemm_doc},
    {"matmul", matmul_strided, METH_VARARGS, matmul_doc},
    {"direct_conv2d_fast", (PyCFunction)(void (*)(void))direct_conv2d_fast, METH_FASTCALL, direct_conv2d_fast_doc},
    {"winograd_weights", winograd_weights, METH_VARARGS, winograd_weights_doc},
    {"pack", pack, METH_VARARGS, pack_doc},
    {"max_pool", max_pool, METH_VARARGS, max_pool_doc},
    {"winograd_input", winograd_input, METH_VARARGS, winograd_input_doc},
    {"winograd_output", winograd_output, METH_VARARGS, winograd_output_doc},
    {"im2col", im2col, METH_VARARGS, im2col_doc},
    {"gemm_out", gemm_out, METH_VARARGS, gemm_out_doc},
    {"direct_conv2d", direct_conv2d, METH_VARARGS, direct_conv2d_doc},
    {"gelu", gelu, METH_VARARGS, gelu_doc},
    {"layer_norm", layer_norm, METH_VARARGS, layer_norm_doc},
    {"softmax", softmax, METH_VARARGS, softmax_doc},
    {"elementwise", elementwise, METH_VARARGS, elementwise_doc},
    {"activation", activation, METH_VARARGS, activation_doc},
    {"mean", mean, METH_VARARGS, mean_doc},
    {"scale", scale, METH_VARARGS, scale_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "kiln's optional native CPU kernels (see runtime/kernels/cpu/native.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    const char *isa = "baseline";
#ifdef KILN_X86_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        compute_planes = compute_planes_avx2;
        prepare_all = prepare_all_avx2;
        gelu_rows = gelu_rows_avx2;
        layer_norm_rows = layer_norm_rows_avx2;
        softmax_rows = softmax_rows_avx2;
        ew_run = ew_run_avx2;
        act_rows = act_rows_avx2;
        mean_rows = mean_rows_avx2;
        scale_rows = scale_rows_avx2;
        im2col_rows = im2col_rows_avx2;
        gemm_out_rows = gemm_out_rows_avx2;
        wino_input_rows = wino_input_rows_avx2;
        max_pool_rows = max_pool_rows_avx2;
        wino_output_rows = wino_output_rows_avx2;
        isa = "avx2+fma";
    }
#endif
#ifdef KILN_X86_DISPATCH
    has_avx512 = __builtin_cpu_supports("avx512f") != 0;  /* a feature bit mask on some compilers: 0 or 1 here */
    if (has_avx512) gelu_rows = gelu_rows_avx512;
#endif
    pthread_atfork(NULL, NULL, pool_after_fork);
    if (PyModule_AddIntConstant(m, "has_sgemm", has_avx512) < 0 || PyModule_AddStringConstant(m, "isa", isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
