/* kiln compute backends: one table of operations, a CPU reference and a CUDA
 * implementation.  Model code is written once against this interface.
 *
 *   kiln_err err = {0};
 *   kiln_backend *be = kiln_backend_create("cpu", 0, &err);
 *   kiln_tensor x, w, y;
 *   kiln_be_alloc(be, &x, be->act_dtype, 2, (int64_t[]){4, 64});
 *   ...
 *   kiln_be_linear(be, &y, &x, &w, NULL);
 *   if (kiln_be_check(be, &err)) { ...err.msg... }
 *   kiln_backend_destroy(be);
 *
 * Conventions
 * - Every tensor is dense and row-major.  Activations use `be->act_dtype`
 *   (F32 on the CPU, BF16 on CUDA); RoPE tables are always F32.
 * - Compute ops return nothing: a failure (a CUDA error, a shape mismatch that
 *   is a bug in the caller) is recorded as a sticky error in the backend
 *   instance and every later op becomes a no-op until kiln_be_check() reports
 *   and clears it.  So model code checks once per block or forward.
 * - A failure that leaves the device unusable (CUDA's sticky errors: an
 *   illegal address, a launch failure, ...; the process must end to use the
 *   GPU again) marks the backend *lost*: kiln_be_check reports it forever and
 *   kiln_be_lost says so, so a service replica can stop and be restarted.
 * - Cancellation rides on the same: while a cancel hook is set
 *   (kiln_be_set_cancel) every op first asks it, and once it says stop the
 *   op and all later ones are skipped with the sticky error
 *   KILN_ERR_CANCELLED, so a forward ends at the next op, whatever model
 *   runs it.
 * - Output tensors are allocated by the caller.  An op may write its output in
 *   place over an input only where the op says so.
 * - A backend instance belongs to one thread at a time (it owns a stream and
 *   scratch memory); create one per worker thread.
 */
#ifndef KILN_BACKEND_H
#define KILN_BACKEND_H

#include <stdint.h>

#include "../common/error.h"
#include "../common/tensor.h"

typedef struct kiln_backend kiln_backend;
typedef struct kiln_graph kiln_graph; /* a recorded op sequence, see graph_begin */

typedef enum kiln_rope_mode {
    KILN_ROPE_INTERLEAVED, /* pairs (x[2i], x[2i+1]): FLUX.2 and Z-Image DiTs */
    KILN_ROPE_HALF,        /* pairs (x[i], x[i+d/2]): Qwen3 "rotate_half" */
} kiln_rope_mode;

typedef struct kiln_attn_opts {
    float scale;          /* softmax scale, usually 1/sqrt(head_dim) */
    int causal;           /* query i sees key j only when j <= i */
    const int *key_len;   /* host array [B] or NULL: keys j >= key_len[b] are masked */
} kiln_attn_opts;

