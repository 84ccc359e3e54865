/* torch.randn on a CPU generator, bit for bit (shared/spec/pipeline.md §3).
 *
 * Every floating-point operation here is meant to be rounded exactly where
 * torch rounds it: the multiply-adds that torch's AVX2 build fuses are written
 * as fmaf(), and this file is compiled with -ffp-contract=off (models/meson.build)
 * so the compiler never fuses anything else. */
#include "models/rng.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MT_N 624
#define MT_M 397

struct kiln_rng {
    uint32_t mt[MT_N];
    int next; /* index of the next tempered word; MT_N = twist first */
    /* torch's normal_distribution<double> (used for n < 16) makes two values
     * per pair of uniforms and keeps the second in the generator. */
    int has_cached;
    double cached;
};

void kiln_rng_seed(kiln_rng *g, uint64_t seed)
{
    /* at::mt19937 keeps only the low 32 bits of the seed. */
    g->mt[0] = (uint32_t)seed;
    for (uint32_t i = 1; i < MT_N; i++) {
        uint32_t prev = g->mt[i - 1];
        g->mt[i] = 1812433253u * (prev ^ (prev >> 30)) + i;
    }
    g->next = MT_N;
    g->has_cached = 0;
    g->cached = 0.0;
}

kiln_rng *kiln_rng_create(uint64_t seed, kiln_err *err)
{
    kiln_rng *g = malloc(sizeof(*g));
    if (!g) {
        kiln_err_set(err, KILN_ERR_NOMEM, "rng: out of memory");
        return NULL;
    }
    kiln_rng_seed(g, seed);
    return g;
}

void kiln_rng_destroy(kiln_rng *g) { free(g); }

static uint32_t mt_mix(uint32_t upper, uint32_t lower, uint32_t far)
{
    uint32_t y = (upper & 0x80000000u) | (lower & 0x7fffffffu);
    return far ^ (y >> 1) ^ (-(y & 1u) & 0x9908b0dfu); /* branch-free, so it vectorises */
}

static void mt_twist(kiln_rng *g)
{
    uint32_t *s = g->mt;
    int i = 0;
    for (; i < MT_N - MT_M; i++)
        s[i] = mt_mix(s[i], s[i + 1], s[i + MT_M]);
    for (; i < MT_N - 1; i++)
        s[i] = mt_mix(s[i], s[i + 1], s[i + MT_M - MT_N]);
    s[MT_N - 1] = mt_mix(s[MT_N - 1], s[0], s[MT_M - 1]);
    g->next = 0;
}

static uint32_t mt_temper(uint32_t y)
{
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

uint32_t kiln_rng_u32(kiln_rng *g)
{
    if (g->next >= MT_N)
        mt_twist(g);
    return mt_temper(g->mt[g->next++]);
}

/* ---- n >= 16: blocks of 16 (ATen normal_fill / normal_fill_AVX2) ---- */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* log of x in (0, 1] as torch's AVX2 kernel computes it (avx_mathfun's
 * log256_ps, Cephes coefficients), with the multiply-adds its compiled form
 * fuses. */
static float avx2_log(float x)
{
    uint32_t bits = f32_bits(x);
    float e = (float)((int32_t)(bits >> 23) - 127) + 1.0f;
    float m = bits_f32((bits & ~0x7f800000u) | f32_bits(0.5f)); /* m in [0.5, 1) */
    float t;
    if (m < 0.707106781186547524f) {
        e = e - 1.0f;
        t = (m - 1.0f) + m;
    } else {
        t = m - 1.0f;
    }
    float z = t * t;
    float y = 7.0376836292e-2f;
    static const float coef[] = {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f,
                                 1.4249322787e-1f,  -1.6668057665e-1f, 2.0000714765e-1f,
                                 -2.4999993993e-1f, 3.3333331174e-1f};
    for (size_t i = 0; i < sizeof(coef) / sizeof(coef[0]); i++)
        y = fmaf(y, t, coef[i]);
    y = y * t;
    float eq1 = e * -2.12194440e-4f; /* rounded on its own before the fma */
    y = fmaf(y, z, eq1);
    y = fmaf(z, -0.5f, y);
    t = t + y;
    return fmaf(e, 0.693359375f, t);
}

/* sin and cos of th >= 0 as avx_mathfun's sincos256_ps, FMA-fused. */
static void avx2_sincos(float th, float *s_out, float *c_out)
{
    int32_t j = (int32_t)(th * 1.27323954473516f); /* truncation, as cvttps */
    j = (j + 1) & ~1;
    float y = (float)j;
    float x = fmaf(y, -0.78515625f, th);
    x = fmaf(y, -2.4187564849853515625e-4f, x);
    x = fmaf(y, -3.77489497744594108e-8f, x);
    float z = x * x;

    float c = fmaf(fmaf(2.443315711809948e-5f, z, -1.388731625493765e-3f), z,
                   4.166664568298827e-2f);
    c = c * z;
    float half_z = z * 0.5f;
    c = fmaf(c, z, -half_z);
    c = c + 1.0f;

    float s = fmaf(fmaf(-1.9515295891e-4f, z, 8.3321608736e-3f), z, -1.6666654611e-1f);
    s = s * z;
    s = fmaf(s, x, x);

    float sin_v = (j & 2) ? c : s;
    float cos_v = (j & 2) ? s : c;
    uint32_t sin_flip = (j & 4) ? 0x80000000u : 0u;
    uint32_t cos_flip = ((j - 2) & 4) ? 0u : 0x80000000u;
    *s_out = bits_f32(f32_bits(sin_v) ^ sin_flip);
    *c_out = bits_f32(f32_bits(cos_v) ^ cos_flip);
}

