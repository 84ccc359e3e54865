/* Properties of the CPU reference ops (they are the oracle for CUDA, so they
 * are checked against hand-computed values and invariants here). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "models/latents.h"
#include "tests/test.h"

static kiln_backend *be;

static void tensor(kiln_tensor *t, int ndim, const int64_t *shape, const float *vals)
{
    kiln_be_alloc(be, t, KILN_F32, ndim, shape);
    if (vals)
        memcpy(t->data, vals, kiln_tensor_nbytes(t));
}

static float lcg_val(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static void fill(kiln_tensor *t, uint32_t seed)
{
    for (int64_t i = 0; i < kiln_tensor_numel(t); i++)
        ((float *)t->data)[i] = lcg_val(&seed);
}

static void test_linear(void)
{
    kiln_tensor x, w, b, y;
    tensor(&x, 2, (int64_t[]){2, 3}, (float[]){1, 2, 3, 4, 5, 6});
    tensor(&w, 2, (int64_t[]){2, 3}, (float[]){1, 0, -1, 0.5f, 0.5f, 0.5f});
    tensor(&b, 1, (int64_t[]){2}, (float[]){10, 20});
    tensor(&y, 2, (int64_t[]){2, 2}, NULL);
    kiln_be_linear(be, &y, &x, &w, &b);
    float *r = y.data;
    CHECK(r[0] == 8 && r[1] == 23 && r[2] == 8 && r[3] == 27.5f);
    kiln_tensor bad;
    tensor(&bad, 2, (int64_t[]){2, 3}, NULL);
    kiln_be_linear(be, &bad, &x, &w, NULL); /* wrong output width: a caller bug */
    kiln_err err = {0};
    CHECK(kiln_be_check(be, &err) == KILN_ERR_INTERNAL && strstr(err.msg, "linear"));
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    kiln_be_free(be, &x), kiln_be_free(be, &w), kiln_be_free(be, &b), kiln_be_free(be, &y);
    kiln_be_free(be, &bad);
}

static void test_attention_masks(void)
{
    int64_t shp[] = {2, 5, 4, 8}, kshp[] = {2, 5, 2, 8};
    kiln_tensor q, k, v, o, o2;
    tensor(&q, 4, shp, NULL), fill(&q, 1);
    tensor(&k, 4, kshp, NULL), fill(&k, 2);
    tensor(&v, 4, kshp, NULL), fill(&v, 3);
    tensor(&o, 4, shp, NULL), tensor(&o2, 4, shp, NULL);
    int key_len[2] = {5, 3};
    kiln_attn_opts opts = {.scale = 0.35f, .causal = 1, .key_len = key_len};
    kiln_be_attention(be, &o, &q, &k, &v, &opts);
    /* Causal: the first query sees only key 0, so it returns v[0] of its kv head. */
    for (int h = 0; h < 4; h++)
        for (int e = 0; e < 8; e++)
            CHECK_NEAR(((float *)o.data)[h * 8 + e], ((float *)v.data)[(h / 2) * 8 + e], 1e-6);
    /* Keys past key_len must not matter: perturb them and compare. */
    for (int j = 3; j < 5; j++)
        for (int e = 0; e < 16; e++) {
            ((float *)k.data)[((1 * 5 + j) * 2) * 8 + e] += 3.0f;
            ((float *)v.data)[((1 * 5 + j) * 2) * 8 + e] -= 2.0f;
        }
    kiln_be_attention(be, &o2, &q, &k, &v, &opts);
    CHECK(memcmp(o.data, o2.data, kiln_tensor_nbytes(&o)) == 0);
    /* Without masks every row is a convex combination: bounded by v's range. */
    kiln_attn_opts plain = {.scale = 0.35f};
    kiln_be_attention(be, &o2, &q, &k, &v, &plain);
    float vmin = 1e9f, vmax = -1e9f;
    for (int64_t i = 0; i < kiln_tensor_numel(&v); i++) {
        float x = ((float *)v.data)[i];
        vmin = x < vmin ? x : vmin, vmax = x > vmax ? x : vmax;
    }
    for (int64_t i = 0; i < kiln_tensor_numel(&o2); i++)
        CHECK(((float *)o2.data)[i] >= vmin - 1e-5f && ((float *)o2.data)[i] <= vmax + 1e-5f);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    kiln_be_free(be, &q), kiln_be_free(be, &k), kiln_be_free(be, &v);
    kiln_be_free(be, &o), kiln_be_free(be, &o2);
}