typedef struct kiln_backend_ops {
    /* --- memory ----------------------------------------------------------
     * alloc: a tensor in backend memory, zero-filled on the CPU, poisoned or
     * uninitialised elsewhere.  Returns KILN_ERR_NOMEM / KILN_ERR_DEVICE.
     * free: accepts a zeroed tensor.  upload: host buffer of `host_dtype`
     * (F32, BF16, F16 or F64) converted into dst's dtype; numel must match.
     * download: src converted to f32 into a host buffer of numel floats.
     * download_bytes: src's bytes as they are (any dtype, nbytes(src)) into
     * a host buffer of that size; waits for them like download.  CUDA
     * copies them into page-locked staging memory the instance keeps
     * (allocated on first use, grown to the largest download, released
     * with the backend; the instance's thread only, like every op), then
     * into `host`: the device-to-host copy runs at full bus speed without
     * the caller pinning its buffer.
     * copy: same numel; where the dtypes differ (F32 and BF16 activations)
     * each value is converted, rounding to nearest even. */
    kiln_status (*alloc)(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                         const int64_t *shape);
    void (*free)(kiln_backend *be, kiln_tensor *t);
    void (*upload)(kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype host_dtype);
    void (*download)(kiln_backend *be, const kiln_tensor *src, float *host);
    void (*download_bytes)(kiln_backend *be, const kiln_tensor *src, void *host);
    void (*copy)(kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src);
    void (*sync)(kiln_backend *be);

    /* --- dense layers ----------------------------------------------------
     * linear: y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]); x (.., K),
     * w (N, K) as checkpoints store it, bias (N) or NULL, y (.., N).
     * With an F8E4M3 weight (the FP8 mode, docs/PERFORMANCE.md; N and K
     * multiples of 16, common/fp8.h kiln_f8_linear_ok) x is quantised
     * first, each batch entry alone (x's first dimension when it has 3 or
     * more, else the whole of x) as quantize_fp8 does it, so a row's
     * result never depends on the rest of its batch; then y = (x8 . w8^T)
     * * sx * sw (+ bias) with the products summed in fp32 and y rounded to
     * its dtype (CUDA: a bias must then be BF16, what cuBLASLt's FP8
     * epilogue takes).  The quantised x lives in backend scratch memory (CUDA:
     * its scratch buffer, whose growth makes recorded graphs stale as any
     * op's does); nothing waits for the device, so it records in graphs.
     * quantize_fp8: y (F8E4M3, numel of x) = x quantised per tensor: s =
     * amax|x| / 448 (1 when amax is 0; NaNs are not counted), codes =
     * e4m3(x / s) rounded as common/fp8.h does, s stored with the codes.
     * The scale is computed and kept on the device (no host round trip,
     * so it records in graphs too).  Download of an F8E4M3 tensor gives
     * the dequantised values e4m3(code) * s. */
    void (*linear)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                   const kiln_tensor *bias);
    void (*quantize_fp8)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

    /* --- normalisation ---------------------------------------------------
     * rms_norm: groups of G = numel(w) consecutive elements of x are each
     * normalised, y = x / sqrt(mean(x^2) + eps) * w.  Covers a full hidden
     * vector (G = H) and per-head norms (G = head_dim).  y may alias x.
     * layer_norm_mod: x (B, S, D); y = LN(x) * (1 + scale[b]) + shift[b] with
     * LN over D without affine parameters; shift/scale (B, D), either may be
     * NULL (then 0).  y may alias x.
     * group_norm: x (B, H, W, C), channels last (the VAE's layout: what
     * tensor-core convolutions read, so none of them transposes); groups of
     * C/groups consecutive channels; per-channel weight and bias (C);
     * optional SiLU after.  y may alias x. */
    void (*rms_norm)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                     float eps);
    void (*layer_norm_mod)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                           const kiln_tensor *shift, const kiln_tensor *scale, float eps);
    void (*group_norm)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                       const kiln_tensor *b, int groups, float eps, int silu);
    /* group_norm in pieces, for an image handled in bands of rows whose
     * statistics must still be those of the whole image (models/vae_band.c):
     * group_norm_stats: stats (B, groups, 2) F32 holds each group's (mean,
     * M2 = sum of squared deviations) over `count_before` elements; the
     * elements of x (B, h, W, C) (a band) are merged in (Chan et al.'s
     * parallel update, fp32 storage, wider arithmetic inside), so it then
     * holds them over count_before + C/groups * h * W.  count_before 0
     * starts afresh (stats' old contents ignored).  Deterministic: the same
     * inputs give the same bits.
     * group_norm_apply: y = (x - mean) * inv * w + b (optional SiLU) for a
     * band x (B, h, W, C), with mean = stats mean and inv = 1 / sqrt(M2 /
     * count + eps): the arithmetic of group_norm once the statistics are
     * known, count being the elements per group of the whole image.  y may
     * alias x. */
    void (*group_norm_stats)(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x,
                             int groups, int64_t count_before);
    void (*group_norm_apply)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                             const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                             int64_t count, int groups, float eps, int silu);

    /* --- attention -------------------------------------------------------
     * rope: x (B, S, H, d) rotated in place; cos, sin (S, d) F32 tables that
     * hold one value per element (for INTERLEAVED, cos[2i] == cos[2i+1]; for
     * HALF, cos[i] == cos[i + d/2]).
     * attention: q (B, Sq, Hq, d), k and v (B, Sk, Hkv, d) with Hq a multiple
     * of Hkv (query head h uses kv head h / (Hq/Hkv)), o (B, Sq, Hq, d);
     * softmax in f32.  With `causal`, query i sees keys j <= i + (Sk - Sq). */
    void (*rope)(kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos, const kiln_tensor *sin,
                 kiln_rope_mode mode);
    void (*attention)(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q, const kiln_tensor *k,
                      const kiln_tensor *v, const kiln_attn_opts *opts);

    /* --- elementwise -----------------------------------------------------
     * silu: y = x * sigmoid(x); y may alias x.
     * tanh: y = tanh(x); y may alias x (Z-Image's adaLN gates).
     * swiglu: x (R, 2F) -> y (R, F): y = silu(x[:, :F]) * x[:, F:].
     * add: y = a + b (same shape); y may alias a or b.
     * gated_add: x (B, S, D) += gate[b] * y with gate (B, D), or plain
     * x += y when gate is NULL.
     * euler_step: x += dt * v (flow-matching update, same shape).  On bf16
     * backends this follows diffusers' rounding (pipeline.md section 7).
     * cfg: out = neg + g * (pos - neg); out may alias pos or neg. */
    void (*silu)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
    void (*tanh)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
    void (*swiglu)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);
    void (*add)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b);
    void (*gated_add)(kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                      const kiln_tensor *y);
    void (*euler_step)(kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt);
    void (*cfg)(kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos, const kiln_tensor *neg,
                float g);

    /* --- data movement ---------------------------------------------------
     * copy_rows: dst (B, Sd, D), src (B, Ss, D): for every b, rows
     * [src_row0, src_row0 + n) of src go to rows [dst_row0, ...) of dst.
     * copy_cols: 2-D views (rows = numel / last dim) with equal row counts:
     * dst[r, dst_col0 + j] = src[r, src_col0 + j] for j < n.
     * transpose: x (B, M, N) -> y (B, N, M). */
    void (*copy_rows)(kiln_backend *be, kiln_tensor *dst, int64_t dst_row0, const kiln_tensor *src,
                      int64_t src_row0, int64_t n);
    void (*copy_cols)(kiln_backend *be, kiln_tensor *dst, int64_t dst_col0, const kiln_tensor *src,
                      int64_t src_col0, int64_t n);
    void (*transpose)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

    /* --- convolution (VAE) -----------------------------------------------
     * Channels last, as group_norm: the VAE runs in NHWC end to end.
     * conv2d: x (B, H, W, Cin), w (Cout, kh, kw, Cin), bias (Cout) or NULL,
     * zero padding pad[4] = {top, left, bottom, right}, y (B, Ho, Wo, Cout)
     * with Ho = (H + top + bottom - kh) / stride + 1; residual (the shape
     * of y, not y itself) or NULL is added last: y = (conv + bias) +
     * residual, rounded where the separate adds round (a ResnetBlock2D's
     * shortcut joins its second convolution's output in the same pass).
     * upsample_nearest2x: x (B, H, W, C) -> y (B, 2H, 2W, C). */
    void (*conv2d)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                   const kiln_tensor *bias, const kiln_tensor *residual, int stride,
                   const int pad[4]);
    void (*upsample_nearest2x)(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x);

    /* --- image output ----------------------------------------------------
     * to_rgb8: the decoder output x (B, 3, H, W), F32 or BF16, as 8-bit
     * RGB rgb (B, H, W, 3) U8 (channels interleaved, as kiln_image holds
     * them): each value by kernels/rgb8.h's rule in x's dtype (diffusers'
     * clamp and rounding), so every backend gives the same bytes for the
     * same values (models/latents.c kiln_latents_to_rgb8 on the host too). */
    void (*to_rgb8)(kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x);

    /* --- fused transformer ops (one pass where the ops above take several)
     * qkv_split: P (B, S, Dq + 2 Dkv) the fused q|k|v projection -> q
     * (B, S, Dq), k and v (B, S, Dkv), with Dq = Hq * d and Dkv = Hkv * d
     * (the DiTs: Dq = Dkv; Qwen3's grouped-query attention: Dq = 4 Dkv;
     * the widths come from q's and k's element counts); q and k get the
     * per-head RMSNorm of norm_q / norm_k (d elements; NULL skips it) and
     * then RoPE (cos, sin (S, d) F32 as for rope; NULL skips it); v is
     * copied.  The same values and roundings as copy_cols + rms_norm + rope.
     * swiglu_cols: swiglu into columns [dst_col0, dst_col0 + F) of y (R, C),
     * x (R, 2F): the other columns of y are left alone. */
    void (*qkv_split)(kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                      const kiln_tensor *P, const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                      float eps, const kiln_tensor *cos, const kiln_tensor *sin,
                      kiln_rope_mode mode);
    void (*swiglu_cols)(kiln_backend *be, kiln_tensor *y, int64_t dst_col0, const kiln_tensor *x);

    /* --- recorded op sequences (optional: NULL on backends without them,
     * such as the CPU) -----------------------------------------------------
     * graph_begin: the ops that follow are recorded instead of run (a CUDA
     * stream capture) until graph_end.  Meanwhile nothing may allocate,
     * upload, download or sync; an op that does fails the recording.
     * graph_end: the recording as a graph the caller owns, or NULL with the
     * sticky error set when some op could not be recorded (nothing ran).
     * graph_launch: runs the recorded ops again, on the same memory with
     * whatever it holds now.  Returns 0, running nothing, when memory the
     * recording used has been released since (the backend's scratch grew):
     * destroy the graph and record again.  1 when launched (or a launch
     * error became the sticky error).
     * graph_destroy: accepts NULL. */
    void (*graph_begin)(kiln_backend *be);
    kiln_graph *(*graph_end)(kiln_backend *be);
    int (*graph_launch)(kiln_backend *be, kiln_graph *g);
    void (*graph_destroy)(kiln_backend *be, kiln_graph *g);

    /* mem_info: bytes free and in total on the backend's device, as the
     * driver reports them for the whole device (every process's use counts);
     * NULL where the backend has no device memory (the CPU). */
    kiln_status (*mem_info)(kiln_backend *be, size_t *free_bytes, size_t *total_bytes);

    /* --- device time (optional: NULL where the backend has no device
     * clock, such as the CPU, whose wall times are its compute times) ------
     * timer_mark: records a point in the backend's stream after the ops
     * queued so far (CUDA: cudaEventRecord of one of the instance's pooled
     * events; nothing waits) and returns its index, counting from 0 since
     * the last timer_reset; -1 when the KILN_BE_TIMER_MARKS are taken,
     * while ops are being recorded (graph_begin), or when recording the
     * mark failed.  Device time is worth no failure: no sticky error.
     * timer_ms: the device time from mark a to mark b in milliseconds
     * (the span of the device's timeline between them, idle gaps
     * included), waiting for mark b to be reached (so call it once the
     * work is done or its results are needed anyway); -1 when unknown.
     * timer_reset: forgets the marks (their events are reused). */
    int (*timer_mark)(kiln_backend *be);
    double (*timer_ms)(kiln_backend *be, int a, int b);
    void (*timer_reset)(kiln_backend *be);

    void (*destroy)(kiln_backend *be);
} kiln_backend_ops;

