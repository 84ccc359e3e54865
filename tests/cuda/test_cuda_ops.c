/* Every CUDA backend op against the CPU reference on the same inputs.
 *
 * Inputs are fresh random values each run (seed from the clock, printed;
 * KILN_TEST_SEED=N repeats a run), rounded to bf16 first so that both
 * backends see identical numbers.  Outputs on the GPU are poisoned with NaN
 * before each launch, so an element the kernel never wrote shows up as an
 * infinite error.  The score is ||gpu - cpu|| / ||cpu||; bf16 math must stay
 * under 1e-2, pure data movement must be exact.  Prints one table row per
 * case and exits non-zero on any failure.
 *
 * Without a CUDA device (CI) the test is skipped (exit 77), unless
 * KILN_REQUIRE_GPU=1 says a device must be there (tools/gpu/check.sh). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/backend.h"
#include "tests/cuda/gpu_skip.h"
#include "tests/test.h"

#define TOL_BF16 1e-2
#define TOL_EXACT 0.0

static kiln_backend *cpu, *gpu;
static uint64_t rng;
static int cases, failed;

static uint64_t next_u64(void)
{
    /* splitmix64: tiny, and good enough to spread test inputs */
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float frand(void) { return (float)((next_u64() >> 40) / 16777216.0 * 2.0 - 1.0); }

static int64_t numel_of(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= shape[i];
    return n;
}

static float *xmalloc_f(int64_t n)
{
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    return p;
}

/* The same tensor on both backends. */
typedef struct dual {
    kiln_tensor c, g;
} dual;

static void dual_upload(dual *d, const float *host)
{
    kiln_be_upload(cpu, &d->c, host, KILN_F32);
    kiln_be_upload(gpu, &d->g, host, KILN_F32);
}

/* Random bf16-representable values in [-scale, scale); gdt is the GPU dtype. */
static void dual_in(dual *d, kiln_dtype gdt, int ndim, const int64_t *shape, float scale)
{
    int64_t n = numel_of(ndim, shape);
    float *h = xmalloc_f(n);
    for (int64_t i = 0; i < n; i++)
        h[i] = kiln_round_bf16(scale * frand());
    kiln_be_alloc(cpu, &d->c, KILN_F32, ndim, shape);
    kiln_be_alloc(gpu, &d->g, gdt, ndim, shape);
    dual_upload(d, h);
    free(h);
}

static void dual_poison(dual *d)
{
    int64_t n = kiln_tensor_numel(&d->g);
    float *h = xmalloc_f(n);
    for (int64_t i = 0; i < n; i++)
        h[i] = NAN;
    kiln_be_upload(gpu, &d->g, h, KILN_F32);
    free(h);
}

static void dual_out(dual *d, kiln_dtype gdt, int ndim, const int64_t *shape)
{
    kiln_be_alloc(cpu, &d->c, KILN_F32, ndim, shape);
    kiln_be_alloc(gpu, &d->g, gdt, ndim, shape);
    dual_poison(d);
}

static void dual_free(dual *d)
{
    kiln_be_free(cpu, &d->c);
    kiln_be_free(gpu, &d->g);
}

/* Downloads both sides of `out`, prints the row and counts the case;
 * `extra_ok` is 0 when a check of the caller's own already failed. */
static void finish_ex(const char *op, const char *shape, dual *out, double tol, int extra_ok)
{
    kiln_err ce = {0}, ge = {0};
    kiln_be_sync(gpu);
    kiln_status cs = kiln_be_check(cpu, &ce), gs = kiln_be_check(gpu, &ge);
    double err = INFINITY;
    if (!cs && !gs) {
        int64_t n = kiln_tensor_numel(&out->c);
        float *a = xmalloc_f(n), *b = xmalloc_f(n);
        kiln_be_download(gpu, &out->g, a);
        kiln_be_download(cpu, &out->c, b);
        gs = kiln_be_check(gpu, &ge);
        if (!gs)
            err = test_rel_err(a, b, (size_t)n);
        free(a);
        free(b);
    }
    int pass = extra_ok && !cs && !gs && (tol > 0 ? err < tol : err == 0);
    cases++;
    failed += !pass;
    printf("%-18s | %-34s | %9.2e | %s\n", op, shape, err, pass ? "pass" : "FAIL");
    if (cs)
        printf("    cpu error: %s\n", ce.msg);
    if (gs)
        printf("    cuda error: %s\n", ge.msg);
    fflush(stdout);
}

static void finish(const char *op, const char *shape, dual *out, double tol)
{
    finish_ex(op, shape, out, tol, 1);
}

/* --- dense layers ---------------------------------------------------------- */

static void case_linear(int64_t b, int64_t s, int64_t k, int64_t n, int bias, kiln_dtype ydt)
{
    dual x, w, bi, y;
    dual_in(&x, KILN_BF16, 3, (int64_t[]){b, s, k}, 1.0f);
    dual_in(&w, KILN_BF16, 2, (int64_t[]){n, k}, 1.0f / sqrtf((float)k));
    if (bias)
        dual_in(&bi, ydt, 1, (int64_t[]){n}, 0.5f);
    dual_out(&y, ydt, 3, (int64_t[]){b, s, n});
    kiln_be_linear(cpu, &y.c, &x.c, &w.c, bias ? &bi.c : NULL);
    kiln_be_linear(gpu, &y.g, &x.g, &w.g, bias ? &bi.g : NULL);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lld K%lld N%lld%s%s", (long long)b, (long long)s,
             (long long)k, (long long)n, bias ? " +bias" : "", ydt == KILN_F32 ? " f32 out" : "");
    finish("linear", desc, &y, TOL_BF16);
    dual_free(&x);
    dual_free(&w);
    if (bias)
        dual_free(&bi);
    dual_free(&y);
}

static void test_linear(void)
{
    case_linear(1, 1, 64, 32, 1, KILN_BF16);
    case_linear(1, 37, 72, 40, 1, KILN_BF16);
    case_linear(2, 65, 256, 200, 0, KILN_BF16);
    case_linear(1, 257, 1024, 96, 1, KILN_BF16);
    case_linear(3, 3, 33, 17, 1, KILN_BF16);
    case_linear(1, 50, 128, 64, 1, KILN_F32);
    /* The same shape again runs through the cached plan. */
    case_linear(1, 37, 72, 40, 1, KILN_BF16);
}

/* --- the FP8 mode (kernels/backend.h linear on F8E4M3, quantize_fp8) ------- */

/* The quantisation is exact: the same codes and scale bits on both sides
 * (compared through download, which dequantises: equal values mean equal
 * codes, up to the sign of zero, and an equal scale).  `zero` makes the
 * input all zeros (scale 1), `outlier` puts one value 300 times larger than
 * the rest at a random place (the amax comes from one block of the
 * reduction). */
static void case_quantize(int64_t rows, int64_t cols, kiln_dtype gdt, int zero, int outlier)
{
    dual x, q;
    int64_t shape[2] = {rows, cols};
    dual_in(&x, gdt, 2, shape, zero ? 0.0f : 3.0f);
    if (outlier) {
        int64_t n = rows * cols;
        float *h = xmalloc_f(n);
        kiln_be_download(cpu, &x.c, h);
        h[next_u64() % (uint64_t)n] = kiln_round_bf16(-900.0f);
        dual_upload(&x, h);
        free(h);
    }
    kiln_be_alloc(cpu, &q.c, KILN_F8E4M3, 2, shape);
    kiln_be_alloc(gpu, &q.g, KILN_F8E4M3, 2, shape);
    kiln_be_quantize_fp8(cpu, &q.c, &x.c);
    kiln_be_quantize_fp8(gpu, &q.g, &x.g);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lld %s%s%s", (long long)rows, (long long)cols,
             gdt == KILN_BF16 ? "BF16" : "F32", zero ? " zeros" : "", outlier ? " outlier" : "");
    finish("quantize_fp8", desc, &q, TOL_EXACT);
    dual_free(&x);
    dual_free(&q);
}

/* The fp8 linear against the CPU reference.  Both sides quantise the same
 * bf16 values to the same codes and scales (case_quantize proves it), and
 * products of two E4M3 values are exact in fp32, so what differs is the
 * order of the fp32 sums (~1e-6 relative at these K; Hopper's FP8 tensor
 * cores also sum in narrower registers between promotions to fp32, ~1e-4)
 * and the rounding of the output: bf16 holds 8 significant bits, at most
 * 2^-9 relative per element, so the relative error stays under ~2e-3; the
 * bar is twice that.  An f32 output has no final rounding: 1e-3.  Anything
 * wrong in the path (a scale, a transposition, an entry's offset) moves
 * results by the quantisation error (~3e-2) or far more. */
#define TOL_FP8_BF16 4e-3
#define TOL_FP8_F32 1e-3