static void test_rope_modes(void)
{
    kiln_tensor x, c, s;
    tensor(&x, 4, (int64_t[]){1, 1, 1, 4}, (float[]){1, 2, 3, 4});
    /* 90 degrees on the first pair, 0 on the second. */
    tensor(&c, 2, (int64_t[]){1, 4}, (float[]){0, 0, 1, 1});
    tensor(&s, 2, (int64_t[]){1, 4}, (float[]){1, 1, 0, 0});
    kiln_be_rope(be, &x, &c, &s, KILN_ROPE_INTERLEAVED);
    float *r = x.data;
    CHECK(r[0] == -2 && r[1] == 1 && r[2] == 3 && r[3] == 4);
    /* Half mode pairs (0, 2) and (1, 3). */
    memcpy(x.data, (float[]){1, 2, 3, 4}, 16);
    memcpy(c.data, (float[]){0, 1, 0, 1}, 16);
    memcpy(s.data, (float[]){1, 0, 1, 0}, 16);
    kiln_be_rope(be, &x, &c, &s, KILN_ROPE_HALF);
    CHECK(r[0] == -3 && r[1] == 2 && r[2] == 1 && r[3] == 4);
    kiln_be_free(be, &x), kiln_be_free(be, &c), kiln_be_free(be, &s);
}

static void test_norms(void)
{
    kiln_tensor x, y, w, b;
    /* Channels last (3 x 3 pixels, 4 channels): group g is channels 2g and
     * 2g + 1 of every pixel. */
    tensor(&x, 4, (int64_t[]){1, 3, 3, 4}, NULL), fill(&x, 7);
    tensor(&y, 4, (int64_t[]){1, 3, 3, 4}, NULL);
    tensor(&w, 1, (int64_t[]){4}, (float[]){1, 1, 1, 1});
    tensor(&b, 1, (int64_t[]){4}, (float[]){0, 0, 0, 0});
    kiln_be_group_norm(be, &y, &x, &w, &b, 2, 1e-6f, 0);
    for (int g = 0; g < 2; g++) {
        double m = 0, v = 0;
        for (int i = 0; i < 18; i++)
            m += ((float *)y.data)[(i / 2) * 4 + 2 * g + i % 2];
        m /= 18;
        for (int i = 0; i < 18; i++)
            v += pow(((float *)y.data)[(i / 2) * 4 + 2 * g + i % 2] - m, 2);
        CHECK_NEAR(m, 0, 1e-5);
        CHECK_NEAR(v / 18, 1, 1e-4);
    }
    kiln_tensor r, rw;
    tensor(&r, 2, (int64_t[]){1, 4}, (float[]){3, 4, 3, 4});
    tensor(&rw, 1, (int64_t[]){2}, (float[]){1, 2});
    kiln_be_rms_norm(be, &r, &r, &rw, 0); /* per group of 2: rms = sqrt(12.5) */
    CHECK_NEAR(((float *)r.data)[0], 3 / sqrt(12.5), 1e-6);
    CHECK_NEAR(((float *)r.data)[3], 8 / sqrt(12.5), 1e-6);
    kiln_tensor l, sh, sc;
    tensor(&l, 3, (int64_t[]){2, 1, 2}, (float[]){1, 3, 5, 9});
    tensor(&sh, 2, (int64_t[]){2, 2}, (float[]){0, 0, 10, 10});
    tensor(&sc, 2, (int64_t[]){2, 2}, (float[]){1, 1, 0, 0});
    kiln_be_layer_norm_mod(be, &l, &l, &sh, &sc, 0);
    float *lv = l.data;
    CHECK_NEAR(lv[0], -2, 1e-6);
    CHECK_NEAR(lv[1], 2, 1e-6);
    CHECK_NEAR(lv[2], 9, 1e-6);
    CHECK_NEAR(lv[3], 11, 1e-6);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    kiln_be_free(be, &x), kiln_be_free(be, &y), kiln_be_free(be, &w), kiln_be_free(be, &b);
    kiln_be_free(be, &r), kiln_be_free(be, &rw), kiln_be_free(be, &l);
    kiln_be_free(be, &sh), kiln_be_free(be, &sc);
}

