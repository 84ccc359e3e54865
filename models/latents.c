/* Latent layouts, normalisation and 8-bit conversion (see latents.h).
 *
 * Each arithmetic step is one torch/numpy operation and must be rounded on its
 * own; this file is compiled with -ffp-contract=off (models/meson.build) so
 * that x * std + mean never becomes a fused multiply-add.
 *
 * Every output element is computed alone, so the loops over large images run
 * on OpenMP threads without changing a value (a 1024x1024 image's 8-bit
 * conversion alone was ~10 ms on one core, on the decoder's critical path). */
#include "models/latents.h"

#include <assert.h>
#include <math.h>

#include "kernels/rgb8.h"

/* Below this many elements a loop stays on the calling thread. */
#define PARALLEL_MIN (1 << 16)

/* B independent (rows, cols) -> (cols, rows) transposes. */
static void transpose(const float *src, float *dst, int64_t B, int64_t rows, int64_t cols)
{
    for (int64_t b = 0; b < B; b++) {
        const float *s = src + b * rows * cols;
        float *d = dst + b * rows * cols;
#pragma omp parallel for if (rows * cols >= PARALLEL_MIN)
        for (int64_t k = 0; k < cols; k++)
            for (int64_t r = 0; r < rows; r++)
                d[k * rows + r] = s[r * cols + k];
    }
}

/* (B, C, h*w) channel planes <-> (B, h*w, C) tokens. */
void kiln_latents_pack(const float *src, float *dst, int64_t B, int64_t C, int64_t h, int64_t w)
{
    transpose(src, dst, B, C, h * w);
}

void kiln_latents_unpack(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                         int64_t w)
{
    transpose(src, dst, B, h * w, C);
}

/* Moves every latent[b, c, 2y+dy, 2x+dx] of a (B, C, 2h, 2w) buffer to or
 * from (`to_patches`) patch[b, 4c+2dy+dx, y, x] of a (B, 4C, h, w) buffer. */
static void patch_move(const float *src, float *dst, int64_t B, int64_t C, int64_t h, int64_t w,
                       int to_patches)
{
#pragma omp parallel for collapse(2) if (B * C * h * w * 4 >= PARALLEL_MIN)
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t d = 0; d < 4; d++)
                for (int64_t y = 0; y < h; y++)
                    for (int64_t x = 0; x < w; x++) {
                        int64_t yy = 2 * y + d / 2, xx = 2 * x + d % 2;
                        int64_t full = ((b * C + c) * 2 * h + yy) * 2 * w + xx;
                        int64_t patch = ((b * 4 * C + 4 * c + d) * h + y) * w + x;
                        if (to_patches)
                            dst[patch] = src[full];
                        else
                            dst[full] = src[patch];
                    }
}

void kiln_latents_patchify(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                           int64_t w)
{
    patch_move(src, dst, B, C, h, w, 1);
}

void kiln_latents_unpatchify(const float *src, float *dst, int64_t B, int64_t C, int64_t h,
                             int64_t w)
{
    patch_move(src, dst, B, C, h, w, 0);
}

/* Rounds to the pipeline dtype: identity for fp32, to nearest even for bf16. */
static float to_dt(float v, int bf16) { return bf16 ? kiln_round_bf16(v) : v; }

/* std_c = sqrt(var_c + eps): `running_var + batch_norm_eps` adds the Python
 * float as an fp32 scalar, then sqrt, each rounded to the buffers' dtype. */
static float bn_std(float var, float eps, int bf16)
{
    return to_dt(sqrtf(to_dt(var + eps, bf16)), bf16);
}

/* x = (x - mean_c) / std_c, or with `inverse` x = x * std_c + mean_c; each
 * operation rounded on its own. */
static void bn_apply(float *x, int64_t B, int64_t C, int64_t hw, const float *mean,
                     const float *var, double eps, kiln_dtype dt, int inverse)
{
    assert(dt == KILN_F32 || dt == KILN_BF16);
    const int bf16 = dt == KILN_BF16;
#pragma omp parallel for if (B * C * hw >= PARALLEL_MIN)
    for (int64_t c = 0; c < C; c++) {
        const float std = bn_std(var[c], (float)eps, bf16);
        const float m = mean[c];
        for (int64_t b = 0; b < B; b++) {
            float *p = x + (b * C + c) * hw;
            for (int64_t i = 0; i < hw; i++)
                p[i] = inverse ? to_dt(to_dt(p[i] * std, bf16) + m, bf16)
                               : to_dt(to_dt(p[i] - m, bf16) / std, bf16);
        }
    }
}