static void case_linear_fp8(int ndim, int64_t b, int64_t s, int64_t k, int64_t n, int bias,
                            kiln_dtype ydt)
{
    dual x, w, w8, bi, y;
    int64_t xs3[3] = {b, s, k}, xs2[2] = {b * s, k}, ys3[3] = {b, s, n}, ys2[2] = {b * s, n};
    dual_in(&x, KILN_BF16, ndim, ndim == 3 ? xs3 : xs2, 1.0f);
    dual_in(&w, KILN_BF16, 2, (int64_t[]){n, k}, 1.0f / sqrtf((float)k));
    if (bias) /* BF16 for either y: what cuBLASLt's FP8 bias epilogue takes */
        dual_in(&bi, KILN_BF16, 1, (int64_t[]){n}, 0.5f);
    if (ndim == 3 && b > 1) { /* entry 1 ten times larger: its own scale */
        float *h = xmalloc_f(b * s * k);
        kiln_be_download(cpu, &x.c, h);
        for (int64_t i = s * k; i < 2 * s * k; i++)
            h[i] *= 8.0f; /* a power of two keeps the values bf16 */
        dual_upload(&x, h);
        free(h);
    }
    kiln_be_alloc(cpu, &w8.c, KILN_F8E4M3, 2, (int64_t[]){n, k});
    kiln_be_alloc(gpu, &w8.g, KILN_F8E4M3, 2, (int64_t[]){n, k});
    kiln_be_quantize_fp8(cpu, &w8.c, &w.c);
    kiln_be_quantize_fp8(gpu, &w8.g, &w.g);
    dual_out(&y, ydt, ndim, ndim == 3 ? ys3 : ys2);
    kiln_be_linear(cpu, &y.c, &x.c, &w8.c, bias ? &bi.c : NULL);
    kiln_be_linear(gpu, &y.g, &x.g, &w8.g, bias ? &bi.g : NULL);
    char desc[96];
    snprintf(desc, sizeof desc, "%s%lldx%lld K%lld N%lld%s%s", ndim == 2 ? "2-D " : "",
             (long long)b, (long long)s, (long long)k, (long long)n, bias ? " +bias" : "",
             ydt == KILN_F32 ? " f32 out" : "");
    finish("linear fp8", desc, &y, ydt == KILN_F32 ? TOL_FP8_F32 : TOL_FP8_BF16);
    dual_free(&x);
    dual_free(&w);
    dual_free(&w8);
    if (bias)
        dual_free(&bi);
    dual_free(&y);
}

static void test_fp8(void)
{
    case_quantize(1, 16, KILN_BF16, 0, 0);
    case_quantize(37, 1001, KILN_BF16, 0, 1);
    case_quantize(512, 3072, KILN_BF16, 0, 1); /* many blocks: the atomic amax */
    case_quantize(7, 33, KILN_F32, 0, 0);
    case_quantize(8, 64, KILN_BF16, 1, 0);
    case_linear_fp8(3, 1, 1, 64, 32, 0, KILN_BF16);
    case_linear_fp8(3, 1, 77, 256, 128, 0, KILN_BF16);
    case_linear_fp8(3, 3, 45, 128, 96, 1, KILN_BF16); /* 3 entries, odd rows, bias */
    case_linear_fp8(2, 2, 40, 128, 64, 0, KILN_BF16); /* 2-D x: one scale */
    case_linear_fp8(3, 2, 33, 64, 48, 0, KILN_F32);
    case_linear_fp8(3, 2, 33, 64, 48, 1, KILN_F32); /* f32 D with the BF16 bias epilogue */
    case_linear_fp8(3, 1, 300, 1024, 512, 0, KILN_BF16);
    /* The same shape again runs through the cached plan. */
    case_linear_fp8(3, 1, 77, 256, 128, 0, KILN_BF16);
}

/* --- normalisation --------------------------------------------------------- */

static void case_rms(int ndim, const int64_t *shape, int64_t g, int inplace)
{
    dual x, w, y;
    dual_in(&x, KILN_BF16, ndim, shape, 2.0f);
    dual_in(&w, KILN_BF16, 1, (int64_t[]){g}, 1.5f);
    if (!inplace)
        dual_out(&y, KILN_BF16, ndim, shape);
    dual *out = inplace ? &x : &y;
    kiln_be_rms_norm(cpu, &out->c, &x.c, &w.c, 1e-6f);
    kiln_be_rms_norm(gpu, &out->g, &x.g, &w.g, 1e-6f);
    char desc[96];
    snprintf(desc, sizeof desc, "n=%lld G=%lld%s", (long long)numel_of(ndim, shape), (long long)g,
             inplace ? " in place" : "");
    finish("rms_norm", desc, out, TOL_BF16);
    dual_free(&x);
    dual_free(&w);
    if (!inplace)
        dual_free(&y);
}

static void test_rms_norm(void)
{
    case_rms(2, (int64_t[]){4, 96}, 96, 0);
    case_rms(4, (int64_t[]){2, 7, 3, 64}, 64, 0);
    case_rms(2, (int64_t[]){5, 3000}, 3000, 0);
    case_rms(4, (int64_t[]){1, 33, 4, 128}, 128, 1);
    /* whole hidden vectors, 16-byte path: Qwen3-4B's and Z-Image's widths */
    case_rms(3, (int64_t[]){1, 37, 2560}, 2560, 0);
    case_rms(3, (int64_t[]){2, 9, 3840}, 3840, 1);
}

static void case_ln(int64_t b, int64_t s, int64_t d, int shift, int scale, int inplace)
{
    dual x, sh, sc, y;
    int64_t shape[3] = {b, s, d};
    dual_in(&x, KILN_BF16, 3, shape, 3.0f);
    /* A non-zero mean checks that the variance is taken around it. */
    float *h = xmalloc_f(b * s * d);
    kiln_be_download(cpu, &x.c, h);
    for (int64_t i = 0; i < b * s * d; i++)
        h[i] = kiln_round_bf16(h[i] + 4.0f);
    dual_upload(&x, h);
    free(h);
    if (shift)
        dual_in(&sh, KILN_BF16, 2, (int64_t[]){b, d}, 1.0f);
    if (scale)
        dual_in(&sc, KILN_BF16, 2, (int64_t[]){b, d}, 1.0f);
    if (!inplace)
        dual_out(&y, KILN_BF16, 3, shape);
    dual *out = inplace ? &x : &y;
    kiln_be_layer_norm_mod(cpu, &out->c, &x.c, shift ? &sh.c : NULL, scale ? &sc.c : NULL, 1e-6f);
    kiln_be_layer_norm_mod(gpu, &out->g, &x.g, shift ? &sh.g : NULL, scale ? &sc.g : NULL, 1e-6f);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lldx%lld%s%s%s", (long long)b, (long long)s, (long long)d,
             shift ? " shift" : "", scale ? " scale" : "", inplace ? " in place" : "");
    finish("layer_norm_mod", desc, out, TOL_BF16);
    dual_free(&x);
    if (shift)
        dual_free(&sh);
    if (scale)
        dual_free(&sc);
    if (!inplace)
        dual_free(&y);
}

static void test_layer_norm_mod(void)
{
    case_ln(2, 33, 96, 1, 1, 0);
    case_ln(1, 100, 3072, 1, 1, 0);
    case_ln(2, 5, 40, 0, 1, 0);
    case_ln(1, 9, 200, 0, 0, 0);
    case_ln(2, 17, 64, 1, 1, 1);
    case_ln(2, 7, 36, 1, 1, 0); /* d % 8 != 0: the element path */
}

static void case_gn(int64_t b, int64_t h, int64_t w, int64_t c, int groups, int silu, int inplace)
{
    dual x, wt, bs, y;
    int64_t shape[4] = {b, h, w, c};
    dual_in(&x, KILN_BF16, 4, shape, 2.0f);
    dual_in(&wt, KILN_BF16, 1, (int64_t[]){c}, 1.5f);
    dual_in(&bs, KILN_BF16, 1, (int64_t[]){c}, 0.5f);
    if (!inplace)
        dual_out(&y, KILN_BF16, 4, shape);
    dual *out = inplace ? &x : &y;
    kiln_be_group_norm(cpu, &out->c, &x.c, &wt.c, &bs.c, groups, 1e-6f, silu);
    kiln_be_group_norm(gpu, &out->g, &x.g, &wt.g, &bs.g, groups, 1e-6f, silu);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lldx%lldx%lld g%d%s%s", (long long)b, (long long)h,
             (long long)w, (long long)c, groups, silu ? " silu" : "", inplace ? " in place" : "");
    finish("group_norm", desc, out, TOL_BF16);
    dual_free(&x);
    dual_free(&wt);
    dual_free(&bs);
    if (!inplace)
        dual_free(&y);
}

/* (B, H, W, C), channels last.  C % 8 == 0 takes 16-byte vectors, of one
 * group (C / groups = 8, 16, 64) or of several (4, 2, 1; 3: groups
 * straddle vectors); C % 8 != 0 the element path. */