/* group_norm_stats over bands of rows, then group_norm_apply to each band,
 * is group_norm over the whole: bands of 3, 1 and 3 of 7 rows, batch 2,
 * with and without SiLU; the stats' old contents do not leak into a fresh
 * start (count_before 0). */
static void test_group_norm_bands(void)
{
    const int64_t B = 2, C = 6, H = 7, W = 5, G = 3, rows[3] = {3, 1, 3};
    kiln_tensor x, whole, w, b, st, band, out;
    tensor(&x, 4, (int64_t[]){B, H, W, C}, NULL), fill(&x, 11);
    for (int64_t i = 0; i < kiln_tensor_numel(&x); i++)
        ((float *)x.data)[i] = 3.0f + 2.0f * ((float *)x.data)[i]; /* mean far from 0 */
    tensor(&whole, 4, (int64_t[]){B, H, W, C}, NULL);
    tensor(&out, 4, (int64_t[]){B, H, W, C}, NULL);
    tensor(&w, 1, (int64_t[]){C}, NULL), fill(&w, 12);
    tensor(&b, 1, (int64_t[]){C}, NULL), fill(&b, 13);
    tensor(&st, 3, (int64_t[]){B, G, 2}, (float[]){9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9});
    tensor(&band, 4, (int64_t[]){B, 3, W, C}, NULL);
    kiln_tensor x3 = x, o3 = out; /* rows of W * C values */
    kiln_tensor_set_shape(&x3, KILN_F32, 3, (int64_t[]){B, H, W * C});
    kiln_tensor_set_shape(&o3, KILN_F32, 3, (int64_t[]){B, H, W * C});
    for (int silu = 0; silu < 2; silu++) {
        kiln_be_group_norm(be, &whole, &x, &w, &b, (int)G, 1e-6f, silu);
        int64_t r0 = 0;
        for (int i = 0; i < 3; r0 += rows[i++]) {
            kiln_tensor b4 = band, b3 = band;
            kiln_tensor_set_shape(&b4, KILN_F32, 4, (int64_t[]){B, rows[i], W, C});
            kiln_tensor_set_shape(&b3, KILN_F32, 3, (int64_t[]){B, rows[i], W * C});
            kiln_be_copy_rows(be, &b3, 0, &x3, r0, rows[i]);
            kiln_be_group_norm_stats(be, &st, &b4, (int)G, (C / G) * r0 * W);
        }
        r0 = 0;
        for (int i = 0; i < 3; r0 += rows[i++]) {
            kiln_tensor b4 = band, b3 = band;
            kiln_tensor_set_shape(&b4, KILN_F32, 4, (int64_t[]){B, rows[i], W, C});
            kiln_tensor_set_shape(&b3, KILN_F32, 3, (int64_t[]){B, rows[i], W * C});
            kiln_be_copy_rows(be, &b3, 0, &x3, r0, rows[i]);
            kiln_be_group_norm_apply(be, &b4, &b4, &w, &b, &st, (C / G) * H * W, (int)G, 1e-6f,
                                     silu);
            kiln_be_copy_rows(be, &o3, r0, &b3, 0, rows[i]);
        }
        CHECK(kiln_be_check(be, NULL) == KILN_OK);
        double worst = 0;
        for (int64_t i = 0; i < kiln_tensor_numel(&x); i++) {
            double d = fabs(((float *)out.data)[i] - ((float *)whole.data)[i]);
            worst = d > worst ? d : worst;
        }
        CHECKF(worst < 2e-6, "silu %d: banded group norm differs by %g", silu, worst);
    }
    /* Mismatched stats are a caller bug: a sticky error, nothing written. */
    kiln_tensor small;
    tensor(&small, 3, (int64_t[]){1, G, 2}, NULL);
    kiln_be_group_norm_stats(be, &small, &x, (int)G, 0);
    CHECK(kiln_be_check(be, NULL) == KILN_ERR_INTERNAL);
    kiln_be_free(be, &x), kiln_be_free(be, &whole), kiln_be_free(be, &out);
    kiln_be_free(be, &w), kiln_be_free(be, &b), kiln_be_free(be, &st);
    kiln_be_free(be, &band), kiln_be_free(be, &small);
}

