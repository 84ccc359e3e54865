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
    if (CPU_REQUIRE(be, P->ndim == 3 && P->shape[2] % 3 == 0))
        return;
    int64_t bsz = P->shape[0], s = P->shape[1], D = P->shape[2] / 3;
    int64_t d = norm_q ? kiln_tensor_numel(norm_q) : cos ? cos->shape[1] : D;
    if (CPU_REQUIRE(be, d > 0 && D % d == 0 && d % 2 == 0 && kiln_tensor_numel(q) == bsz * s * D &&
                            kiln_tensor_numel(k) == bsz * s * D &&
                            kiln_tensor_numel(v) == bsz * s * D &&
                            (!norm_q || kiln_tensor_numel(norm_q) == d) &&
                            (!norm_k || kiln_tensor_numel(norm_k) == d) && !cos == !sin &&
                            (!cos || (cos->ndim == 2 && cos->shape[0] == s &&
                                      cos->shape[1] == d &&
                                      kiln_tensor_numel(sin) == s * d))))
        return;
    int64_t heads = D / d;
    for (int64_t r = 0; r < bsz * s; r++) {
        const float *src = cpu_f32(P) + r * 3 * D;
        int64_t t = r % s;
        const float *c = cos ? cpu_f32(cos) + t * d : NULL, *sn = sin ? cpu_f32(sin) + t * d : NULL;
        for (int64_t h = 0; h < heads; h++) {
            head_norm_rope(cpu_f32(q) + r * D + h * d, src + h * d, d,
                           norm_q ? cpu_f32(norm_q) : NULL, eps, c, sn, mode);
            head_norm_rope(cpu_f32(k) + r * D + h * d, src + D + h * d, d,
                           norm_k ? cpu_f32(norm_k) : NULL, eps, c, sn, mode);
        }
        for (int64_t i = 0; i < D; i++)
            cpu_f32(v)[r * D + i] = src[2 * D + i];
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