struct kiln_backend {
    const kiln_backend_ops *ops;
    const char *name;     /* "cpu" or "cuda" */
    kiln_dtype act_dtype; /* dtype of activations and weights (but the FP8 mode's F8E4M3 ones) */
    int device;           /* GPU index, 0 for the CPU */
    kiln_err error;       /* sticky error, see kiln_be_check */
    int lost;             /* set once (kiln_be_lose); read with kiln_be_lost */
    int (*cancel)(void *user); /* see kiln_be_set_cancel */
    void *cancel_user;
    void *impl;
};

/* Creates a backend by name ("cpu", or "cuda" when built with CUDA) on the
 * given device index.  Returns NULL with err set on failure (unknown name,
 * no such device).  The caller owns the result. */
kiln_backend *kiln_backend_create(const char *name, int device, kiln_err *err);
void kiln_backend_destroy(kiln_backend *be);

/* Device memory in use on the backend's device (total - free, every
 * process's share included) and its size.  KILN_ERR_UNSUPPORTED with err
 * set on a backend without device memory (the CPU).  For logs and
 * benchmarks; thread-safe for the CUDA backend (a driver query). */
kiln_status kiln_backend_mem_info(kiln_backend *be, size_t *used_bytes, size_t *total_bytes,
                                  kiln_err *err);