static void test_group_norm(void)
{
    case_gn(1, 9, 7, 64, 32, 1, 0);
    case_gn(2, 16, 16, 96, 32, 0, 0);
    case_gn(1, 96, 80, 32, 32, 1, 0); /* 7680 elements a group: split over blocks */
    case_gn(1, 20, 20, 128, 32, 1, 1);
    case_gn(2, 64, 64, 128, 32, 1, 0); /* many chunks a row */
    case_gn(1, 12, 10, 256, 32, 1, 0); /* 8 channels a group: one vector */
    case_gn(1, 24, 24, 512, 32, 1, 0); /* 16 channels a group, as the VAE's widest */
    case_gn(1, 6, 5, 2048, 32, 0, 0);  /* the widest C: a block takes one pixel at a time */
    case_gn(1, 6, 5, 36, 4, 0, 0);     /* C % 8 != 0: the element path */
    case_gn(2, 11, 13, 20, 5, 1, 1);   /* the element path in place */
}

/* (B, H, W * C) view for copy_rows: a band is whole rows of pixels. */
static kiln_tensor rows_view(const kiln_tensor *t, int64_t rows)
{
    kiln_tensor v = *t;
    kiln_tensor_set_shape(&v, t->dtype, 3, (int64_t[]){t->shape[0], rows,
                                                      t->shape[2] * t->shape[3]});
    return v;
}

/* GroupNorm over bands of rows on one backend: group_norm_stats band by
 * band, then group_norm_apply to each band (models/vae_band.c's use). */
static void gn_banded(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, kiln_tensor *band,
                      kiln_tensor *st, const kiln_tensor *wt, const kiln_tensor *bs, int groups,
                      int silu, const int64_t *rows, int nb)
{
    int64_t B = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3], cpg = C / groups;
    kiln_tensor x3 = rows_view(x, H), y3 = rows_view(y, H);
    for (int pass = 0; pass < 2; pass++) {
        int64_t r0 = 0;
        for (int i = 0; i < nb; r0 += rows[i++]) {
            kiln_tensor b4 = *band, b3;
            kiln_tensor_set_shape(&b4, band->dtype, 4, (int64_t[]){B, rows[i], W, C});
            b3 = rows_view(&b4, rows[i]);
            kiln_be_copy_rows(be, &b3, 0, &x3, r0, rows[i]);
            if (!pass) {
                kiln_be_group_norm_stats(be, st, &b4, groups, cpg * r0 * W);
                continue;
            }
            kiln_be_group_norm_apply(be, &b4, &b4, wt, bs, st, cpg * H * W, groups, 1e-6f, silu);
            kiln_be_copy_rows(be, &y3, r0, &b3, 0, rows[i]);
        }
    }
}

/* Banded statistics and normalisation, each backend on its own: the
 * statistics (f32, compared tightly), the banded result against the CPU's,
 * and the GPU's banded result against its own whole-image group_norm. */
static void case_gn_bands(int64_t b, int64_t w, int64_t c, int groups, int silu,
                          const int64_t *rows, int nb)
{
    int64_t h = 0, most = 0;
    for (int i = 0; i < nb; i++) {
        h += rows[i];
        most = rows[i] > most ? rows[i] : most;
    }
    int64_t shape[4] = {b, h, w, c};
    dual x, wt, bs, st, y, band;
    dual_in(&x, KILN_BF16, 4, shape, 2.0f);
    dual_in(&wt, KILN_BF16, 1, (int64_t[]){c}, 1.5f);
    dual_in(&bs, KILN_BF16, 1, (int64_t[]){c}, 0.5f);
    dual_out(&y, KILN_BF16, 4, shape);
    dual_out(&st, KILN_F32, 3, (int64_t[]){b, groups, 2});
    dual_out(&band, KILN_BF16, 4, (int64_t[]){b, most, w, c});
    gn_banded(cpu, &y.c, &x.c, &band.c, &st.c, &wt.c, &bs.c, groups, silu, rows, nb);
    gn_banded(gpu, &y.g, &x.g, &band.g, &st.g, &wt.g, &bs.g, groups, silu, rows, nb);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lldx%lldx%lld g%d %d bands%s", (long long)b, (long long)h,
             (long long)w, (long long)c, groups, nb, silu ? " silu" : "");
    finish("group_norm_stats", desc, &st, 1e-4);
    /* The GPU's own whole-image group_norm, for the banded GPU result. */
    dual whole;
    dual_out(&whole, KILN_BF16, 4, shape);
    kiln_be_group_norm(gpu, &whole.g, &x.g, &wt.g, &bs.g, groups, 1e-6f, silu);
    int64_t n = numel_of(4, shape);
    float *a = xmalloc_f(n), *g = xmalloc_f(n);
    kiln_be_download(gpu, &y.g, a);
    kiln_be_download(gpu, &whole.g, g);
    double vs_whole = kiln_be_check(gpu, NULL) ? INFINITY : test_rel_err(a, g, (size_t)n);
    free(a);
    free(g);
    if (vs_whole >= TOL_BF16)
        printf("    banded vs whole group_norm on the GPU: %.2e\n", vs_whole);
    finish_ex("group_norm_apply", desc, &y, TOL_BF16, vs_whole < TOL_BF16);
    dual_free(&x), dual_free(&wt), dual_free(&bs), dual_free(&y), dual_free(&st);
    dual_free(&band), dual_free(&whole);
}

/* The vector kernel (16-byte aligned bf16, C % 8 == 0) and the element
 * kernel (the same data one element off alignment) give the same bits. */
static void case_gn_apply_paths(int64_t h, int64_t w, int64_t c, int groups)
{
    int64_t shape[4] = {1, h, w, c}, n = h * w * c;
    dual x, wt, bs, st, y;
    dual_in(&x, KILN_BF16, 4, shape, 2.0f);
    dual_in(&wt, KILN_BF16, 1, (int64_t[]){c}, 1.5f);
    dual_in(&bs, KILN_BF16, 1, (int64_t[]){c}, 0.5f);
    dual_out(&y, KILN_BF16, 4, shape);
    dual_out(&st, KILN_F32, 3, (int64_t[]){1, groups, 2});
    kiln_be_group_norm_stats(gpu, &st.g, &x.g, groups, 0);
    kiln_be_group_norm_apply(gpu, &y.g, &x.g, &wt.g, &bs.g, &st.g, n / groups, groups, 1e-6f, 1);
    kiln_tensor xm = {0}, ym = {0};
    kiln_be_alloc(gpu, &xm, KILN_BF16, 1, (int64_t[]){n + 8});
    kiln_be_alloc(gpu, &ym, KILN_BF16, 1, (int64_t[]){n + 8});
    kiln_tensor xv = xm, yv = ym;
    xv.data = (uint16_t *)xm.data + 1;
    yv.data = (uint16_t *)ym.data + 1;
    kiln_tensor_set_shape(&xv, KILN_BF16, 4, shape);
    kiln_tensor_set_shape(&yv, KILN_BF16, 4, shape);
    kiln_be_copy(gpu, &xv, &x.g);
    kiln_be_group_norm_apply(gpu, &yv, &xv, &wt.g, &bs.g, &st.g, n / groups, groups, 1e-6f, 1);
    float *a = xmalloc_f(n), *b = xmalloc_f(n);
    kiln_be_download(gpu, &y.g, a);
    kiln_be_download(gpu, &yv, b);
    kiln_err ge = {0};
    int ok = !kiln_be_check(gpu, &ge) && !memcmp(a, b, sizeof(float) * (size_t)n);
    char desc[96];
    snprintf(desc, sizeof desc, "1x%lldx%lldx%lld vector vs element", (long long)h, (long long)w,
             (long long)c);
    cases++;
    failed += !ok;
    printf("%-18s | %-34s | %9s | %s\n", "group_norm_apply", desc, ok ? "same bits" : "differ",
           ok ? "pass" : "FAIL");
    if (ge.code)
        printf("    cuda error: %s\n", ge.msg);
    free(a), free(b);
    kiln_be_free(gpu, &xm), kiln_be_free(gpu, &ym);
    dual_free(&x), dual_free(&wt), dual_free(&bs), dual_free(&y), dual_free(&st);
}

static void test_group_norm_bands(void)
{
    /* C % 8 != 0: the element kernels; else the vector kernels. */
    case_gn_bands(1, 7, 60, 12, 1, (int64_t[]){3, 1, 5}, 3);
    case_gn_bands(1, 7, 64, 32, 1, (int64_t[]){3, 1, 5}, 3);
    case_gn_bands(2, 64, 128, 32, 1, (int64_t[]){16, 16, 16, 9}, 4);
    case_gn_bands(1, 256, 256, 32, 0, (int64_t[]){40, 40, 3}, 3);
    case_gn_bands(2, 24, 32, 8, 1, (int64_t[]){5}, 1);
    case_gn_apply_paths(16, 64, 128, 32);
    case_gn_apply_paths(33, 40, 256, 32);
    case_gn_apply_paths(9, 11, 512, 32);
}