static void test_conv_matches_linear(void)
{
    /* A 1x1 convolution is a linear layer over channels (channels last:
     * the pixels are the rows). */
    kiln_tensor x, w, bias, y, yl;
    tensor(&x, 4, (int64_t[]){1, 2, 5, 3}, NULL), fill(&x, 11);
    tensor(&w, 4, (int64_t[]){4, 1, 1, 3}, NULL), fill(&w, 12);
    tensor(&bias, 1, (int64_t[]){4}, NULL), fill(&bias, 13);
    tensor(&y, 4, (int64_t[]){1, 2, 5, 4}, NULL);
    kiln_be_conv2d(be, &y, &x, &w, &bias, NULL, 1, (int[]){0, 0, 0, 0});
    kiln_tensor x3 = x, w2 = w;
    kiln_tensor_set_shape(&x3, KILN_F32, 3, (int64_t[]){1, 10, 3});
    kiln_tensor_set_shape(&w2, KILN_F32, 2, (int64_t[]){4, 3});
    tensor(&yl, 3, (int64_t[]){1, 10, 4}, NULL);
    kiln_be_linear(be, &yl, &x3, &w2, &bias);
    for (int i = 0; i < 40; i++)
        CHECK_NEAR(((float *)y.data)[i], ((float *)yl.data)[i], 1e-6);
    /* 3x3 stride-2 with the VAE's asymmetric (0,1,0,1) padding: output size. */
    kiln_tensor w3, y3;
    tensor(&w3, 4, (int64_t[]){2, 3, 3, 3}, NULL), fill(&w3, 14);
    tensor(&y3, 4, (int64_t[]){1, 1, 2, 2}, NULL);
    kiln_be_conv2d(be, &y3, &x, &w3, NULL, NULL, 2, (int[]){0, 0, 1, 1});
    float ref = 0; /* output pixel (0, 1), channel 0, reads x rows 0..1, columns 2..4 */
    for (int ky = 0; ky < 2; ky++)
        for (int kx = 0; kx < 3; kx++)
            for (int ci = 0; ci < 3; ci++)
                ref += ((float *)w3.data)[(ky * 3 + kx) * 3 + ci] *
                       ((float *)x.data)[(ky * 5 + 2 + kx) * 3 + ci];
    CHECK_NEAR(((float *)y3.data)[2], ref, 1e-5);
    /* A residual is added to the finished sum: conv then add, bit for bit;
     * one that is the output itself is refused. */
    kiln_tensor r, yr;
    tensor(&r, 4, (int64_t[]){1, 2, 5, 4}, NULL), fill(&r, 15);
    tensor(&yr, 4, (int64_t[]){1, 2, 5, 4}, NULL);
    kiln_be_conv2d(be, &yr, &x, &w, &bias, &r, 1, (int[]){0, 0, 0, 0});
    kiln_be_add(be, &y, &y, &r);
    CHECK(memcmp(yr.data, y.data, 40 * sizeof(float)) == 0);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    kiln_be_conv2d(be, &yr, &x, &w, &bias, &yr, 1, (int[]){0, 0, 0, 0});
    CHECK(kiln_be_check(be, NULL) == KILN_ERR_INTERNAL);
    kiln_be_free(be, &x), kiln_be_free(be, &w), kiln_be_free(be, &bias), kiln_be_free(be, &y);
    kiln_be_free(be, &yl), kiln_be_free(be, &w3), kiln_be_free(be, &y3);
    kiln_be_free(be, &r), kiln_be_free(be, &yr);
}

