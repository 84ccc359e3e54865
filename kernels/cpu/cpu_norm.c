#include <math.h>

#include "cpu_ops.h"

void cpu_rms_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                  float eps)
{
    int64_t g = kiln_tensor_numel(w), n = kiln_tensor_numel(x);
    if (CPU_REQUIRE(be, g > 0 && n % g == 0 && kiln_tensor_numel(y) == n))
        return;
    const float *ws = cpu_f32(w);
    for (int64_t off = 0; off < n; off += g) {
        const float *xs = cpu_f32(x) + off;
        float *ys = cpu_f32(y) + off;
        double ss = 0;
        for (int64_t i = 0; i < g; i++)
            ss += (double)xs[i] * xs[i];
        float inv = 1.0f / sqrtf((float)(ss / (double)g) + eps);
        for (int64_t i = 0; i < g; i++)
            ys[i] = xs[i] * inv * ws[i];
    }
}

void cpu_layer_norm_mod(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                        const kiln_tensor *shift, const kiln_tensor *scale, float eps)
{
    if (CPU_REQUIRE(be, x->ndim == 3 && kiln_tensor_numel(y) == kiln_tensor_numel(x)))
        return;
    int64_t bsz = x->shape[0], s = x->shape[1], d = x->shape[2];
    if (CPU_REQUIRE(be, (!shift || kiln_tensor_numel(shift) == bsz * d) &&
                            (!scale || kiln_tensor_numel(scale) == bsz * d)))
        return;
    for (int64_t b = 0; b < bsz; b++) {
        const float *sh = shift ? cpu_f32(shift) + b * d : NULL;
        const float *sc = scale ? cpu_f32(scale) + b * d : NULL;
        for (int64_t t = 0; t < s; t++) {
            const float *xs = cpu_f32(x) + (b * s + t) * d;
            float *ys = cpu_f32(y) + (b * s + t) * d;
            double mean = 0, var = 0;
            for (int64_t i = 0; i < d; i++)
                mean += xs[i];
            mean /= (double)d;
            for (int64_t i = 0; i < d; i++)
                var += ((double)xs[i] - mean) * ((double)xs[i] - mean);
            var /= (double)d;
            float inv = 1.0f / sqrtf((float)var + eps);
            for (int64_t i = 0; i < d; i++) {
                float v = (xs[i] - (float)mean) * inv;
                if (sc)
                    v *= 1.0f + sc[i];
                if (sh)
                    v += sh[i];
                ys[i] = v;
            }
        }
    }
}

void cpu_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                    const kiln_tensor *b, int groups, float eps, int silu)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 &&
                            kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                            kiln_tensor_numel(w) == x->shape[1] &&
                            kiln_tensor_numel(b) == x->shape[1]))
        return;
    int64_t bsz = x->shape[0], c = x->shape[1], hw = x->shape[2] * x->shape[3];
    int64_t cpg = c / groups, n = cpg * hw;
    for (int64_t bi = 0; bi < bsz; bi++) {
        for (int g = 0; g < groups; g++) {
            const float *xs = cpu_f32(x) + (bi * c + g * cpg) * hw;
            float *ys = cpu_f32(y) + (bi * c + g * cpg) * hw;
            double mean = 0, var = 0;
            for (int64_t i = 0; i < n; i++)
                mean += xs[i];
            mean /= (double)n;
            for (int64_t i = 0; i < n; i++)
                var += ((double)xs[i] - mean) * ((double)xs[i] - mean);
            var /= (double)n;
            float inv = 1.0f / sqrtf((float)var + eps);
            for (int64_t ch = 0; ch < cpg; ch++) {
                float wc = cpu_f32(w)[g * cpg + ch], bc = cpu_f32(b)[g * cpg + ch];
                for (int64_t i = 0; i < hw; i++) {
                    float v = (xs[ch * hw + i] - (float)mean) * inv * wc + bc;
                    ys[ch * hw + i] = silu ? v / (1.0f + expf(-v)) : v;
                }
            }
        }
    }
}

/* Band statistics merged into the running (mean, M2) of each group: the
 * band's own are two-pass in double, the merge is Chan et al.'s. */
void cpu_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                          int64_t count_before)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 &&
                            stats->dtype == KILN_F32 && count_before >= 0 &&
                            kiln_tensor_numel(stats) == x->shape[0] * groups * 2))
        return;
    int64_t bsz = x->shape[0], c = x->shape[1], hw = x->shape[2] * x->shape[3];
    int64_t cpg = c / groups, n = cpg * hw;
    if (!n)
        return;
    for (int64_t bi = 0; bi < bsz; bi++) {
        for (int g = 0; g < groups; g++) {
            const float *xs = cpu_f32(x) + (bi * c + g * cpg) * hw;
            float *st = cpu_f32(stats) + (bi * groups + g) * 2;
            double mean = 0, m2 = 0;
            for (int64_t i = 0; i < n; i++)
                mean += xs[i];
            mean /= (double)n;
            for (int64_t i = 0; i < n; i++)
                m2 += ((double)xs[i] - mean) * ((double)xs[i] - mean);
            if (count_before) {
                double na = (double)count_before, tot = na + (double)n;
                double delta = mean - st[0];
                mean = st[0] + delta * (double)n / tot;
                m2 = st[1] + m2 + delta * delta * na * (double)n / tot;
            }
            st[0] = (float)mean;
            st[1] = (float)m2;
        }
    }
}

/* cpu_group_norm's arithmetic with the statistics given. */
void cpu_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                          const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                          int64_t count, int groups, float eps, int silu)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[1] % groups == 0 &&
                            kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                            kiln_tensor_numel(w) == x->shape[1] &&
                            kiln_tensor_numel(b) == x->shape[1] && stats->dtype == KILN_F32 &&
                            kiln_tensor_numel(stats) == x->shape[0] * groups * 2 && count > 0))
        return;
    int64_t bsz = x->shape[0], c = x->shape[1], hw = x->shape[2] * x->shape[3];
    int64_t cpg = c / groups;
    for (int64_t bi = 0; bi < bsz; bi++) {
        for (int g = 0; g < groups; g++) {
            const float *st = cpu_f32(stats) + (bi * groups + g) * 2;
            const float *xs = cpu_f32(x) + (bi * c + g * cpg) * hw;
            float *ys = cpu_f32(y) + (bi * c + g * cpg) * hw;
            float mean = st[0], inv = 1.0f / sqrtf((float)((double)st[1] / (double)count) + eps);
            for (int64_t ch = 0; ch < cpg; ch++) {
                float wc = cpu_f32(w)[g * cpg + ch], bc = cpu_f32(b)[g * cpg + ch];
                for (int64_t i = 0; i < hw; i++) {
                    float v = (xs[ch * hw + i] - mean) * inv * wc + bc;
                    ys[ch * hw + i] = silu ? v / (1.0f + expf(-v)) : v;
                }
            }
        }
    }
}
