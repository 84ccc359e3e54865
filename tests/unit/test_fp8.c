/* The FP8 mode's reference (common/fp8.h and the CPU backend's
 * quantize_fp8 and F8E4M3 linear, kernels/backend.h): E4M3 rounding against
 * an independent implementation's codes, rounding to the nearest grid value
 * by brute force, the per-tensor scale, and the linear against a direct
 * double-precision computation on the quantised values. */
#include <string.h>

#include "common/fp8.h"
#include "kernels/backend.h"
#include "tests/test.h"

static kiln_backend *be;

/* Codes of float8_e4m3fn (the type torch.float8_e4m3fn implements, same
 * rounding) for a handful of fp32 values, produced with ml_dtypes 0.7.0:
 *   np.array([v], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
 * They cover ties to even (1.0625, 1.1875, 432, 3 * 2^-10, 5 * 2^-10),
 * subnormals, the rounding into the smallest normal (15 * 2^-10), values
 * above 448 that still round to it, and underflow to a signed zero. */
static const struct {
    float v;
    uint8_t code;
} known[] = {
    {0.0f, 0x00},      {-0.0f, 0x80},        {1.0f, 0x38},          {-1.0f, 0xb8},
    {448.0f, 0x7e},    {-448.0f, 0xfe},      {449.0f, 0x7e},        {460.0f, 0x7e},
    {0.1f, 0x1d},      {0.3f, 0x2a},         {1.0f / 3.0f, 0x2b},   {-3.3f, 0xc5},
    {17.5f, 0x59},     {0x1p-9f, 0x01},      {0x1p-10f, 0x00},      {0x3p-10f, 0x02},
    {0x5p-10f, 0x02},  {0x1p-6f, 0x08},      {0xfp-10f, 0x08},      {1.0625f, 0x38},
    {1.1875f, 0x3a},   {240.0f, 0x77},       {250.0f, 0x78},        {300.0f, 0x79},
    {0.01f, 0x05},     {-0.0002f, 0x80},     {1e-30f, 0x00},        {100.0f, 0x6c},
    {0.875f, 0x36},    {0.9375f, 0x37},      {416.0f, 0x7d},        {432.0f, 0x7e},
};

static void test_known_codes(void)
{
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        uint8_t c = kiln_f32_to_e4m3(known[i].v);
        CHECKF(c == known[i].code, "%.9g -> 0x%02x, expected 0x%02x", (double)known[i].v, c,
               known[i].code);
    }
    /* Past the table: saturation (kiln's choice, as CUDA's __NV_SATFINITE)
     * and NaN. */
    CHECK(kiln_f32_to_e4m3(1e9f) == 0x7e && kiln_f32_to_e4m3(-INFINITY) == 0xfe);
    CHECK((kiln_f32_to_e4m3(NAN) & 0x7f) == 0x7f);
    CHECK(kiln_e4m3_to_f32(0x7e) == 448.0f && kiln_e4m3_to_f32(0x01) == 0x1p-9f);
    CHECK(kiln_e4m3_to_f32(0x08) == 0x1p-6f && kiln_e4m3_to_f32(0xb8) == -1.0f);
    CHECK(isnan(kiln_e4m3_to_f32(0x7f)) && isnan(kiln_e4m3_to_f32(0xff)));
}

/* Every code decodes and encodes back to itself, and any value within
 * +-448 goes to the nearest of the 253 finite magnitudes' grid (ties to the
 * even code), found here by brute force. */