/* --- attention ------------------------------------------------------------- */

/* Random rotation tables (s, d) in the layout `mode` expects, on both sides. */
static void rope_tables(dual *cs, dual *sn, int64_t s, int64_t d, kiln_rope_mode mode)
{
    float *c = xmalloc_f(s * d), *si = xmalloc_f(s * d);
    for (int64_t t = 0; t < s; t++)
        for (int64_t i = 0; i < d / 2; i++) {
            float ang = 3.14159265f * frand() * (float)(t + 1);
            int64_t i0 = mode == KILN_ROPE_INTERLEAVED ? 2 * i : i;
            int64_t i1 = mode == KILN_ROPE_INTERLEAVED ? 2 * i + 1 : i + d / 2;
            c[t * d + i0] = c[t * d + i1] = cosf(ang);
            si[t * d + i0] = si[t * d + i1] = sinf(ang);
        }
    kiln_be_alloc(cpu, &cs->c, KILN_F32, 2, (int64_t[]){s, d});
    kiln_be_alloc(gpu, &cs->g, KILN_F32, 2, (int64_t[]){s, d});
    kiln_be_alloc(cpu, &sn->c, KILN_F32, 2, (int64_t[]){s, d});
    kiln_be_alloc(gpu, &sn->g, KILN_F32, 2, (int64_t[]){s, d});
    dual_upload(cs, c);
    dual_upload(sn, si);
    free(c);
    free(si);
}

static void case_rope(int64_t b, int64_t s, int64_t h, int64_t d, kiln_rope_mode mode)
{
    dual x, cs, sn;
    dual_in(&x, KILN_BF16, 4, (int64_t[]){b, s, h, d}, 2.0f);
    rope_tables(&cs, &sn, s, d, mode);
    kiln_be_rope(cpu, &x.c, &cs.c, &sn.c, mode);
    kiln_be_rope(gpu, &x.g, &cs.g, &sn.g, mode);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lldx%lldx%lld %s", (long long)b, (long long)s, (long long)h,
             (long long)d, mode == KILN_ROPE_INTERLEAVED ? "interleaved" : "half");
    finish("rope", desc, &x, TOL_BF16);
    dual_free(&x);
    dual_free(&cs);
    dual_free(&sn);
}

static void test_rope(void)
{
    case_rope(2, 17, 3, 64, KILN_ROPE_INTERLEAVED);
    case_rope(1, 33, 4, 128, KILN_ROPE_HALF);
    case_rope(1, 5, 2, 8, KILN_ROPE_HALF);
}

static void case_attn(int64_t b, int64_t sq, int64_t sk, int64_t hq, int64_t hkv, int64_t d,
                      int causal, const int *key_len)
{
    dual q, k, v, o;
    /* Larger q sharpens the softmax so that masks and the running max matter. */
    dual_in(&q, KILN_BF16, 4, (int64_t[]){b, sq, hq, d}, 3.0f);
    dual_in(&k, KILN_BF16, 4, (int64_t[]){b, sk, hkv, d}, 1.0f);
    dual_in(&v, KILN_BF16, 4, (int64_t[]){b, sk, hkv, d}, 1.0f);
    dual_out(&o, KILN_BF16, 4, (int64_t[]){b, sq, hq, d});
    kiln_attn_opts opts = {.scale = 1.0f / sqrtf((float)d), .causal = causal, .key_len = key_len};
    kiln_be_attention(cpu, &o.c, &q.c, &k.c, &v.c, &opts);
    kiln_be_attention(gpu, &o.g, &q.g, &k.g, &v.g, &opts);
    char desc[96];
    int off = snprintf(desc, sizeof desc, "B%lld Sq%lld Sk%lld H%lld/%lld d%lld%s", (long long)b,
                       (long long)sq, (long long)sk, (long long)hq, (long long)hkv, (long long)d,
                       causal ? " causal" : "");
    if (key_len)
        snprintf(desc + off, sizeof desc - (size_t)off, " len");
    finish("attention", desc, &o, TOL_BF16);
    dual_free(&q);
    dual_free(&k);
    dual_free(&v);
    dual_free(&o);
}

static void test_attention(void)
{
    case_attn(2, 77, 77, 4, 4, 64, 0, NULL);
    case_attn(1, 100, 300, 8, 2, 128, 0, NULL);            /* GQA 4:1, Sq != Sk */
    case_attn(2, 65, 65, 4, 4, 128, 1, (int[]){65, 30});   /* causal + key_len */
    case_attn(1, 40, 130, 2, 1, 32, 1, NULL);              /* causal, Sk > Sq */
    case_attn(1, 130, 40, 2, 2, 32, 1, NULL);              /* rows with no key */
    case_attn(3, 50, 90, 8, 2, 8, 0, (int[]){90, 1, 0});   /* d 8, empty batch */
    case_attn(1, 70, 70, 3, 3, 12, 1, NULL);               /* d % 8 != 0: scalar loads */
    case_attn(1, 64, 200, 2, 1, 72, 0, (int[]){150});      /* padded head dim */
    case_attn(1, 256, 256, 1, 1, 512, 0, NULL);            /* VAE mid-block: GEMMs */
    case_attn(2, 300, 264, 1, 1, 256, 0, NULL);            /* GEMMs, two batch rows */
    case_attn(1, 6, 16392, 1, 1, 256, 0, NULL);            /* GEMMs, rows past the register softmax */
    case_attn(1, 100, 136, 1, 1, 512, 0, (int[]){110});    /* d 512 masked: flash kernel */
    case_attn(1, 130, 130, 1, 1, 200, 1, NULL);            /* 200: two 128-col slices */
    case_attn(2, 600, 600, 3, 3, 128, 0, NULL);            /* DiT-like joint attention */
}

/* --- fused transformer ops ---------------------------------------------------- */

/* qkv_split against the CPU reference; the CUDA result must also equal the
 * unfused CUDA ops (copy_cols + rms_norm + rope) bit for bit.  hkv < h is
 * grouped-query attention (Qwen3's q|k|v, k and v narrower than q). */
static void case_qkv_split(int64_t b, int64_t s, int64_t h, int64_t hkv, int64_t d, int norm,
                           int rope, kiln_rope_mode mode)
{
    int64_t Dq = h * d, Dkv = hkv * d;
    int64_t qshape[3] = {b, s, Dq}, kvshape[3] = {b, s, Dkv};
    dual P, wq, wk, cs, sn, q, k, v;
    dual_in(&P, KILN_BF16, 3, (int64_t[]){b, s, Dq + 2 * Dkv}, 2.0f);
    if (norm) {
        dual_in(&wq, KILN_BF16, 1, &d, 1.5f);
        dual_in(&wk, KILN_BF16, 1, &d, 1.5f);
    }
    if (rope)
        rope_tables(&cs, &sn, s, d, mode);
    dual_out(&q, KILN_BF16, 3, qshape);
    dual_out(&k, KILN_BF16, 3, kvshape);
    dual_out(&v, KILN_BF16, 3, kvshape);
    kiln_be_qkv_split(cpu, &q.c, &k.c, &v.c, &P.c, norm ? &wq.c : NULL, norm ? &wk.c : NULL,
                      1e-6f, rope ? &cs.c : NULL, rope ? &sn.c : NULL, mode);
    kiln_be_qkv_split(gpu, &q.g, &k.g, &v.g, &P.g, norm ? &wq.g : NULL, norm ? &wk.g : NULL,
                      1e-6f, rope ? &cs.g : NULL, rope ? &sn.g : NULL, mode);

    /* The unfused CUDA sequence the DiT ran before. */
    int64_t mismatches = 0;
    float *fused = xmalloc_f(b * s * Dq), *plain = xmalloc_f(b * s * Dq);
    for (int part = 0; part < 2; part++) {
        int64_t D = part ? Dkv : Dq, n = b * s * D;
        kiln_tensor u = {0};
        kiln_be_alloc(gpu, &u, KILN_BF16, 3, (int64_t[]){b, s, D});
        kiln_be_copy_cols(gpu, &u, 0, &P.g, part * Dq, D);
        if (norm)
            kiln_be_rms_norm(gpu, &u, &u, part ? &wk.g : &wq.g, 1e-6f);
        if (rope) {
            kiln_tensor hv = u;
            kiln_tensor_set_shape(&hv, KILN_BF16, 4, (int64_t[]){b, s, D / d, d});
            kiln_be_rope(gpu, &hv, &cs.g, &sn.g, mode);
        }
        kiln_be_download(gpu, &u, plain);
        kiln_be_download(gpu, part ? &k.g : &q.g, fused);
        for (int64_t i = 0; i < n; i++)
            mismatches += memcmp(&fused[i], &plain[i], sizeof(float)) != 0;
        kiln_be_free(gpu, &u);
    }
    free(fused);
    free(plain);

    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lld H%lld/%lld d%lld%s%s", (long long)b, (long long)s,
             (long long)h, (long long)hkv, (long long)d, norm ? " norm" : "",
             rope ? (mode == KILN_ROPE_INTERLEAVED ? " rope-il" : " rope-half") : "");
    CHECKF(mismatches == 0, "qkv_split %s: %lld elements differ from the unfused CUDA ops", desc,
           (long long)mismatches);
    finish_ex("qkv_split q", desc, &q, TOL_BF16, mismatches == 0);
    finish("qkv_split k", desc, &k, TOL_BF16);
    finish("qkv_split v", desc, &v, TOL_EXACT);
    dual_free(&P);
    if (norm) {
        dual_free(&wq);
        dual_free(&wk);
    }
    if (rope) {
        dual_free(&cs);
        dual_free(&sn);
    }
    dual_free(&q);
    dual_free(&k);
    dual_free(&v);
}