static void test_elementwise_and_movement(void)
{
    kiln_tensor a, g, x, s, d;
    tensor(&a, 3, (int64_t[]){2, 1, 2}, (float[]){1, 2, 3, 4});
    tensor(&g, 2, (int64_t[]){2, 2}, (float[]){1, 0, 2, -1});
    tensor(&x, 3, (int64_t[]){2, 1, 2}, (float[]){10, 10, 10, 10});
    kiln_be_gated_add(be, &x, &g, &a);
    float *xv = x.data;
    CHECK(xv[0] == 11 && xv[1] == 10 && xv[2] == 16 && xv[3] == 6);
    kiln_be_euler_step(be, &x, &a, -0.5f);
    CHECK(xv[0] == 10.5f && xv[3] == 4);
    kiln_be_cfg(be, &x, &a, &g, 4.0f); /* neg + 4 (pos - neg) */
    CHECK(xv[0] == 1 + 4 * (1 - 1) && xv[1] == 0 + 4 * 2 && xv[3] == -1 + 4 * 5);
    tensor(&s, 2, (int64_t[]){1, 4}, (float[]){-1, 0, 1, 2});
    tensor(&d, 2, (int64_t[]){1, 2}, NULL);
    kiln_be_swiglu(be, &d, &s); /* silu(-1) * 1, silu(0) * 2 */
    CHECK_NEAR(((float *)d.data)[0], -1 / (1 + exp(1.0)), 1e-6);
    CHECK(((float *)d.data)[1] == 0);
    kiln_be_tanh(be, &s, &s); /* in place */
    CHECK_NEAR(((float *)s.data)[0], tanh(-1.0), 1e-6);
    CHECK(((float *)s.data)[1] == 0);
    CHECK_NEAR(((float *)s.data)[3], tanh(2.0), 1e-6);
    kiln_tensor src, dst;
    tensor(&src, 3, (int64_t[]){2, 3, 1}, (float[]){0, 1, 2, 3, 4, 5});
    tensor(&dst, 3, (int64_t[]){2, 2, 1}, NULL);
    kiln_be_copy_rows(be, &dst, 0, &src, 1, 2);
    float *dv = dst.data;
    CHECK(dv[0] == 1 && dv[1] == 2 && dv[2] == 4 && dv[3] == 5);
    kiln_tensor cs, cd;
    tensor(&cs, 2, (int64_t[]){2, 3}, (float[]){0, 1, 2, 3, 4, 5});
    tensor(&cd, 2, (int64_t[]){2, 2}, NULL);
    kiln_be_copy_cols(be, &cd, 1, &cs, 2, 1);
    CHECK(((float *)cd.data)[1] == 2 && ((float *)cd.data)[3] == 5);
    kiln_tensor up, upx;
    /* Channels last: pixels (7, 8) and (9, 10) of one row, each repeated
     * 2 x 2 with its channels together. */
    tensor(&upx, 4, (int64_t[]){1, 1, 2, 2}, (float[]){7, 8, 9, 10});
    tensor(&up, 4, (int64_t[]){1, 2, 4, 2}, NULL);
    kiln_be_upsample_nearest2x(be, &up, &upx);
    float *uv = up.data;
    CHECK(uv[0] == 7 && uv[1] == 8 && uv[2] == 7 && uv[3] == 8 && uv[4] == 9 && uv[7] == 10 &&
          uv[8] == 7 && uv[15] == 10);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    kiln_be_free(be, &a), kiln_be_free(be, &g), kiln_be_free(be, &x), kiln_be_free(be, &s);
    kiln_be_free(be, &d), kiln_be_free(be, &src), kiln_be_free(be, &dst);
    kiln_be_free(be, &cs), kiln_be_free(be, &cd), kiln_be_free(be, &up), kiln_be_free(be, &upx);
}

/* to_rgb8 gives kiln_latents_to_rgb8's bytes (the host conversion the
 * decode stage used before) in the interleaved layout, in fp32 and bf16
 * (every bf16 value); download_bytes hands the bytes back as they are. */