static void test_nearest(void)
{
    int bad = 0;
    for (int c = 0; c < 256; c++) {
        float v = kiln_e4m3_to_f32((uint8_t)c);
        if ((c & 0x7f) != 0x7f)
            bad += kiln_f32_to_e4m3(v) != c;
    }
    CHECKF(bad == 0, "%d codes do not round trip", bad);
    uint32_t s = 12345;
    bad = 0;
    for (int i = 0; i < 200000; i++) {
        s = s * 1664525u + 1013904223u;
        /* magnitudes from 2^-12 to 448, both signs */
        float mag = ldexpf(1.0f + (float)(s >> 9) / 8388608.0f, (int)(s % 21) - 12);
        float v = (s & 1) ? -fminf(mag, 448.0f) : fminf(mag, 448.0f);
        if (i % 1000 == 0) /* exact midpoints between neighbours too */
            v = (kiln_e4m3_to_f32((uint8_t)(i / 1000 % 126)) +
                 kiln_e4m3_to_f32((uint8_t)(i / 1000 % 126 + 1))) / 2;
        int best = -1;
        double bd = INFINITY;
        for (int c = 0; c < 0x7f; c++) {
            double d = fabs((double)fabsf(v) - kiln_e4m3_to_f32((uint8_t)c));
            if (d < bd || (d == bd && !(c & 1)))
                bd = d, best = c;
        }
        uint8_t want = (uint8_t)(best | (signbit(v) ? 0x80 : 0));
        bad += kiln_f32_to_e4m3(v) != want;
    }
    CHECKF(bad == 0, "%d values not rounded to the nearest (ties to even)", bad);
}

static void fill(float *p, int64_t n, uint32_t seed, float amp)
{
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = amp * ((float)((seed >> 8) & 0xffff) / 32768.0f - 1.0f);
    }
}

static void test_quantize(void)
{
    kiln_tensor x, q;
    kiln_be_alloc(be, &x, KILN_F32, 2, (int64_t[]){3, 7});
    kiln_be_alloc(be, &q, KILN_F8E4M3, 2, (int64_t[]){3, 7});
    CHECK(kiln_tensor_nbytes(&q) == 32 + 16); /* 21 codes padded to 32, then the scale */
    float *xs = x.data;
    fill(xs, 21, 7, 3.0f);
    xs[5] = -5.5f; /* the amax */
    xs[6] = NAN;   /* not counted */
    kiln_be_quantize_fp8(be, &q, &x);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    float s = kiln_f8_scale(&q);
    CHECK(s == 5.5f / 448.0f);
    const uint8_t *codes = q.data;
    int bad = 0;
    for (int i = 0; i < 21; i++)
        bad += codes[i] != kiln_f32_to_e4m3(xs[i] / s);
    CHECK(bad == 0 && codes[5] == 0xfe);
    float back[21];
    kiln_be_download(be, &q, back);
    CHECK(back[5] == -5.5f && back[0] == kiln_e4m3_to_f32(codes[0]) * s);
    /* All zeros: scale 1, zero codes. */
    memset(xs, 0, 21 * sizeof *xs);
    kiln_be_quantize_fp8(be, &q, &x);
    CHECK(kiln_f8_scale(&q) == 1.0f && codes[0] == 0 && codes[20] == 0);
    /* The name is kiln's own: no file or message may claim F8_E4M3. */
    kiln_dtype dt;
    CHECK(kiln_dtype_parse("F8_E4M3", &dt) == -1);
    kiln_be_free(be, &x), kiln_be_free(be, &q);
}

/* y = x8 . w8^T * sx * sw + bias, each batch entry with its own sx,
 * computed in double from the quantised values. */