/* Device time between points of a stage's work (ops.timer_*): marks per
 * timer_reset, enough for a setup mark, one per denoising step (up to the
 * service's 200) and an end. */
#define KILN_BE_TIMER_MARKS 256

/* A mark in the backend's stream (see ops.timer_mark); -1 where the
 * backend has no device clock or after a sticky error. */
static inline int kiln_be_timer_mark(kiln_backend *be)
{
    return be->ops->timer_mark && !be->error.code ? be->ops->timer_mark(be) : -1;
}

/* Device milliseconds from mark a to mark b (waits for b); -1 when either
 * mark is -1 or the time is unknown. */
static inline double kiln_be_timer_ms(kiln_backend *be, int a, int b)
{
    return be->ops->timer_ms && a >= 0 && b >= 0 ? be->ops->timer_ms(be, a, b) : -1;
}

static inline void kiln_be_timer_reset(kiln_backend *be)
{
    if (be->ops->timer_reset)
        be->ops->timer_reset(be);
}

/* Reports the sticky error (copying it into err) and clears it, unless the
 * backend is lost.  Returns KILN_OK when every op since the last check
 * succeeded. */
kiln_status kiln_be_check(kiln_backend *be, kiln_err *err);

/* Records a sticky error from inside an implementation or a model; the first
 * one wins until kiln_be_check() clears it. */