void kiln_latents_bn_normalize(float *x, int64_t B, int64_t C, int64_t hw, const float *mean,
                               const float *var, double eps, kiln_dtype dt)
{
    bn_apply(x, B, C, hw, mean, var, eps, dt, 0);
}

void kiln_latents_bn_denormalize(float *x, int64_t B, int64_t C, int64_t hw, const float *mean,
                                 const float *var, double eps, kiln_dtype dt)
{
    bn_apply(x, B, C, hw, mean, var, eps, dt, 1);
}

/* Z-Image's decode(latents / scaling_factor + shift_factor): true division, as
 * on the CPU; CUDA multiplies by fl32(1/scaling) instead, which changes fp32
 * results in the last ulp but never a bf16 one (vae.md §5). */
void kiln_latents_kl_unscale(float *x, int64_t n, double scaling_factor, double shift_factor,
                             kiln_dtype dt)
{
    assert(dt == KILN_F32 || dt == KILN_BF16);
    const int bf16 = dt == KILN_BF16;
    const float scale = (float)scaling_factor, shift = (float)shift_factor;
    for (int64_t i = 0; i < n; i++)
        x[i] = to_dt(to_dt(to_dt(x[i], bf16) / scale, bf16) + shift, bf16);
}

static void grid_ids(int32_t *ids, int32_t t, int64_t h, int64_t w)
{
    for (int64_t y = 0; y < h; y++)
        for (int64_t x = 0; x < w; x++) {
            int32_t *row = ids + 4 * (y * w + x);
            row[0] = t;
            row[1] = (int32_t)y;
            row[2] = (int32_t)x;
            row[3] = 0;
        }
}

void kiln_latents_image_ids(int32_t *ids, int64_t h, int64_t w) { grid_ids(ids, 0, h, w); }

void kiln_latents_ref_ids(int32_t *ids, int k, int64_t h, int64_t w)
{
    assert(k >= 0 && k < 200000000);
    grid_ids(ids, 10 + 10 * k, h, w);
}

void kiln_latents_text_ids(int32_t *ids, int64_t T)
{
    for (int64_t i = 0; i < T; i++) {
        ids[4 * i + 0] = 0;
        ids[4 * i + 1] = 0;
        ids[4 * i + 2] = 0;
        ids[4 * i + 3] = (int32_t)i;
    }
}

void kiln_latents_to_rgb8(const float *x, uint8_t *rgb, int64_t B, int64_t H, int64_t W,
                          kiln_dtype dt)
{
    assert(dt == KILN_F32 || dt == KILN_BF16);
    const int bf16 = dt == KILN_BF16;
    const int64_t plane = H * W;
    for (int64_t b = 0; b < B; b++) {
        const float *src = x + b * 3 * plane;
        uint8_t *dst = rgb + b * 3 * plane;
#pragma omp parallel for if (plane >= PARALLEL_MIN)
        for (int64_t i = 0; i < plane; i++)
            for (int64_t ch = 0; ch < 3; ch++)
                dst[3 * i + ch] = kiln_rgb8_byte(src[ch * plane + i], bf16);
    }
}

/* Index of latent[b, c, p*y + py, p*x + px] and of its token feature. */
#define ZI_LATENT(b, c, y, py, x, px) ((((b) * C + (c)) * p * h + (y) * p + (py)) * p * w + (x) * p + (px))
#define ZI_TOKEN(b, y, x, py, px, c) ((((b) * h + (y)) * w + (x)) * p * p * C + ((py) * p + (px)) * C + (c))

void kiln_latents_zimage_patchify(const float *src, float *dst, int64_t B, int64_t C, int64_t p,
                                  int64_t h, int64_t w)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t y = 0; y < h; y++)
                for (int64_t py = 0; py < p; py++)
                    for (int64_t x = 0; x < w; x++)
                        for (int64_t px = 0; px < p; px++)
                            dst[ZI_TOKEN(b, y, x, py, px, c)] = src[ZI_LATENT(b, c, y, py, x, px)];
}

void kiln_latents_zimage_unpatchify(const float *src, float *dst, int64_t B, int64_t C,
                                    int64_t p, int64_t h, int64_t w)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = 0; c < C; c++)
            for (int64_t y = 0; y < h; y++)
                for (int64_t py = 0; py < p; py++)
                    for (int64_t x = 0; x < w; x++)
                        for (int64_t px = 0; px < p; px++)
                            dst[ZI_LATENT(b, c, y, py, x, px)] = src[ZI_TOKEN(b, y, x, py, px, c)];
}