static void test_linear(void)
{
    const int64_t B = 2, S = 5, K = 48, N = 32;
    kiln_tensor x, w, w8, bias, y, yx, one, y1;
    kiln_be_alloc(be, &x, KILN_F32, 3, (int64_t[]){B, S, K});
    kiln_be_alloc(be, &w, KILN_F32, 2, (int64_t[]){N, K});
    kiln_be_alloc(be, &w8, KILN_F8E4M3, 2, (int64_t[]){N, K});
    kiln_be_alloc(be, &bias, KILN_F32, 1, (int64_t[]){N});
    kiln_be_alloc(be, &y, KILN_F32, 3, (int64_t[]){B, S, N});
    kiln_be_alloc(be, &yx, KILN_F32, 3, (int64_t[]){B, S, N});
    fill(x.data, B * S * K, 3, 2.0f);
    for (int64_t i = 0; i < S * K; i++) /* entry 1 ten times larger: its own scale */
        ((float *)x.data)[S * K + i] *= 10;
    fill(w.data, N * K, 5, 0.05f);
    fill(bias.data, N, 9, 1.0f);
    kiln_be_quantize_fp8(be, &w8, &w);
    kiln_be_linear(be, &y, &x, &w8, &bias);
    kiln_be_linear(be, &yx, &x, &w, &bias);
    CHECK(kiln_be_check(be, NULL) == KILN_OK);
    const float *xs = x.data, *ws = w.data, *bs = bias.data, *ys = y.data, *yxs = yx.data;
    double worst = 0, dq = 0, dn = 0;
    float wamax = 0;
    for (int64_t i = 0; i < N * K; i++)
        wamax = fmaxf(wamax, fabsf(ws[i]));
    double sw = kiln_f8_scale_of(wamax);
    CHECK((float)sw == kiln_f8_scale(&w8));
    for (int64_t b = 0; b < B; b++) {
        float amax = 0;
        for (int64_t i = 0; i < S * K; i++)
            amax = fmaxf(amax, fabsf(xs[b * S * K + i]));
        float sx = kiln_f8_scale_of(amax);
        for (int64_t r = 0; r < S; r++)
            for (int64_t j = 0; j < N; j++) {
                double acc = 0;
                for (int64_t k = 0; k < K; k++)
                    acc += (double)kiln_e4m3_to_f32(kiln_f32_to_e4m3(xs[(b * S + r) * K + k] / sx)) *
                           kiln_e4m3_to_f32(kiln_f32_to_e4m3(ws[j * K + k] / (float)sw));
                double want = acc * sx * sw + bs[j];
                int64_t o = (b * S + r) * N + j;
                worst = fmax(worst, fabs(ys[o] - want) / (fabs(want) + 1e-3));
                dq += (ys[o] - yxs[o]) * (ys[o] - yxs[o]);
                dn += (double)yxs[o] * yxs[o];
            }
    }
    /* fp32 sums of 48 products against double: a few ulps. */
    CHECKF(worst < 1e-5, "fp8 linear vs the direct computation: rel err %.3g", worst);
    /* Against the unquantised layer: changed, by about E4M3's relative
     * step (2^-4) over random signs, not more. */
    double rel = sqrt(dq / dn);
    CHECKF(rel > 1e-4 && rel < 0.06, "fp8 vs fp32 linear: rel err %.3g", rel);
    /* Batch entry 1 alone: the same bits (its scale is its own). */
    kiln_be_alloc(be, &one, KILN_F32, 3, (int64_t[]){1, S, K});
    kiln_be_alloc(be, &y1, KILN_F32, 3, (int64_t[]){1, S, N});
    memcpy(one.data, xs + S * K, (size_t)(S * K) * sizeof(float));
    kiln_be_linear(be, &y1, &one, &w8, &bias);
    CHECK(!memcmp(y1.data, ys + S * N, (size_t)(S * N) * sizeof(float)));
    /* A weight whose shape cuBLASLt's FP8 GEMMs cannot take is refused on
     * every backend (N not a multiple of 16). */
    kiln_tensor w8s, ys8;
    kiln_be_alloc(be, &w8s, KILN_F8E4M3, 2, (int64_t[]){8, K});
    kiln_be_alloc(be, &ys8, KILN_F32, 3, (int64_t[]){B, S, 8});
    kiln_be_linear(be, &ys8, &x, &w8s, NULL);
    kiln_err err = {0};
    CHECK(kiln_be_check(be, &err) == KILN_ERR_INTERNAL && strstr(err.msg, "kiln_f8_linear_ok"));
    kiln_tensor *all[] = {&x, &w, &w8, &bias, &y, &yx, &one, &y1, &w8s, &ys8};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kiln_be_free(be, all[i]);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    RUN(test_known_codes);
    RUN(test_nearest);
    RUN(test_quantize);
    RUN(test_linear);
    kiln_backend_destroy(be);
    return test_finish();
}