void kiln_be_fail(kiln_backend *be, kiln_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Marks the backend lost: its device cannot be used again by this process.
 * The error (KILN_ERR_DEVICE, "device lost: " and the message) replaces any
 * other and stays: every later op is a no-op and every kiln_be_check
 * reports it.  The backend's thread only, like every op. */
void kiln_be_lose(kiln_backend *be, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* 1 once the backend is lost.  Any thread. */
int kiln_be_lost(const kiln_backend *be);

/* Thin wrappers so model code reads as a sequence of ops.  Each is a no-op
 * while the backend holds a sticky error. */
kiln_status kiln_be_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                          const int64_t *shape);
void kiln_be_free(kiln_backend *be, kiln_tensor *t);
/* Allocates a tensor of be->act_dtype with the given shape and uploads host
 * data of host_dtype into it (used for weights and inputs). */
kiln_status kiln_be_from_host(kiln_backend *be, kiln_tensor *t, int ndim, const int64_t *shape,
                              const void *host, kiln_dtype host_dtype);

/* Sets (or with NULL, clears) the hook every op asks before it runs: a
 * non-zero answer skips it and records KILN_ERR_CANCELLED as the sticky
 * error.  The hook must be cheap (it runs per op) and may be called from
 * the backend's thread only; code recording a graph clears it meanwhile,
 * so a recording is never cut short.  kiln_be_sync still waits for queued
 * work after a cancel. */
void kiln_be_set_cancel(kiln_backend *be, int (*cancel)(void *user), void *user);

/* 1 when an op must not run: a sticky error, or the cancel hook says stop. */
static inline int kiln_be_halted(kiln_backend *be)
{
    if (be->error.code)
        return 1;
    if (be->cancel && be->cancel(be->cancel_user)) {
        kiln_be_fail(be, KILN_ERR_CANCELLED, "cancelled");
        return 1;
    }
    return 0;
}

#define KILN_BE_WRAP(name, params, args) \
    static inline void kiln_be_##name params { if (!kiln_be_halted(be)) be->ops->name args; }

KILN_BE_WRAP(upload, (kiln_backend *be, kiln_tensor *dst, const void *host, kiln_dtype hd),
             (be, dst, host, hd))
KILN_BE_WRAP(download, (kiln_backend *be, const kiln_tensor *src, float *host), (be, src, host))
KILN_BE_WRAP(download_bytes, (kiln_backend *be, const kiln_tensor *src, void *host),
             (be, src, host))
KILN_BE_WRAP(copy, (kiln_backend *be, kiln_tensor *dst, const kiln_tensor *src), (be, dst, src))
static inline void kiln_be_sync(kiln_backend *be)
{
    if (!be->error.code || be->error.code == KILN_ERR_CANCELLED)
        be->ops->sync(be);
}
KILN_BE_WRAP(linear, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                      const kiln_tensor *bias), (be, y, x, w, bias))
KILN_BE_WRAP(quantize_fp8, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x), (be, y, x))
KILN_BE_WRAP(rms_norm, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                        const kiln_tensor *w, float eps), (be, y, x, w, eps))
KILN_BE_WRAP(layer_norm_mod, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                              const kiln_tensor *shift, const kiln_tensor *scale, float eps),
             (be, y, x, shift, scale, eps))