static void test_to_rgb8(void)
{
    enum { B = 2, H = 3, W = 5, N = B * 3 * H * W };
    float v[N];
    uint32_t seed = 7;
    for (int i = 0; i < N; i++)
        v[i] = 1.2f * lcg_val(&seed);
    /* clamps, NaN -> 0, infinities, and exact halves (64.5 -> 64, 65.5 -> 66) */
    const float edge[] = {-3.0f, 3.0f, NAN, INFINITY, -INFINITY, -0.494117618f, -0.486274481f};
    memcpy(v + 11, edge, sizeof edge);
    kiln_tensor x, rgb;
    tensor(&x, 4, (int64_t[]){B, 3, H, W}, v);
    kiln_be_alloc(be, &rgb, KILN_U8, 4, (int64_t[]){B, H, W, 3});
    kiln_be_to_rgb8(be, &rgb, &x);
    uint8_t want[N], got[N];
    kiln_latents_to_rgb8(v, want, B, H, W, KILN_F32);
    memset(got, 0, sizeof got);
    kiln_be_download_bytes(be, &rgb, got);
    CHECK(kiln_be_check(be, NULL) == KILN_OK && !memcmp(got, want, N) &&
          !memcmp(rgb.data, want, N));
    /* Pixel (y 0, x 1) of image 1 holds its three planes' values. */
    int64_t p = 1 * 3 * H * W + 1;
    uint8_t px[3];
    kiln_latents_to_rgb8((float[]){v[p], v[p + H * W], v[p + 2 * H * W]}, px, 1, 1, 1,
                         KILN_F32);
    CHECK(!memcmp(got + (1 * H * W + 1) * 3, px, 3));
    /* v[11..14]: red of pixels 11..14; v[15..17]: green of pixels 0..2. */
    CHECK(got[33] == 0 && got[36] == 255 && got[39] == 0 && got[42] == 255);
    CHECK(got[1] == 0 && got[4] == 64 && got[7] == 66);
    kiln_be_free(be, &x), kiln_be_free(be, &rgb);

    /* bf16: every bit pattern, rounded as the bf16 pipeline rounds. */
    enum { BH = 128, BW = 171, BN = 3 * BH * BW };
    uint16_t *hb = malloc(BN * sizeof *hb);
    float *hf = malloc(BN * sizeof *hf);
    uint8_t *w8 = malloc(BN), *f8 = malloc(BN);
    CHECK(hb && hf && w8 && f8);
    if (hb && hf && w8 && f8) {
        for (int i = 0; i < BN; i++) {
            hb[i] = (uint16_t)(i * 40503u); /* a permutation of the 65536 patterns, repeating */
            hf[i] = kiln_bf16_to_f32(hb[i]);
        }
        kiln_be_alloc(be, &x, KILN_BF16, 4, (int64_t[]){1, 3, BH, BW});
        kiln_be_upload(be, &x, hb, KILN_BF16);
        kiln_be_alloc(be, &rgb, KILN_U8, 4, (int64_t[]){1, BH, BW, 3});
        kiln_be_to_rgb8(be, &rgb, &x);
        kiln_latents_to_rgb8(hf, w8, 1, BH, BW, KILN_BF16);
        kiln_latents_to_rgb8(hf, f8, 1, BH, BW, KILN_F32);
        CHECK(kiln_be_check(be, NULL) == KILN_OK && !memcmp(rgb.data, w8, BN));
        CHECK(memcmp(w8, f8, BN) != 0); /* the dtype matters: bf16 rounds (x / 2 + 0.5) */
        kiln_be_free(be, &x), kiln_be_free(be, &rgb);
    }
    free(hb), free(hf), free(w8), free(f8);

    /* A caller bug (planes not 3, or an output of the wrong shape). */
    tensor(&x, 4, (int64_t[]){1, 4, 2, 2}, NULL);
    kiln_be_alloc(be, &rgb, KILN_U8, 4, (int64_t[]){1, 2, 2, 3});
    kiln_be_to_rgb8(be, &rgb, &x);
    kiln_err err = {0};
    CHECK(kiln_be_check(be, &err) == KILN_ERR_INTERNAL && strstr(err.msg, "to_rgb8"));
    kiln_be_free(be, &x), kiln_be_free(be, &rgb);
}

static void test_arena_reuse(void)
{
    kiln_err err = {0};
    kiln_arena *a = kiln_arena_create(be, 0, &err);
    CHECK(a != NULL);
    kiln_tensor t;
    for (int i = 0; i < 40; i++)
        CHECK(kiln_arena_tensor(a, &t, KILN_F32, 1, (int64_t[]){100000}) == KILN_OK);
    kiln_arena_reset(a);
    size_t cap = kiln_arena_capacity(a);
    CHECK(cap >= 40 * 400000);
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < 40; i++)
            kiln_arena_tensor(a, &t, KILN_F32, 1, (int64_t[]){100000});
        kiln_arena_reset(a);
        CHECK(kiln_arena_capacity(a) == cap); /* steady state: no new blocks */
    }
    kiln_arena_destroy(a);
}

/* reserve makes one block (kept when big enough, replaced otherwise);
 * rewind hands the same memory out again; after growth it releases nothing. */