static void test_qkv_split(void)
{
    /* Heads of 32 J (J = 1, 2, 4, 8) run the register kernel, others (and
     * half rotations with odd J) the generic one. */
    case_qkv_split(2, 17, 3, 3, 64, 1, 1, KILN_ROPE_INTERLEAVED);
    case_qkv_split(1, 40, 4, 4, 128, 1, 1, KILN_ROPE_INTERLEAVED); /* DiT head size */
    case_qkv_split(1, 9, 2, 2, 64, 1, 1, KILN_ROPE_HALF);
    case_qkv_split(1, 6, 2, 2, 256, 1, 1, KILN_ROPE_INTERLEAVED);
    case_qkv_split(2, 5, 2, 2, 32, 0, 1, KILN_ROPE_INTERLEAVED);
    case_qkv_split(1, 7, 2, 2, 128, 1, 0, KILN_ROPE_INTERLEAVED);
    case_qkv_split(1, 9, 2, 2, 32, 1, 1, KILN_ROPE_HALF);          /* generic */
    case_qkv_split(2, 5, 3, 3, 16, 0, 1, KILN_ROPE_INTERLEAVED);   /* generic */
    case_qkv_split(1, 7, 2, 2, 24, 1, 0, KILN_ROPE_INTERLEAVED);   /* generic */
    /* grouped-query attention: Qwen3-4B's 32 q and 8 kv heads of 128, half
     * rotations, and an odd head size on the generic kernel */
    case_qkv_split(1, 19, 32, 8, 128, 1, 1, KILN_ROPE_HALF);
    case_qkv_split(2, 7, 6, 2, 96, 1, 1, KILN_ROPE_HALF);
    case_qkv_split(1, 5, 4, 1, 64, 0, 1, KILN_ROPE_INTERLEAVED);
}

/* SwiGLU into a column slice; the columns around it must stay untouched. */
static void case_swiglu_cols(int64_t rows, int64_t f, int64_t cols, int64_t col0)
{
    dual x, y;
    dual_in(&x, KILN_BF16, 2, (int64_t[]){rows, 2 * f}, 4.0f);
    dual_in(&y, KILN_BF16, 2, (int64_t[]){rows, cols}, 1.0f);
    kiln_be_swiglu_cols(cpu, &y.c, col0, &x.c);
    kiln_be_swiglu_cols(gpu, &y.g, col0, &x.g);
    char desc[64];
    snprintf(desc, sizeof desc, "%lldx2*%lld -> %lldx%lld @%lld", (long long)rows, (long long)f,
             (long long)rows, (long long)cols, (long long)col0);
    finish("swiglu_cols", desc, &y, TOL_BF16);
    dual_free(&x);
    dual_free(&y);
}

static void test_swiglu_cols(void)
{
    case_swiglu_cols(33, 64, 96, 32); /* 16-byte vectors */
    case_swiglu_cols(5, 45, 100, 40); /* element path */
    case_swiglu_cols(3, 24, 60, 36);  /* aligned sizes, unaligned offset */
}

/* --- elementwise ----------------------------------------------------------- */

static void test_silu_swiglu(void)
{
    int64_t shapes[2][2] = {{1, 1000}, {3, 37}};
    for (int i = 0; i < 2; i++) {
        dual x, y;
        dual_in(&x, KILN_BF16, 2, shapes[i], 6.0f);
        dual_out(&y, KILN_BF16, 2, shapes[i]);
        kiln_be_silu(cpu, &y.c, &x.c);
        kiln_be_silu(gpu, &y.g, &x.g);
        char desc[64];
        snprintf(desc, sizeof desc, "%lldx%lld", (long long)shapes[i][0], (long long)shapes[i][1]);
        finish("silu", desc, &y, TOL_BF16);
        dual_free(&y);
        dual_out(&y, KILN_BF16, 2, shapes[i]);
        kiln_be_tanh(cpu, &y.c, &x.c);
        kiln_be_tanh(gpu, &y.g, &x.g);
        finish("tanh", desc, &y, TOL_BF16);
        dual_free(&x);
        dual_free(&y);
    }
    int64_t sw[2][2] = {{7, 45}, {64, 512}};
    for (int i = 0; i < 2; i++) {
        dual x, y;
        dual_in(&x, KILN_BF16, 2, (int64_t[]){sw[i][0], 2 * sw[i][1]}, 4.0f);
        dual_out(&y, KILN_BF16, 2, sw[i]);
        kiln_be_swiglu(cpu, &y.c, &x.c);
        kiln_be_swiglu(gpu, &y.g, &x.g);
        char desc[64];
        snprintf(desc, sizeof desc, "%lldx2*%lld", (long long)sw[i][0], (long long)sw[i][1]);
        finish("swiglu", desc, &y, TOL_BF16);
        dual_free(&x);
        dual_free(&y);
    }
}

static void test_add(void)
{
    dual a, b, y;
    dual_in(&a, KILN_BF16, 2, (int64_t[]){13, 77}, 1.0f);
    dual_in(&b, KILN_BF16, 2, (int64_t[]){13, 77}, 1.0f);
    dual_out(&y, KILN_BF16, 2, (int64_t[]){13, 77});
    kiln_be_add(cpu, &y.c, &a.c, &b.c);
    kiln_be_add(gpu, &y.g, &a.g, &b.g);
    finish("add", "13x77", &y, TOL_BF16);
    kiln_be_add(cpu, &a.c, &a.c, &b.c);
    kiln_be_add(gpu, &a.g, &a.g, &b.g);
    finish("add", "13x77 in place", &a, TOL_BF16);
    dual_free(&a);
    dual_free(&b);
    dual_free(&y);
    /* A multiple of 8 bf16 values takes the 16-byte path. */
    dual_in(&a, KILN_BF16, 2, (int64_t[]){16, 96}, 1.0f);
    dual_in(&b, KILN_BF16, 2, (int64_t[]){16, 96}, 1.0f);
    dual_out(&y, KILN_BF16, 2, (int64_t[]){16, 96});
    kiln_be_add(cpu, &y.c, &a.c, &b.c);
    kiln_be_add(gpu, &y.g, &a.g, &b.g);
    finish("add", "16x96 (16-byte vectors)", &y, TOL_BF16);
    dual_free(&a);
    dual_free(&b);
    dual_free(&y);
    /* F32 tensors on the GPU take the fp32 path: near-exact. */
    dual_in(&a, KILN_F32, 1, (int64_t[]){999}, 1.0f);
    dual_in(&b, KILN_F32, 1, (int64_t[]){999}, 1.0f);
    dual_out(&y, KILN_F32, 1, (int64_t[]){999});
    kiln_be_add(cpu, &y.c, &a.c, &b.c);
    kiln_be_add(gpu, &y.g, &a.g, &b.g);
    finish("add", "999 f32", &y, 1e-6);
    dual_free(&a);
    dual_free(&b);
    dual_free(&y);
}

static void test_gated_add(void)
{
    /* D = 40 runs 16-byte vectors, D = 36 the element path. */
    const int64_t dims[2] = {40, 36};
    for (int i = 0; i < 2; i++)
        for (int gated = 1; gated >= 0; gated--) {
            int64_t d = dims[i];
            dual x, g, y;
            dual_in(&x, KILN_BF16, 3, (int64_t[]){2, 13, d}, 1.0f);
            dual_in(&y, KILN_BF16, 3, (int64_t[]){2, 13, d}, 1.0f);
            if (gated)
                dual_in(&g, KILN_BF16, 2, (int64_t[]){2, d}, 2.0f);
            kiln_be_gated_add(cpu, &x.c, gated ? &g.c : NULL, &y.c);
            kiln_be_gated_add(gpu, &x.g, gated ? &g.g : NULL, &y.g);
            char desc[64];
            snprintf(desc, sizeof desc, "2x13x%lld %s", (long long)d,
                     gated ? "gate 2xD" : "no gate");
            finish("gated_add", desc, &x, TOL_BF16);
            dual_free(&x);
            dual_free(&y);
            if (gated)
                dual_free(&g);
        }
}

