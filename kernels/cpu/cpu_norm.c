#include <math.h>
#include <stdlib.h>

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

/* GroupNorm over channels-last x (B, H, W, C): group g holds channels
 * [g * cpg, (g + 1) * cpg) of every pixel. */
typedef struct gn_shape {
    int64_t bsz, pixels, c, cpg;
} gn_shape;

static int gn_shape_of(kiln_backend *be, const kiln_tensor *x, int groups, gn_shape *s)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && groups > 0 && x->shape[3] % groups == 0))
        return -1;
    *s = (gn_shape){x->shape[0], x->shape[1] * x->shape[2], x->shape[3], x->shape[3] / groups};
    return 0;
}

/* One batch row's per-group (mean, M2), two passes in double. */
static void gn_row_moments(const float *x, const gn_shape *s, int groups, double *mean,
                           double *m2)
{
    for (int g = 0; g < groups; g++)
        mean[g] = m2[g] = 0;
    for (int64_t p = 0; p < s->pixels; p++)
        for (int64_t ch = 0; ch < s->c; ch++)
            mean[ch / s->cpg] += x[p * s->c + ch];
    double n = (double)(s->pixels * s->cpg);
    for (int g = 0; g < groups; g++)
        mean[g] /= n;
    for (int64_t p = 0; p < s->pixels; p++)
        for (int64_t ch = 0; ch < s->c; ch++) {
            double d = (double)x[p * s->c + ch] - mean[ch / s->cpg];
            m2[ch / s->cpg] += d * d;
        }
}

/* y = (x - mean) * inv * w + b, optional SiLU, for one batch row with its
 * groups' mean and inv given. */
static void gn_row_apply(float *y, const float *x, const gn_shape *s, const float *mean,
                         const float *inv, const float *w, const float *b, int silu)
{
    for (int64_t p = 0; p < s->pixels; p++)
        for (int64_t ch = 0; ch < s->c; ch++) {
            int64_t g = ch / s->cpg;
            float v = (x[p * s->c + ch] - mean[g]) * inv[g] * w[ch] + b[ch];
            y[p * s->c + ch] = silu ? v / (1.0f + expf(-v)) : v;
        }
}

/* Scratch for a row's per-group values: 2 doubles and 2 floats a group. */
typedef struct gn_scratch {
    double *mean, *m2;
    float *fmean, *inv;
} gn_scratch;

static int gn_scratch_new(kiln_backend *be, gn_scratch *t, int groups)
{
    t->mean = malloc(2 * (size_t)groups * sizeof(double));
    t->fmean = malloc(2 * (size_t)groups * sizeof(float));
    if (!t->mean || !t->fmean) {
        free(t->mean);
        free(t->fmean);
        kiln_be_fail(be, KILN_ERR_NOMEM, "group_norm: out of memory");
        return -1;
    }
    t->m2 = t->mean + groups;
    t->inv = t->fmean + groups;
    return 0;
}

static void gn_scratch_free(gn_scratch *t)
{
    free(t->mean);
    free(t->fmean);
}

void cpu_group_norm(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x, const kiln_tensor *w,
                    const kiln_tensor *b, int groups, float eps, int silu)
{
    gn_shape s;
    gn_scratch t;
    if (gn_shape_of(be, x, groups, &s) ||
        CPU_REQUIRE(be, kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                            kiln_tensor_numel(w) == s.c && kiln_tensor_numel(b) == s.c) ||
        gn_scratch_new(be, &t, groups))
        return;
    double n = (double)(s.pixels * s.cpg);
    for (int64_t bi = 0; bi < s.bsz; bi++) {
        const float *xs = cpu_f32(x) + bi * s.pixels * s.c;
        gn_row_moments(xs, &s, groups, t.mean, t.m2);
        for (int g = 0; g < groups; g++) {
            t.fmean[g] = (float)t.mean[g];
            t.inv[g] = 1.0f / sqrtf((float)(t.m2[g] / n) + eps);
        }
        gn_row_apply(cpu_f32(y) + bi * s.pixels * s.c, xs, &s, t.fmean, t.inv, cpu_f32(w),
                     cpu_f32(b), silu);
    }
    gn_scratch_free(&t);
}

/* Band statistics merged into the running (mean, M2) of each group: the
 * band's own are two-pass in double, the merge is Chan et al.'s. */
void cpu_group_norm_stats(kiln_backend *be, kiln_tensor *stats, const kiln_tensor *x, int groups,
                          int64_t count_before)
{
    gn_shape s;
    gn_scratch t;
    if (gn_shape_of(be, x, groups, &s) ||
        CPU_REQUIRE(be, stats->dtype == KILN_F32 && count_before >= 0 &&
                            kiln_tensor_numel(stats) == s.bsz * groups * 2))
        return;
    double n = (double)(s.pixels * s.cpg);
    if (!n || gn_scratch_new(be, &t, groups))
        return;
    for (int64_t bi = 0; bi < s.bsz; bi++) {
        gn_row_moments(cpu_f32(x) + bi * s.pixels * s.c, &s, groups, t.mean, t.m2);
        for (int g = 0; g < groups; g++) {
            float *st = cpu_f32(stats) + (bi * groups + g) * 2;
            double mean = t.mean[g], m2 = t.m2[g];
            if (count_before) {
                double na = (double)count_before, tot = na + n;
                double delta = mean - st[0];
                mean = st[0] + delta * n / tot;
                m2 = st[1] + m2 + delta * delta * na * n / tot;
            }
            st[0] = (float)mean;
            st[1] = (float)m2;
        }
    }
    gn_scratch_free(&t);
}

/* cpu_group_norm's arithmetic with the statistics given. */
void cpu_group_norm_apply(kiln_backend *be, kiln_tensor *y, const kiln_tensor *x,
                          const kiln_tensor *w, const kiln_tensor *b, const kiln_tensor *stats,
                          int64_t count, int groups, float eps, int silu)
{
    gn_shape s;
    gn_scratch t;
    if (gn_shape_of(be, x, groups, &s) ||
        CPU_REQUIRE(be, kiln_tensor_numel(y) == kiln_tensor_numel(x) &&
                            kiln_tensor_numel(w) == s.c && kiln_tensor_numel(b) == s.c &&
                            stats->dtype == KILN_F32 &&
                            kiln_tensor_numel(stats) == s.bsz * groups * 2 && count > 0) ||
        gn_scratch_new(be, &t, groups))
        return;
    for (int64_t bi = 0; bi < s.bsz; bi++) {
        for (int g = 0; g < groups; g++) {
            const float *st = cpu_f32(stats) + (bi * groups + g) * 2;
            t.fmean[g] = st[0];
            t.inv[g] = 1.0f / sqrtf((float)((double)st[1] / (double)count) + eps);
        }
        gn_row_apply(cpu_f32(y) + bi * s.pixels * s.c, cpu_f32(x) + bi * s.pixels * s.c, &s,
                     t.fmean, t.inv, cpu_f32(w), cpu_f32(b), silu);
    }
    gn_scratch_free(&t);
}