static void test_arena_reserve_rewind(void)
{
    kiln_err err = {0};
    kiln_arena *a = kiln_arena_create(be, 0, &err);
    CHECK(a && kiln_arena_reserve(a, 3u << 20) == KILN_OK);
    CHECK(kiln_arena_capacity(a) == 3u << 20);
    uint64_t ep = kiln_arena_epoch(a);
    CHECK(kiln_arena_reserve(a, 1u << 20) == KILN_OK && kiln_arena_capacity(a) == 3u << 20 &&
          kiln_arena_epoch(a) == ep);
    kiln_tensor t, u, v;
    kiln_arena_tensor(a, &t, KILN_F32, 1, (int64_t[]){1000});
    size_t m = kiln_arena_mark(a);
    kiln_arena_tensor(a, &u, KILN_F32, 1, (int64_t[]){1000});
    kiln_arena_rewind(a, m);
    kiln_arena_tensor(a, &v, KILN_F32, 1, (int64_t[]){1000});
    CHECK(u.data == v.data && t.data != u.data);
    CHECK(kiln_arena_reserve(a, 1u << 20) == KILN_ERR_INTERNAL); /* tensors handed out */
    CHECK(kiln_be_check(be, NULL) == KILN_ERR_INTERNAL);
    /* Growth since the mark: the rewind releases nothing. */
    m = kiln_arena_mark(a);
    kiln_arena_tensor(a, &t, KILN_F32, 1, (int64_t[]){1000});
    kiln_arena_tensor(a, &u, KILN_F32, 1, (int64_t[]){1 << 20});
    kiln_arena_rewind(a, m);
    kiln_arena_tensor(a, &v, KILN_F32, 1, (int64_t[]){1000});
    CHECK(t.data != v.data && (char *)v.data >= (char *)u.data + (4 << 20));
    kiln_arena_reset(a);
    CHECK(kiln_arena_reserve(a, 8u << 20) == KILN_OK && kiln_arena_capacity(a) == 8u << 20 &&
          kiln_arena_epoch(a) != ep);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    kiln_arena_destroy(a);
}

/* A lost backend (its device unusable, kiln_be_lose) fails every op and
 * every check from then on, whatever error came first; an ordinary error
 * clears when checked. */
static void test_lost(void)
{
    kiln_err err = {0};
    kiln_backend *b = kiln_backend_create("cpu", 0, &err);
    if (!b)
        return;
    kiln_tensor x, y;
    CHECK(kiln_be_alloc(b, &x, KILN_F32, 1, (int64_t[]){4}) == KILN_OK);
    CHECK(kiln_be_alloc(b, &y, KILN_F32, 1, (int64_t[]){4}) == KILN_OK);
    kiln_be_fail(b, KILN_ERR_INTERNAL, "an ordinary error");
    CHECK(!kiln_be_lost(b));
    kiln_be_lose(b, "cuda: %s", "an illegal address");
    CHECK(kiln_be_lost(b));
    for (int i = 0; i < 3; i++) {
        CHECK(kiln_be_check(b, &err) == KILN_ERR_DEVICE &&
              !strcmp(err.msg, "device lost: cuda: an illegal address"));
        ((float *)y.data)[0] = 5;
        kiln_be_silu(b, &y, &x); /* a no-op now */
        CHECK(((float *)y.data)[0] == 5);
    }
    kiln_tensor z;
    CHECK(kiln_be_alloc(b, &z, KILN_F32, 1, (int64_t[]){4}) == KILN_ERR_DEVICE && !z.data);
    kiln_be_free(b, &x), kiln_be_free(b, &y);
    kiln_backend_destroy(b);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    CHECK(kiln_backend_create("tpu", 0, &err) == NULL && err.code == KILN_ERR_INVALID);
    RUN(test_linear);
    RUN(test_attention_masks);
    RUN(test_rope_modes);
    RUN(test_norms);
    RUN(test_group_norm_bands);
    RUN(test_conv_matches_linear);
    RUN(test_elementwise_and_movement);
    RUN(test_to_rgb8);
    RUN(test_arena_reuse);
    RUN(test_arena_reserve_rewind);
    RUN(test_lost);
    kiln_backend_destroy(be);
    return test_finish();
}