KILN_BE_WRAP(group_norm, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                          const kiln_tensor *w, const kiln_tensor *b, int groups, float eps,
                          int silu), (be, y, x, w, b, groups, eps, silu))
KILN_BE_WRAP(group_norm_stats, (kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x,
                                int groups, int64_t count_before),
             (be, stats, x, groups, count_before))
KILN_BE_WRAP(group_norm_apply, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                                const kiln_tensor *w, const kiln_tensor *b,
                                const kiln_tensor *stats, int64_t count, int groups, float eps,
                                int silu), (be, y, x, w, b, stats, count, groups, eps, silu))
KILN_BE_WRAP(rope, (kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos,
                    const kiln_tensor *sin, kiln_rope_mode mode), (be, x, cos, sin, mode))
KILN_BE_WRAP(attention, (kiln_backend *be, kiln_tensor *o, const kiln_tensor *q,
                         const kiln_tensor *k, const kiln_tensor *v, const kiln_attn_opts *opts),
             (be, o, q, k, v, opts))
KILN_BE_WRAP(silu, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x), (be, y, x))
KILN_BE_WRAP(tanh, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x), (be, y, x))
KILN_BE_WRAP(swiglu, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x), (be, y, x))
KILN_BE_WRAP(add, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *a, const kiln_tensor *b),
             (be, y, a, b))
KILN_BE_WRAP(gated_add, (kiln_backend *be, kiln_tensor *x, const kiln_tensor *gate,
                         const kiln_tensor *y), (be, x, gate, y))
KILN_BE_WRAP(euler_step, (kiln_backend *be, kiln_tensor *x, const kiln_tensor *v, float dt),
             (be, x, v, dt))
KILN_BE_WRAP(cfg, (kiln_backend *be, kiln_tensor *out, const kiln_tensor *pos,
                   const kiln_tensor *neg, float g), (be, out, pos, neg, g))