/* bf16 latents must follow pipeline.md section 7 bit for bit:
 * x_next = bf16(x + bf16(bf16(dt) * v)). */
static void test_euler(void)
{
    const int64_t n = 4099;
    const float dt = -0.04460925f;
    dual x, v;
    dual_in(&x, KILN_BF16, 1, &n, 2.0f);
    dual_in(&v, KILN_BF16, 1, &n, 2.0f);
    float *hx = xmalloc_f(n), *hv = xmalloc_f(n), *got = xmalloc_f(n);
    kiln_be_download(cpu, &x.c, hx);
    kiln_be_download(cpu, &v.c, hv);
    kiln_be_euler_step(cpu, &x.c, &v.c, dt);
    kiln_be_euler_step(gpu, &x.g, &v.g, dt);
    kiln_be_download(gpu, &x.g, got);
    int64_t mismatches = 0;
    float dtb = kiln_round_bf16(dt);
    for (int64_t i = 0; i < n; i++)
        mismatches += got[i] != kiln_round_bf16(hx[i] + kiln_round_bf16(dtb * hv[i]));
    CHECKF(mismatches == 0, "%lld of %lld bf16 Euler steps differ from the diffusers chain",
           (long long)mismatches, (long long)n);
    finish_ex("euler_step", mismatches ? "4099 bf16 (chain WRONG)" : "4099 bf16 (chain exact)", &x,
              TOL_BF16, mismatches == 0);
    dual_free(&x);
    dual_free(&v);
    free(hx);
    free(hv);
    free(got);
    /* f32 latents with a bf16 velocity (Z-Image): plain fp32 update. */
    dual_in(&x, KILN_F32, 1, &n, 2.0f);
    dual_in(&v, KILN_BF16, 1, &n, 2.0f);
    kiln_be_euler_step(cpu, &x.c, &v.c, dt);
    kiln_be_euler_step(gpu, &x.g, &v.g, dt);
    finish("euler_step", "4099 f32 x, bf16 v", &x, 1e-6);
    dual_free(&x);
    dual_free(&v);
}

static void test_cfg(void)
{
    dual p, q, o;
    dual_in(&p, KILN_BF16, 2, (int64_t[]){17, 129}, 1.0f);
    dual_in(&q, KILN_BF16, 2, (int64_t[]){17, 129}, 1.0f);
    dual_out(&o, KILN_BF16, 2, (int64_t[]){17, 129});
    kiln_be_cfg(cpu, &o.c, &p.c, &q.c, 4.0f);
    kiln_be_cfg(gpu, &o.g, &p.g, &q.g, 4.0f);
    finish("cfg", "17x129 g=4", &o, TOL_BF16);
    kiln_be_cfg(cpu, &p.c, &p.c, &q.c, 2.5f);
    kiln_be_cfg(gpu, &p.g, &p.g, &q.g, 2.5f);
    finish("cfg", "17x129 g=2.5 out=pos", &p, TOL_BF16);
    dual_free(&p);
    dual_free(&q);
    dual_free(&o);
}

/* --- data movement ---------------------------------------------------------- */

static void test_copies(void)
{
    dual dst, src;
    /* Converting copies (Z-Image's fp32 latents cast for its DiT, and
     * back): bf16-representable values, so both directions are exact. */
    dual_in(&src, KILN_F32, 2, (int64_t[]){3, 1001}, 4.0f);
    dual_out(&dst, KILN_BF16, 2, (int64_t[]){3, 1001});
    kiln_be_copy(cpu, &dst.c, &src.c);
    kiln_be_copy(gpu, &dst.g, &src.g);
    finish("copy (convert)", "3x1001 F32 -> BF16", &dst, TOL_EXACT);
    dual_free(&src);
    dual_out(&src, KILN_F32, 2, (int64_t[]){3, 1001});
    kiln_be_copy(cpu, &src.c, &dst.c);
    kiln_be_copy(gpu, &src.g, &dst.g);
    finish("copy (convert)", "3x1001 BF16 -> F32", &src, TOL_EXACT);
    dual_free(&dst);
    dual_free(&src);

    dual_in(&dst, KILN_BF16, 3, (int64_t[]){2, 10, 24}, 1.0f);
    dual_in(&src, KILN_BF16, 3, (int64_t[]){2, 7, 24}, 1.0f);
    kiln_be_copy_rows(cpu, &dst.c, 3, &src.c, 2, 5);
    kiln_be_copy_rows(gpu, &dst.g, 3, &src.g, 2, 5);
    finish("copy_rows", "2x7x24 [2,7) -> 2x10x24 @3", &dst, TOL_EXACT);
    dual_free(&dst);
    dual_free(&src);

    dual_in(&dst, KILN_BF16, 2, (int64_t[]){5, 30}, 1.0f);
    dual_in(&src, KILN_BF16, 3, (int64_t[]){1, 5, 17}, 1.0f);
    kiln_be_copy_cols(cpu, &dst.c, 11, &src.c, 3, 9);
    kiln_be_copy_cols(gpu, &dst.g, 11, &src.g, 3, 9);
    finish("copy_cols", "5x17 [3,12) -> 5x30 @11", &dst, TOL_EXACT);
    dual_free(&dst);
    dual_free(&src);
    /* 16-byte aligned slices take the vector kernel. */
    dual_in(&dst, KILN_BF16, 2, (int64_t[]){6, 48}, 1.0f);
    dual_in(&src, KILN_BF16, 2, (int64_t[]){6, 32}, 1.0f);
    kiln_be_copy_cols(cpu, &dst.c, 24, &src.c, 8, 16);
    kiln_be_copy_cols(gpu, &dst.g, 24, &src.g, 8, 16);
    finish("copy_cols", "6x32 [8,24) -> 6x48 @24 (16-byte vectors)", &dst, TOL_EXACT);
    dual_free(&dst);
    dual_free(&src);

    dual_in(&src, KILN_BF16, 2, (int64_t[]){33, 65}, 1.0f);
    dual_out(&dst, KILN_BF16, 2, (int64_t[]){33, 65});
    kiln_be_copy(cpu, &dst.c, &src.c);
    kiln_be_copy(gpu, &dst.g, &src.g);
    finish("copy", "33x65", &dst, TOL_EXACT);
    dual_free(&dst);
    dual_free(&src);

    int64_t ts[3][3] = {{3, 37, 45}, {1, 64, 1}, {2, 100, 33}};
    for (int i = 0; i < 3; i++) {
        dual x, y;
        dual_in(&x, KILN_BF16, 3, ts[i], 1.0f);
        dual_out(&y, KILN_BF16, 3, (int64_t[]){ts[i][0], ts[i][2], ts[i][1]});
        kiln_be_transpose(cpu, &y.c, &x.c);
        kiln_be_transpose(gpu, &y.g, &x.g);
        char desc[64];
        snprintf(desc, sizeof desc, "%lldx%lldx%lld", (long long)ts[i][0], (long long)ts[i][1],
                 (long long)ts[i][2]);
        finish("transpose", desc, &y, TOL_EXACT);
        dual_free(&x);
        dual_free(&y);
    }
    /* (B, H, W, C): C = 3 copies elements, C = 16 and 8 16-byte vectors. */
    int64_t us[3][4] = {{1, 7, 5, 3}, {2, 16, 16, 16}, {1, 5, 9, 8}};
    for (int i = 0; i < 3; i++) {
        dual x, y;
        dual_in(&x, KILN_BF16, 4, us[i], 1.0f);
        dual_out(&y, KILN_BF16, 4, (int64_t[]){us[i][0], 2 * us[i][1], 2 * us[i][2], us[i][3]});
        kiln_be_upsample_nearest2x(cpu, &y.c, &x.c);
        kiln_be_upsample_nearest2x(gpu, &y.g, &x.g);
        char desc[64];
        snprintf(desc, sizeof desc, "%lldx%lldx%lldx%lld", (long long)us[i][0],
                 (long long)us[i][1], (long long)us[i][2], (long long)us[i][3]);
        finish("upsample_nearest2x", desc, &y, TOL_EXACT);
        dual_free(&x);
        dual_free(&y);
    }
}

/* --- convolution ------------------------------------------------------------ */

enum { CONV_BIAS = 1, CONV_RESIDUAL = 2 };

/* x (b, h, w, cin), w (cout, k, k, cin) -> y (b, ho, wo, cout), with a bias
 * and a residual as `flags` say.  A residual's result must also equal the
 * unfused CUDA ops (the convolution, then add) bit for bit. */
