/* torch.randn parity: every vector of shared/oracle/rng_vectors.safetensors and
 * the noise of every oracle case, bit for bit. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/safetensors.h"
#include "models/rng.h"
#include "tests/oracle/oracle_check.h"
#include "tests/test.h"

/* Counts values of `got` whose bits differ from the stored tensor (F32 or
 * BF16); prints the first mismatch. */
static size_t count_mismatch(const char *what, const float *got, const kiln_st_tensor *ref,
                             size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float want = oracle_value(ref, i);
        if (oracle_bits(got[i]) != oracle_bits(want)) {
            if (!bad)
                fprintf(stderr, "%s[%zu]: got %.9g (0x%08x), want %.9g (0x%08x)\n", what, i,
                        (double)got[i], oracle_bits(got[i]), (double)want, oracle_bits(want));
            bad++;
        }
    }
    return bad;
}

static kiln_st *open_vectors(void)
{
    kiln_err err = {0};
    kiln_st *st = kiln_st_open(oracle_path("rng_vectors.safetensors"), "rng_vectors", &err);
    CHECKF(st != NULL, "%s", err.msg);
    return st;
}

static float *draw(uint64_t seed, size_t n, kiln_dtype dt)
{
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(seed, &err);
    float *out = malloc((n ? n : 1) * sizeof(float));
    if (!g || !out || kiln_randn(g, out, n, dt, &err)) {
        fprintf(stderr, "draw failed: %s\n", err.msg);
        free(out);
        out = NULL;
    }
    kiln_rng_destroy(g);
    return out;
}

/* std::mt19937 with its default seed 5489: the C++ standard's check value. */
static void test_mt19937_known_answer(void)
{
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(5489, &err);
    CHECK(g != NULL);
    if (!g)
        return;
    uint32_t first = kiln_rng_u32(g), last = first;
    for (int i = 1; i < 10000; i++)
        last = kiln_rng_u32(g);
    CHECK(first == 3499211612u);
    CHECK(last == 4123659995u);
    /* Only the low 32 bits of the seed count. */
    kiln_rng_seed(g, ((uint64_t)7 << 32) | 5489u);
    CHECK(kiln_rng_u32(g) == 3499211612u);
    kiln_rng_destroy(g);
}

static void test_rng_vectors(void)
{
    kiln_st *st = open_vectors();
    if (!st)
        return;
    int vectors = 0, short_vectors = 0, bf16_vectors = 0;
    for (size_t i = 0; i < kiln_st_count(st); i++) {
        const kiln_st_tensor *t = kiln_st_at(st, i);
        /* "seed<S>.<shape>.<float32|bfloat16>"; the 1x128x64x64 summaries
         * are checked separately. */
        if (strstr(t->name, "1x128x64x64"))
            continue;
        uint64_t seed;
        char dtype[16];
        if (sscanf(t->name, "seed%" SCNu64 ".%*[0-9x].%15s", &seed, dtype) != 2) {
            CHECKF(0, "unexpected vector name %s", t->name);
            continue;
        }
        kiln_dtype dt = strcmp(dtype, "bfloat16") == 0 ? KILN_BF16 : KILN_F32;
        CHECKF(t->dtype == dt, "%s stored as %s", t->name, kiln_dtype_name(t->dtype));
        size_t n = t->nbytes / kiln_dtype_size(t->dtype);
        float *got = draw(seed, n, dt);
        CHECK(got != NULL);
        if (!got)
            continue;
        size_t bad = count_mismatch(t->name, got, t, n);
        CHECKF(bad == 0, "%s: %zu of %zu values differ", t->name, bad, n);
        free(got);
        vectors++;
        short_vectors += n < 16;
        bf16_vectors += dt == KILN_BF16;
    }
    /* 3 seeds x 10 shapes x 2 dtypes; 3 of the shapes have n < 16. */
    CHECKF(vectors == 60, "checked %d vectors", vectors);
    CHECK(short_vectors == 18);
    CHECK(bf16_vectors == 30);
    kiln_st_close(st);
}

/* The real klein 1024x1024 noise: (1, 128, 64, 64), seed 42. */
static void test_klein_1024_noise(void)
{
    kiln_st *st = open_vectors();
    if (!st)
        return;
    kiln_err err = {0};
    const size_t n = (size_t)128 * 64 * 64;
    static const struct { const char *name; kiln_dtype dt; } kinds[] = {
        {"float32", KILN_F32}, {"bfloat16", KILN_BF16}};
    for (size_t k = 0; k < 2; k++) {
        float *got = draw(42, n, kinds[k].dt);
        CHECK(got != NULL);
        if (!got)
            continue;
        char name[128];
        int64_t shape4096[] = {4096}, shape1[] = {1};
        snprintf(name, sizeof(name), "seed42.1x128x64x64.%s.head4096", kinds[k].name);
        const kiln_st_tensor *head = kiln_st_expect(st, name, 1, shape4096, &err);
        snprintf(name, sizeof(name), "seed42.1x128x64x64.%s.tail4096", kinds[k].name);
        const kiln_st_tensor *tail = kiln_st_expect(st, name, 1, shape4096, &err);
        snprintf(name, sizeof(name), "seed42.1x128x64x64.%s.sum_f64", kinds[k].name);
        const kiln_st_tensor *sum = kiln_st_expect(st, name, 1, shape1, &err);
        CHECKF(head && tail && sum, "%s", err.msg);
        if (head && tail && sum) {
            CHECK(count_mismatch("head", got, head, 4096) == 0);
            CHECK(count_mismatch("tail", got + n - 4096, tail, 4096) == 0);
            double want, have = 0;
            memcpy(&want, sum->data, sizeof(want));
            for (size_t i = 0; i < n; i++)
                have += got[i];
            /* Only the summation order may differ from torch's. */
            CHECK_NEAR(have, want, 1e-9 * n);
        }
        free(got);
    }
    kiln_st_close(st);
}