/* torch stores `value * std + mean` with std 1 and mean 0; the only effect of
 * that is turning -0 (from r = sqrt(-0) when u1 = 1) into +0. */
static float affine_std1_mean0(float v) { return v + 0.0f; }

static void box_muller16_f32(float *d)
{
    const float two_pi = (float)(2.0 * 3.14159265358979323846);
    for (int j = 0; j < 8; j++) {
        float u1 = 1.0f - d[j];
        float u2 = d[j + 8];
        float r = sqrtf(-2.0f * avx2_log(u1));
        float s, c;
        avx2_sincos(two_pi * u2, &s, &c);
        d[j] = affine_std1_mean0(r * c);
        d[j + 8] = affine_std1_mean0(r * s);
    }
}

/* c10::BFloat16 arithmetic: every operation in float, rounded to bf16; the
 * math functions are glibc's float versions. */
static void box_muller16_bf16(float *d)
{
    for (int j = 0; j < 8; j++) {
        float u1 = kiln_round_bf16(1.0f - d[j]);
        float u2 = d[j + 8];
        float l = kiln_round_bf16(logf(u1));
        float r = kiln_round_bf16(sqrtf(kiln_round_bf16(-2.0f * l)));
        /* 2.0f * c10::pi<double> * u2 is a double; it reaches bf16 through float. */
        float th = kiln_round_bf16((float)(2.0 * 3.14159265358979323846 * (double)u2));
        float c = kiln_round_bf16(cosf(th));
        float s = kiln_round_bf16(sinf(th));
        d[j] = kiln_round_bf16(affine_std1_mean0(kiln_round_bf16(r * c)));
        d[j + 8] = kiln_round_bf16(affine_std1_mean0(kiln_round_bf16(r * s)));
    }
}

/* Uniforms in [0, 1) with `bits` significant bits, one draw each
 * (at::uniform_real_distribution<float or BFloat16>).  The words are taken
 * a state at a time, so that the tempering and conversion run as one
 * branch-free loop the compiler vectorises (a 1024x1024 latent's 524,288
 * draws were a third of its noise time through kiln_rng_u32). */
static void fill_uniform(kiln_rng *g, float *d, size_t n, int bits)
{
    uint32_t mask = (1u << bits) - 1u;
    float scale = ldexpf(1.0f, -bits);
    for (size_t i = 0; i < n;) {
        if (g->next >= MT_N)
            mt_twist(g);
        size_t take = (size_t)(MT_N - g->next) < n - i ? (size_t)(MT_N - g->next) : n - i;
        const uint32_t *w = g->mt + g->next;
        for (size_t k = 0; k < take; k++)
            d[i + k] = (float)(mt_temper(w[k]) & mask) * scale;
        g->next += (int)take;
        i += take;
    }
}

static void randn_blocks(kiln_rng *g, float *out, size_t n, int bf16)
{
    void (*block)(float *) = bf16 ? box_muller16_bf16 : box_muller16_f32;
    int bits = bf16 ? 8 : 24;
    fill_uniform(g, out, n, bits);
    /* Only the uniforms come from the sequential generator; each block of
     * 16 is then transformed on its own, so threads change no value.  A
     * 1024x1024 latent is 32,768 blocks, ~7 ms on one core (the 2-core
     * development machine; its uniforms take 0.27 ms). */
    const long blocks = (long)(n / 16);
#pragma omp parallel for schedule(static) if (blocks >= 1024)
    for (long k = 0; k < blocks; k++)
        block(out + 16 * (size_t)k);
    if (n % 16) {
        /* torch redraws the whole last block of 16, overlapping the values
         * already produced, rather than handling a short block. */
        fill_uniform(g, out + n - 16, 16, bits);
        block(out + n - 16);
    }
}

/* ---- n < 16: at::normal_distribution<double>, one element at a time ---- */

/* at::uniform_real_distribution<double>: 53 bits of random64(), which puts
 * the first 32-bit draw in the high word. */
static double uniform53(kiln_rng *g)
{
    uint64_t hi = kiln_rng_u32(g);
    uint64_t lo = kiln_rng_u32(g);
    uint64_t v = ((hi << 32) | lo) & ((UINT64_C(1) << 53) - 1);
    return (double)v * 0x1p-53;
}

static double normal_double(kiln_rng *g)
{
    if (g->has_cached) {
        g->has_cached = 0;
        return g->cached * 1.0 + 0.0;
    }
    double u1 = uniform53(g);
    double u2 = uniform53(g);
    double r = sqrt(-2.0 * log1p(-u2));
    double theta = 2.0 * 3.14159265358979323846 * u1;
    g->cached = r * sin(theta);
    g->has_cached = 1;
    return r * cos(theta) * 1.0 + 0.0;
}

static void randn_scalar(kiln_rng *g, float *out, size_t n, int bf16)
{
    for (size_t i = 0; i < n; i++) {
        /* static_cast<scalar_t>(double): via float, then (bf16) to bf16. */
        float v = (float)normal_double(g);
        out[i] = bf16 ? kiln_round_bf16(v) : v;
    }
}

kiln_status kiln_randn(kiln_rng *g, float *out, size_t n, kiln_dtype dt, kiln_err *err)
{
    if (dt != KILN_F32 && dt != KILN_BF16)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "randn: dtype %s is not supported",
                            kiln_dtype_name(dt) ? kiln_dtype_name(dt) : "(invalid)");
    if (n == 0)
        return KILN_OK;
    if (!out)
        return kiln_err_set(err, KILN_ERR_INVALID, "randn: no output buffer for %zu values", n);
    int bf16 = dt == KILN_BF16;
    if (n >= 16)
        randn_blocks(g, out, n, bf16);
    else
        randn_scalar(g, out, n, bf16);
    return KILN_OK;
}