static void case_conv(int64_t b, int64_t cin, int64_t h, int64_t w, int64_t cout, int64_t k,
                      int stride, const int pad[4], int flags)
{
    dual x, wt, bs, rs, y;
    int bias = flags & CONV_BIAS, res = flags & CONV_RESIDUAL;
    int64_t ho = (h + pad[0] + pad[2] - k) / stride + 1, wo = (w + pad[1] + pad[3] - k) / stride + 1;
    int64_t yshape[4] = {b, ho, wo, cout};
    dual_in(&x, KILN_BF16, 4, (int64_t[]){b, h, w, cin}, 1.0f);
    dual_in(&wt, KILN_BF16, 4, (int64_t[]){cout, k, k, cin}, 1.0f / sqrtf((float)(cin * k * k)));
    if (bias)
        dual_in(&bs, KILN_BF16, 1, (int64_t[]){cout}, 0.5f);
    if (res)
        dual_in(&rs, KILN_BF16, 4, yshape, 1.0f);
    dual_out(&y, KILN_BF16, 4, yshape);
    kiln_be_conv2d(cpu, &y.c, &x.c, &wt.c, bias ? &bs.c : NULL, res ? &rs.c : NULL, stride, pad);
    kiln_be_conv2d(gpu, &y.g, &x.g, &wt.g, bias ? &bs.g : NULL, res ? &rs.g : NULL, stride, pad);
    int64_t mismatches = 0;
    if (res) {
        int64_t n = b * ho * wo * cout;
        kiln_tensor u = {0};
        float *fused = xmalloc_f(n), *plain = xmalloc_f(n);
        kiln_be_alloc(gpu, &u, KILN_BF16, 4, yshape);
        kiln_be_conv2d(gpu, &u, &x.g, &wt.g, bias ? &bs.g : NULL, NULL, stride, pad);
        kiln_be_add(gpu, &u, &u, &rs.g);
        kiln_be_download(gpu, &u, plain);
        kiln_be_download(gpu, &y.g, fused);
        for (int64_t i = 0; i < n; i++)
            mismatches += memcmp(&fused[i], &plain[i], sizeof(float)) != 0;
        kiln_be_free(gpu, &u);
        free(fused);
        free(plain);
    }
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx%lldx%lldx%lld->%lld k%lld s%d p%d%d%d%d%s", (long long)b,
             (long long)cin, (long long)h, (long long)w, (long long)cout, (long long)k, stride,
             pad[0], pad[1], pad[2], pad[3], res ? " +res" : "");
    CHECKF(mismatches == 0, "conv2d %s: %lld elements differ from conv2d then add", desc,
           (long long)mismatches);
    finish_ex("conv2d", desc, &y, TOL_BF16, mismatches == 0);
    dual_free(&x);
    dual_free(&wt);
    if (bias)
        dual_free(&bs);
    if (res)
        dual_free(&rs);
    dual_free(&y);
}

/* Cin % 8 != 0 gathers element by element, else 8 channels at a time.  The
 * residual cases are a ResnetBlock2D's conv2 (kept and changed channel
 * counts, Cout % 8 != 0 on the element-wise epilogue). */
static void test_conv(void)
{
    const int B = CONV_BIAS, R = CONV_RESIDUAL;
    case_conv(1, 3, 17, 13, 8, 3, 1, (int[]){1, 1, 1, 1}, B);
    case_conv(2, 16, 20, 20, 24, 3, 2, (int[]){0, 0, 1, 1}, B); /* VAE downsampler */
    case_conv(2, 16, 21, 19, 24, 3, 2, (int[]){0, 1, 0, 1}, B);
    case_conv(1, 12, 9, 11, 3, 3, 1, (int[]){1, 1, 1, 1}, B);   /* Cout = 3 */
    case_conv(1, 64, 32, 32, 64, 3, 1, (int[]){1, 1, 1, 1}, B);
    case_conv(1, 40, 9, 9, 70, 1, 1, (int[]){0, 0, 0, 0}, 0);
    case_conv(1, 128, 24, 24, 128, 3, 1, (int[]){1, 1, 1, 1}, B);
    case_conv(3, 32, 15, 15, 160, 3, 1, (int[]){1, 1, 1, 1}, B); /* two Cout tiles */
    case_conv(1, 512, 8, 8, 64, 3, 1, (int[]){1, 1, 1, 1}, B);   /* K = 4608 */
    case_conv(2, 64, 16, 12, 64, 3, 1, (int[]){1, 1, 1, 1}, B | R);
    case_conv(1, 128, 20, 20, 64, 3, 1, (int[]){1, 1, 1, 1}, B | R);
    case_conv(1, 16, 9, 7, 12, 3, 1, (int[]){1, 1, 1, 1}, B | R);
    case_conv(1, 32, 8, 8, 40, 1, 1, (int[]){0, 0, 0, 0}, R);
}

/* --- image output ------------------------------------------------------------ */

/* Prints a row for a case whose result is a count of wrong bytes. */
static void finish_bytes(const char *op, const char *shape, int64_t bad, kiln_status cs,
                         kiln_status gs, const char *gmsg)
{
    int pass = !cs && !gs && bad == 0;
    cases++;
    failed += !pass;
    char res[32];
    if (bad)
        snprintf(res, sizeof res, "%lld bad", (long long)bad);
    else
        snprintf(res, sizeof res, "exact");
    printf("%-18s | %-34s | %9s | %s\n", op, shape, cs || gs ? "error" : res,
           pass ? "pass" : "FAIL");
    if (gs)
        printf("    cuda error: %s\n", gmsg);
    fflush(stdout);
}

/* One rgb8 input value, as f32 bits: the rule's hard cases come often. */
static float rgb8_value(int64_t i, int bf16)
{
    /* Every bf16 value once (NaNs, infinities, zeros, subnormals
     * included): for a bf16 input that is every case there is. */
    if (i < 65536)
        return kiln_bf16_to_f32((uint16_t)i);
    uint64_t r = next_u64();
    float v;
    switch (r % 4) {
    case 0: { /* x whose (x / 2 + 0.5) * 255 lies a few ulps from k + 0.5 */
        float half = ((float)(r >> 8 & 0xff) + 0.5f) / 255.0f;
        v = (half - 0.5f) * 2.0f;
        int steps = (int)(r >> 16 & 7) - 4;
        for (; steps > 0; steps--)
            v = nextafterf(v, INFINITY);
        for (; steps < 0; steps++)
            v = nextafterf(v, -INFINITY);
        break;
    }
    case 1: { /* any bit pattern */
        uint32_t u = (uint32_t)(r >> 32);
        memcpy(&v, &u, sizeof v);
        break;
    }
    default:
        v = 1.1f * frand();
    }
    return bf16 ? kiln_round_bf16(v) : v;
}

/* to_rgb8 on both backends from the same values, in bf16 or f32: the
 * bytes must be identical (the rule is exact, kernels/rgb8.h).  Run twice
 * over outputs poisoned with 0x00 and 0xFF, so a byte the kernel never
 * writes cannot match both times. */
