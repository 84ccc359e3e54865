/* The fused transformer ops of the CPU reference: each is the sequence of
 * plain ops it stands for (kernels/backend.h), computed the same way, so the
 * reference of a fused CUDA kernel is the unfused computation. */
#include <math.h>

#include "cpu_ops.h"

/* Head `hh` of part `src` (d values) -> dst: per-head RMSNorm as
 * cpu_rms_norm computes it, then the rotation of cpu_rope. */
static void head_norm_rope(float *dst, const float *src, int64_t d, const float *w, float eps,
                           const float *c, const float *sn, kiln_rope_mode mode)
{
    float inv = 1.0f;
    if (w) {
        double ss = 0;
        for (int64_t i = 0; i < d; i++)
            ss += (double)src[i] * src[i];
        inv = 1.0f / sqrtf((float)(ss / (double)d) + eps);
    }
    for (int64_t i = 0; i < d; i++)
        dst[i] = w ? src[i] * inv * w[i] : src[i];
    if (!c)
        return;
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        int64_t i0 = mode == KILN_ROPE_INTERLEAVED ? 2 * i : i;
        int64_t i1 = mode == KILN_ROPE_INTERLEAVED ? 2 * i + 1 : i + half;
        float a = dst[i0], b = dst[i1];
        dst[i0] = a * c[i0] - b * sn[i0];
        dst[i1] = b * c[i1] + a * sn[i1];
    }
}

void cpu_qkv_split(kiln_backend *be, kiln_tensor *q, kiln_tensor *k, kiln_tensor *v,
                   const kiln_tensor *P, const kiln_tensor *norm_q, const kiln_tensor *norm_k,
                   float eps, const kiln_tensor *cos, const kiln_tensor *sin, kiln_rope_mode mode)
{
    if (CPU_REQUIRE(be, P->ndim == 3) || P->shape[0] * P->shape[1] == 0)
        return;
    int64_t bsz = P->shape[0], s = P->shape[1], rows = bsz * s;
    int64_t Dq = kiln_tensor_numel(q) / rows, Dkv = kiln_tensor_numel(k) / rows;
    int64_t W = Dq + 2 * Dkv;
    int64_t d = norm_q ? kiln_tensor_numel(norm_q) : cos ? cos->shape[1] : Dkv;
    if (CPU_REQUIRE(be, P->shape[2] == W && d > 0 && Dkv > 0 && Dq >= Dkv && Dq % d == 0 &&
                            Dkv % d == 0 && d % 2 == 0 && kiln_tensor_numel(q) == rows * Dq &&
                            kiln_tensor_numel(k) == rows * Dkv &&
                            kiln_tensor_numel(v) == rows * Dkv &&
                            (!norm_q || kiln_tensor_numel(norm_q) == d) &&
                            (!norm_k || kiln_tensor_numel(norm_k) == d) && !cos == !sin &&
                            (!cos || (cos->ndim == 2 && cos->shape[0] == s &&
                                      cos->shape[1] == d &&
                                      kiln_tensor_numel(sin) == s * d))))
        return;
    for (int64_t r = 0; r < rows; r++) {
        const float *src = cpu_f32(P) + r * W;
        int64_t t = r % s;
        const float *c = cos ? cpu_f32(cos) + t * d : NULL, *sn = sin ? cpu_f32(sin) + t * d : NULL;
        for (int64_t h = 0; h < Dq / d; h++)
            head_norm_rope(cpu_f32(q) + r * Dq + h * d, src + h * d, d,
                           norm_q ? cpu_f32(norm_q) : NULL, eps, c, sn, mode);
        for (int64_t h = 0; h < Dkv / d; h++)
            head_norm_rope(cpu_f32(k) + r * Dkv + h * d, src + Dq + h * d, d,
                           norm_k ? cpu_f32(norm_k) : NULL, eps, c, sn, mode);
        for (int64_t i = 0; i < Dkv; i++)
            cpu_f32(v)[r * Dkv + i] = src[Dq + Dkv + i];
    }
}

void cpu_swiglu_cols(kiln_backend *be, kiln_tensor *y, int64_t dst_col0, const kiln_tensor *x)
{
    int64_t rows = kiln_tensor_rows(x), f = kiln_tensor_cols(x) / 2, cols = kiln_tensor_cols(y);
    if (CPU_REQUIRE(be, kiln_tensor_cols(x) % 2 == 0 && kiln_tensor_rows(y) == rows &&
                            dst_col0 >= 0 && dst_col0 + f <= cols && y->data != x->data))
        return;
    for (int64_t r = 0; r < rows; r++) {
        const float *xs = cpu_f32(x) + r * 2 * f;
        float *ys = cpu_f32(y) + r * cols + dst_col0;
        for (int64_t i = 0; i < f; i++)
            ys[i] = xs[i] / (1.0f + expf(-xs[i])) * xs[f + i];
    }
}