KILN_BE_WRAP(copy_rows, (kiln_backend *be, kiln_tensor *dst, int64_t dst_row0,
                         const kiln_tensor *src, int64_t src_row0, int64_t n),
             (be, dst, dst_row0, src, src_row0, n))
KILN_BE_WRAP(copy_cols, (kiln_backend *be, kiln_tensor *dst, int64_t dst_col0,
                         const kiln_tensor *src, int64_t src_col0, int64_t n),
             (be, dst, dst_col0, src, src_col0, n))
KILN_BE_WRAP(transpose, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x), (be, y, x))
KILN_BE_WRAP(conv2d, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                      const kiln_tensor *w, const kiln_tensor *bias, const kiln_tensor *residual,
                      int stride, const int pad[4]),
             (be, y, x, w, bias, residual, stride, pad))
KILN_BE_WRAP(upsample_nearest2x, (kiln_backend *be, kiln_tensor *y, const kiln_tensor *x),
             (be, y, x))
KILN_BE_WRAP(to_rgb8, (kiln_backend *be, kiln_tensor *rgb, const kiln_tensor *x), (be, rgb, x))
KILN_BE_WRAP(qkv_split, (kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                         const kiln_tensor *P, const kiln_tensor *norm_q,
                         const kiln_tensor *norm_k, float eps, const kiln_tensor *cos,
                         const kiln_tensor *sin, kiln_rope_mode mode),
             (be, q, k, v, P, norm_q, norm_k, eps, cos, sin, mode))
KILN_BE_WRAP(swiglu_cols, (kiln_backend *be, kiln_tensor *y, int64_t dst_col0,
                           const kiln_tensor *x), (be, y, dst_col0, x))
#undef KILN_BE_WRAP

/* --- scratch arena ---------------------------------------------------------
 * Activations of a forward pass come from an arena: a chain of backend
 * blocks handed out by bump allocation and released all at once with
 * kiln_arena_reset().  After the first forward of a shape the arena holds
 * one block big enough for it, so steady-state steps allocate nothing. */
typedef struct kiln_arena kiln_arena;

kiln_arena *kiln_arena_create(kiln_backend *be, size_t initial_bytes, kiln_err *err);
void kiln_arena_destroy(kiln_arena *a);
/* Shapes `t` and points it into the arena.  On failure records a sticky
 * error in the backend and returns KILN_ERR_NOMEM (t->data is then NULL). */
kiln_status kiln_arena_tensor(kiln_arena *a, kiln_tensor *t, kiln_dtype dt, int ndim,
                              const int64_t *shape);
/* Releases every tensor handed out since the last reset. */
void kiln_arena_reset(kiln_arena *a);
/* Makes the arena one block of at least `bytes`, so that a pass whose
 * needs are known up front never grows it block by block (growth doubles,
 * and the old blocks stay held until the next reset).  Call right after
 * kiln_arena_reset: a smaller block is freed before the new one is
 * allocated, so both are never held together; a big enough one is kept.
 * KILN_ERR_NOMEM with the sticky error set on failure; KILN_ERR_INTERNAL
 * when tensors are still handed out. */
kiln_status kiln_arena_reserve(kiln_arena *a, size_t bytes);
/* A mark of what has been handed out so far, and the release of every
 * tensor handed out after it (a stack discipline inside one pass).  The
 * rewind releases nothing when the arena grew a block since the mark (the
 * memory then stays taken until the reset, which replaces the blocks by one
 * that fits the most handed out at once). */
size_t kiln_arena_mark(const kiln_arena *a);
void kiln_arena_rewind(kiln_arena *a, size_t mark);
/* Bytes of backend memory the arena holds (for metrics and tests). */
size_t kiln_arena_capacity(const kiln_arena *a);
/* Changes whenever the arena's memory is replaced (a reset after it grew):
 * a recorded graph that used the arena is valid while its epoch is. */
uint64_t kiln_arena_epoch(const kiln_arena *a);

#endif