static void case_rgb8(int64_t B, int64_t H, int64_t W, kiln_dtype dt)
{
    int64_t n = B * 3 * H * W, nb = B * H * W * 3;
    int bf = dt == KILN_BF16;
    void *h = malloc((size_t)n * 4);
    uint8_t *got = malloc((size_t)nb), *want = malloc((size_t)nb);
    if (!h || !got || !want) {
        fprintf(stderr, "out of host memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < n; i++) {
        float v = rgb8_value(i, bf);
        if (bf)
            ((uint16_t *)h)[i] = kiln_f32_to_bf16(v);
        else
            ((float *)h)[i] = v;
    }
    int64_t xs[4] = {B, 3, H, W}, rs[4] = {B, H, W, 3};
    kiln_tensor xc, xg, rc, rg;
    kiln_be_alloc(cpu, &xc, dt, 4, xs);
    kiln_be_alloc(gpu, &xg, dt, 4, xs);
    kiln_be_alloc(cpu, &rc, KILN_U8, 4, rs);
    kiln_be_alloc(gpu, &rg, KILN_U8, 4, rs);
    kiln_be_upload(cpu, &xc, h, dt);
    kiln_be_upload(gpu, &xg, h, dt);
    kiln_be_to_rgb8(cpu, &rc, &xc);
    kiln_be_download_bytes(cpu, &rc, want);
    int64_t bad = 0;
    for (int poison = 0; poison < 2; poison++) {
        memset(got, poison ? 0xFF : 0x00, (size_t)nb);
        kiln_be_upload(gpu, &rg, got, KILN_U8);
        kiln_be_to_rgb8(gpu, &rg, &xg);
        memset(got, 0x5A, (size_t)nb);
        kiln_be_download_bytes(gpu, &rg, got);
        for (int64_t i = 0; i < nb; i++)
            bad += got[i] != want[i];
    }
    kiln_err ce = {0}, ge = {0};
    kiln_status cs = kiln_be_check(cpu, &ce), gs = kiln_be_check(gpu, &ge);
    char desc[96];
    snprintf(desc, sizeof desc, "%lldx3x%lldx%lld %s", (long long)B, (long long)H, (long long)W,
             bf ? "bf16" : "f32");
    finish_bytes("to_rgb8", desc, bad, cs, gs, ge.msg);
    if (cs)
        printf("    cpu error: %s\n", ce.msg);
    kiln_be_free(cpu, &xc), kiln_be_free(gpu, &xg), kiln_be_free(cpu, &rc),
        kiln_be_free(gpu, &rg);
    free(h), free(got), free(want);
}

static void test_to_rgb8(void)
{
    case_rgb8(2, 131, 127, KILN_BF16); /* every bf16 value, odd sides */
    case_rgb8(2, 131, 127, KILN_F32);
    case_rgb8(1, 1, 1, KILN_F32);
    /* More pixels than the grid has threads (cuda_blocks: SMs x 32 blocks of
     * 256, 1.08M on an H100 SXM, 1.21M with 148 SMs), so the grid-stride
     * loop runs a second round: 3 x 1031 x 521 = 1.61M. */
    case_rgb8(3, 1031, 521, KILN_BF16);
    case_rgb8(3, 1031, 521, KILN_F32);
}

/* download_bytes: any dtype's bytes unchanged, through staging that grows
 * (a small download, a large one, a small one again). */
static void test_download_bytes(void)
{
    const int64_t sizes[3] = {1001, 3 * (1 << 20) + 7, 13};
    const kiln_dtype dts[3] = {KILN_U8, KILN_BF16, KILN_F32};
    int64_t bad = 0;
    for (int k = 0; k < 3; k++) {
        kiln_tensor t;
        kiln_be_alloc(gpu, &t, dts[k], 1, &sizes[k]);
        size_t nbytes = kiln_tensor_nbytes(&t);
        uint8_t *src = malloc(nbytes), *back = malloc(nbytes);
        if (!src || !back) {
            fprintf(stderr, "out of host memory\n");
            exit(1);
        }
        for (size_t i = 0; i < nbytes; i++)
            src[i] = (uint8_t)next_u64();
        kiln_be_upload(gpu, &t, src, dts[k]);
        memset(back, 0, nbytes);
        kiln_be_download_bytes(gpu, &t, back);
        bad += memcmp(src, back, nbytes) != 0;
        kiln_be_free(gpu, &t);
        free(src), free(back);
    }
    kiln_err ge = {0};
    kiln_status gs = kiln_be_check(gpu, &ge);
    finish_bytes("download_bytes", "u8 1001, bf16 3M+7, f32 13", bad, KILN_OK, gs, ge.msg);
}

/* --- transfers and errors ----------------------------------------------------- */

static void test_transfers(void)
{
    enum { N = 1001 };
    float f[N], got[N];
    uint16_t b[N];
    for (int i = 0; i < N; i++) {
        f[i] = 100.0f * frand();
        b[i] = kiln_f32_to_bf16(f[i]);
    }
    kiln_tensor t;
    kiln_be_alloc(gpu, &t, KILN_BF16, 1, (int64_t[]){N});
    kiln_be_upload(gpu, &t, f, KILN_F32);
    kiln_be_download(gpu, &t, got);
    int bad = 0;
    for (int i = 0; i < N; i++)
        bad += got[i] != kiln_round_bf16(f[i]);
    kiln_be_upload(gpu, &t, b, KILN_BF16);
    kiln_be_download(gpu, &t, got);
    for (int i = 0; i < N; i++)
        bad += got[i] != kiln_bf16_to_f32(b[i]);
    kiln_be_free(gpu, &t);
    kiln_be_alloc(gpu, &t, KILN_F32, 1, (int64_t[]){N});
    kiln_be_upload(gpu, &t, f, KILN_F32);
    kiln_be_download(gpu, &t, got);
    for (int i = 0; i < N; i++)
        bad += got[i] != f[i];
    kiln_be_free(gpu, &t);
    kiln_err err = {0};
    kiln_status st = kiln_be_check(gpu, &err);
    CHECKF(st == KILN_OK && bad == 0, "status %d (%s), %d wrong values", st, err.msg, bad);
    cases++;
    failed += st != KILN_OK || bad != 0;
    printf("%-18s | %-34s | %9s | %s\n", "upload/download", "f32, bf16 -> bf16, f32",
           bad ? "wrong" : "exact", st == KILN_OK && bad == 0 ? "pass" : "FAIL");
    fflush(stdout);
}

/* Plain attention and convolutions run through cuDNN when it is there;
 * the same cases again on kiln's own kernels, which serve every shape
 * cuDNN declines. */
static void test_native_kernels(void)
{
    kiln_err err = {0};
    kiln_backend *with_cudnn = gpu;
    setenv("KILN_CUDNN", "0", 1);
    gpu = kiln_backend_create("cuda", 0, &err);
    unsetenv("KILN_CUDNN");
    if (!gpu) {
        fprintf(stderr, "cuda backend (kiln's kernels only): %s\n", err.msg);
        failed++;
    } else {
        printf("(attention and conv2d again, KILN_CUDNN=0)\n");
        test_attention();
        test_conv();
        kiln_backend_destroy(gpu);
    }
    gpu = with_cudnn;
}

/* A caller bug becomes the sticky error: later ops are skipped, check()
 * reports and clears it, and the backend works again afterwards. */
static void test_sticky_error(void)
{
    dual x, w, y;
    dual_in(&x, KILN_BF16, 2, (int64_t[]){4, 8}, 1.0f);
    dual_in(&w, KILN_BF16, 2, (int64_t[]){6, 9}, 1.0f); /* K mismatch */
    dual_out(&y, KILN_BF16, 2, (int64_t[]){4, 6});
    kiln_be_linear(gpu, &y.g, &x.g, &w.g, NULL);
    kiln_be_silu(gpu, &y.g, &x.g); /* skipped: the error is sticky */
    kiln_err err = {0};
    kiln_status first = kiln_be_check(gpu, &err);
    kiln_status second = kiln_be_check(gpu, NULL);
    int ok = first == KILN_ERR_INTERNAL && strstr(err.msg, "linear") && second == KILN_OK;
    CHECKF(ok, "first %d (%s), second %d", first, err.msg, second);
    /* A device allocation that cannot succeed reports NOMEM, not a crash. */
    kiln_tensor huge;
    kiln_status st = kiln_be_alloc(gpu, &huge, KILN_BF16, 1, (int64_t[]){(int64_t)1 << 50});
    kiln_status after = kiln_be_check(gpu, &err);
    CHECKF(st == KILN_ERR_NOMEM && after == KILN_ERR_NOMEM && !huge.data, "alloc %d, check %d",
           st, after);
    ok = ok && st == KILN_ERR_NOMEM && after == KILN_ERR_NOMEM;
    cases++;
    failed += !ok;
    printf("%-18s | %-34s | %9s | %s\n", "sticky error", "bad linear, 2^50 alloc", "-",
           ok ? "pass" : "FAIL");
    fflush(stdout);
    dual_free(&x);
    dual_free(&w);
    dual_free(&y);
}

int main(void)
{
    const char *seed_env = getenv("KILN_TEST_SEED");
    rng = seed_env ? strtoull(seed_env, NULL, 10) : (uint64_t)time(NULL);
    printf("seed %llu (KILN_TEST_SEED=%llu repeats this run)\n", (unsigned long long)rng,
           (unsigned long long)rng);

    kiln_err err = {0};
    cpu = kiln_backend_create("cpu", 0, &err);
    if (!cpu) {
        fprintf(stderr, "cpu backend: %s\n", err.msg);
        return 1;
    }
    gpu = kiln_backend_create("cuda", 0, &err);
    if (!gpu) {
        kiln_backend_destroy(cpu);
        return gpu_test_unavailable("cuda backend", &err);
    }
    printf("%-18s | %-34s | %9s | %s\n", "op", "shape", "rel err", "pass");
    printf("-------------------+------------------------------------+-----------+-----\n");
    test_transfers();
    test_linear();
    test_fp8();
    test_rms_norm();
    test_layer_norm_mod();
    test_group_norm();
    test_group_norm_bands();
    test_rope();
    test_attention();
    test_silu_swiglu();
    test_qkv_split();
    test_swiglu_cols();
    test_add();
    test_gated_add();
    test_euler();
    test_cfg();
    test_copies();
    test_conv();
    test_to_rgb8();
    test_download_bytes();
    test_native_kernels();
    test_sticky_error();
    printf("%d cases, %d failed\n", cases, failed);
    fflush(stdout);
    kiln_backend_destroy(gpu);
    kiln_backend_destroy(cpu);
    return failed || test_finish() ? 1 : 0;
}
