#include <math.h>
#include <stdlib.h>

#include "cpu_ops.h"

void cpu_rope(kiln_backend *be, kiln_tensor *x, const kiln_tensor *cos, const kiln_tensor *sin,
              kiln_rope_mode mode)
{
    if (CPU_REQUIRE(be, x->ndim == 4 && cos->ndim == 2 && cos->shape[0] == x->shape[1] &&
                            cos->shape[1] == x->shape[3] && x->shape[3] % 2 == 0 &&
                            kiln_tensor_numel(sin) == kiln_tensor_numel(cos) &&
                            cos->dtype == KILN_F32 && sin->dtype == KILN_F32))
        return;
    int64_t bsz = x->shape[0], s = x->shape[1], h = x->shape[2], d = x->shape[3], half = d / 2;
    for (int64_t b = 0; b < bsz; b++)
        for (int64_t t = 0; t < s; t++) {
            const float *c = cpu_f32(cos) + t * d, *sn = cpu_f32(sin) + t * d;
            for (int64_t hh = 0; hh < h; hh++) {
                float *v = cpu_f32(x) + ((b * s + t) * h + hh) * d;
                for (int64_t i = 0; i < half; i++) {
                    int64_t i0 = mode == KILN_ROPE_INTERLEAVED ? 2 * i : i;
                    int64_t i1 = mode == KILN_ROPE_INTERLEAVED ? 2 * i + 1 : i + half;
                    float a = v[i0], bb = v[i1];
                    v[i0] = a * c[i0] - bb * sn[i0];
                    v[i1] = bb * c[i1] + a * sn[i1];
                }
            }
        }
}

void cpu_attention(kiln_backend *be, kiln_tensor *o, const kiln_tensor *q, const kiln_tensor *k,
                   const kiln_tensor *v, const kiln_attn_opts *opts)
{
    if (CPU_REQUIRE(be, q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && o->ndim == 4))
        return;
    int64_t bsz = q->shape[0], sq = q->shape[1], hq = q->shape[2], d = q->shape[3];
    int64_t sk = k->shape[1], hkv = k->shape[2], dv = v->shape[3];
    if (CPU_REQUIRE(be, k->shape[0] == bsz && v->shape[0] == bsz && k->shape[3] == d &&
                            v->shape[1] == sk && v->shape[2] == hkv && hkv > 0 &&
                            hq % hkv == 0 && o->shape[0] == bsz && o->shape[1] == sq &&
                            o->shape[2] == hq && o->shape[3] == dv && o->data != q->data))
        return;
    /* One score row per (batch, head) so the pairs can run in parallel. */
    float *scores = malloc((size_t)(bsz * hq * sk) * sizeof *scores);
    if (!scores) {
        kiln_be_fail(be, KILN_ERR_NOMEM, "cpu attention: out of memory");
        return;
    }
    int64_t group = hq / hkv, offset = sk - sq;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < bsz; b++) {
        for (int64_t h = 0; h < hq; h++) {
            int64_t valid = opts->key_len ? opts->key_len[b] : sk;
            int64_t kh = h / group;
            float *p = scores + (b * hq + h) * sk;
            for (int64_t i = 0; i < sq; i++) {
                const float *qi = cpu_f32(q) + ((b * sq + i) * hq + h) * d;
                int64_t last = valid;
                if (opts->causal && i + offset + 1 < last)
                    last = i + offset + 1;
                float *oi = cpu_f32(o) + ((b * sq + i) * hq + h) * dv;
                float mx = -INFINITY;
                for (int64_t j = 0; j < last; j++) {
                    const float *kj = cpu_f32(k) + ((b * sk + j) * hkv + kh) * d;
                    float s = 0;
                    for (int64_t e = 0; e < d; e++)
                        s += qi[e] * kj[e];
                    p[j] = s * opts->scale;
                    if (p[j] > mx)
                        mx = p[j];
                }
                double sum = 0;
                for (int64_t j = 0; j < last; j++) {
                    p[j] = expf(p[j] - mx);
                    sum += p[j];
                }
                for (int64_t e = 0; e < dv; e++)
                    oi[e] = 0;
                /* A query with no visible key (fully masked row) yields zeros. */
                if (last <= 0)
                    continue;
                float inv = (float)(1.0 / sum);
                for (int64_t j = 0; j < last; j++) {
                    const float *vj = cpu_f32(v) + ((b * sk + j) * hkv + kh) * dv;
                    float w = p[j] * inv;
                    for (int64_t e = 0; e < dv; e++)
                        oi[e] += w * vj[e];
                }
            }
        }
    }
    free(scores);
}