/* A second draw continues the stream: randn(16) twice = the two halves of
 * randn(32) (both are whole blocks, so no tail rule is involved). */
static void test_stream_continues(void)
{
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(1234567, &err);
    float a[32], b[32];
    CHECK(g != NULL);
    if (!g)
        return;
    CHECK(kiln_randn(g, a, 16, KILN_F32, &err) == KILN_OK);
    CHECK(kiln_randn(g, a + 16, 16, KILN_F32, &err) == KILN_OK);
    kiln_rng_seed(g, 1234567);
    CHECK(kiln_randn(g, b, 32, KILN_F32, &err) == KILN_OK);
    CHECK(memcmp(a, b, sizeof(a)) == 0);
    /* n < 16 draws pairs and keeps the second value in the generator (torch's
     * cached normal sample): randn(1) twice equals randn(2). */
    kiln_rng_seed(g, 1234567);
    CHECK(kiln_randn(g, a, 1, KILN_F32, &err) == KILN_OK);
    CHECK(kiln_randn(g, a + 1, 1, KILN_F32, &err) == KILN_OK);
    kiln_rng_seed(g, 1234567);
    CHECK(kiln_randn(g, b, 2, KILN_F32, &err) == KILN_OK);
    CHECK(memcmp(a, b, 2 * sizeof(float)) == 0 && a[0] != a[1]);
    kiln_rng_destroy(g);
}

static void test_bad_input(void)
{
    kiln_err err = {0};
    kiln_rng *g = kiln_rng_create(0, &err);
    float x[4];
    CHECK(g != NULL);
    if (!g)
        return;
    CHECK(kiln_randn(g, x, 4, KILN_I64, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(strstr(err.msg, "I64") != NULL);
    CHECK(kiln_randn(g, NULL, 4, KILN_F32, &err) == KILN_ERR_INVALID);
    CHECK(kiln_randn(g, NULL, 0, KILN_F32, &err) == KILN_OK);
    kiln_rng_destroy(g);
}

/* Every case's `noise` in every reference file: klein draws (B, 4C, h, w) as
 * one tensor in the pipeline dtype, Z-Image always in fp32. */
static void test_case_noise(void)
{
    static const char *cases[] = {"klein_t2i_256",      "klein_t2i_batch2",   "klein_edit_1ref",
                                  "klein_kv_edit_1ref", "klein_base_cfg_256", "zimage_t2i_256",
                                  "zimage_batch2_160x96"};
    static const char *files[] = {"ref_fp32.safetensors", "ref_bf16.safetensors"};
    int checked = 0;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        kiln_err err = {0};
        cJSON *meta = kiln_json_load(oracle_case_path(cases[c], "meta.json"), "meta.json", &err);
        int64_t seed = -1;
        CHECKF(meta && !kiln_json_int(meta, "seed", KILN_JSON_REQUIRED, &seed, &err), "%s: %s",
               cases[c], err.msg);
        cJSON_Delete(meta);
        if (seed < 0)
            continue;
        for (size_t f = 0; f < 2; f++) {
            kiln_st *st = oracle_check_open(cases[c], files[f]);
            if (!st)
                continue;
            const kiln_st_tensor *noise = kiln_st_find(st, "noise");
            CHECKF(noise && noise->ndim == 4, "%s/%s: no 4-d noise", cases[c], files[f]);
            if (noise && noise->ndim == 4) {
                size_t n = (size_t)(noise->shape[0] * noise->shape[1] * noise->shape[2] *
                                    noise->shape[3]);
                int zimage = strncmp(cases[c], "zimage", 6) == 0;
                kiln_dtype want_dt = (f == 1 && !zimage) ? KILN_BF16 : KILN_F32;
                CHECKF(noise->dtype == want_dt, "%s/%s noise is %s", cases[c], files[f],
                       kiln_dtype_name(noise->dtype));
                float *got = draw((uint64_t)seed, n, noise->dtype);
                CHECK(got != NULL);
                if (got) {
                    size_t bad = count_mismatch(cases[c], got, noise, n);
                    CHECKF(bad == 0, "%s/%s: %zu of %zu differ", cases[c], files[f], bad, n);
                    checked++;
                }
                free(got);
            }
            kiln_st_close(st);
        }
    }
    CHECK(checked == 14);
}

int main(void)
{
    RUN(test_mt19937_known_answer);
    RUN(test_rng_vectors);
    RUN(test_klein_1024_noise);
    RUN(test_stream_continues);
    RUN(test_bad_input);
    RUN(test_case_noise);
    return test_finish();
}
