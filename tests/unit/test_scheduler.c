/* Scheduler parity: sigmas, timesteps and mu of every oracle case bit for bit,
 * the values listed in shared/spec/pipeline.md §5 and z-image-turbo.md §4, and
 * the DiT timestep inputs of the fp32 and bf16 references. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "common/safetensors.h"
#include "models/scheduler.h"
#include "tests/oracle/oracle_check.h"
#include "tests/test.h"

/* Compares n floats against a JSON array of (float32-valued) numbers. */
static void check_json_floats(const char *what, const cJSON *arr, const float *got, int n)
{
    CHECKF(cJSON_IsArray(arr) && cJSON_GetArraySize(arr) == n, "%s: expected %d values", what,
           n);
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) != n)
        return;
    for (int i = 0; i < n; i++) {
        float want = (float)cJSON_GetArrayItem(arr, i)->valuedouble;
        CHECKF(oracle_bits(got[i]) == oracle_bits(want), "%s[%d]: got %.9g want %.9g", what, i,
               (double)got[i], (double)want);
    }
}

/* Compares n floats bit for bit with a stored tensor of n elements. */
static void check_st_floats(const char *what, const kiln_st *st, const char *name,
                            const float *got, size_t n)
{
    const kiln_st_tensor *t = kiln_st_find(st, name);
    CHECKF(t && t->nbytes == n * kiln_dtype_size(t->dtype), "%s: %s missing or wrong size",
           what, name);
    if (!t || t->nbytes != n * kiln_dtype_size(t->dtype))
        return;
    for (size_t i = 0; i < n; i++)
        CHECKF(oracle_bits(got[i]) == oracle_bits(oracle_value(t, i)),
               "%s %s[%zu]: got %.9g want %.9g", what, name, i, (double)got[i],
               (double)oracle_value(t, i));
}

/* An oracle case: meta.json, both reference files and the scheduler config
 * of its checkpoint. */
typedef struct sched_case {
    const char *name;
    cJSON *meta;
    kiln_st *ref, *ref16;
    kiln_sched_config cfg;
    int steps;
} sched_case;

/* Loads all of a case (failed checks for what is missing); 0 when all
 * loaded.  close_case() in either case. */
static int open_case(const char *name, sched_case *sc)
{
    *sc = (sched_case){.name = name};
    sc->meta = oracle_check_meta(name);
    sc->ref = oracle_check_open(name, "ref_fp32.safetensors");
    sc->ref16 = oracle_check_open(name, "ref_bf16.safetensors");
    if (!sc->meta || !sc->ref || !sc->ref16)
        return -1;
    const cJSON *ck = cJSON_GetObjectItemCaseSensitive(sc->meta, "checkpoint");
    CHECK(cJSON_IsString(ck));
    if (!cJSON_IsString(ck))
        return -1;
    kiln_err err = {0};
    kiln_status st = kiln_sched_config_load(oracle_path(ck->valuestring), &sc->cfg, &err);
    CHECKF(st == KILN_OK, "%s", err.msg);
    sc->steps = cJSON_GetObjectItemCaseSensitive(sc->meta, "steps")->valueint;
    return st == KILN_OK ? 0 : -1;
}

static void close_case(sched_case *sc)
{
    kiln_st_close(sc->ref);
    kiln_st_close(sc->ref16);
    cJSON_Delete(sc->meta);
}

/* The case's sigmas and timesteps in meta.json and both reference files. */
static void check_schedule(const sched_case *sc, const float *sigmas, const float *timesteps)
{
    const int steps = sc->steps;
    check_json_floats(sc->name, cJSON_GetObjectItemCaseSensitive(sc->meta, "sigmas"), sigmas,
                      steps + 1);
    check_json_floats(sc->name, cJSON_GetObjectItemCaseSensitive(sc->meta, "timesteps"),
                      timesteps, steps);
    check_st_floats(sc->name, sc->ref, "sigmas", sigmas, (size_t)steps + 1);
    check_st_floats(sc->name, sc->ref, "timesteps", timesteps, (size_t)steps);
    check_st_floats(sc->name, sc->ref16, "sigmas", sigmas, (size_t)steps + 1);
}

static void test_klein_cases(void)
{
    static const char *cases[] = {"klein_t2i_256", "klein_t2i_batch2", "klein_edit_1ref",
                                  "klein_kv_edit_1ref", "klein_base_cfg_256"};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        sched_case sc;
        if (open_case(cases[c], &sc))
            goto next;
        CHECK(sc.cfg.use_dynamic_shifting == 1);
        int steps = sc.steps;
        int64_t seq =
            (int64_t)cJSON_GetObjectItemCaseSensitive(sc.meta, "image_seq_len")->valuedouble;
        /* The image token count is the output latent grid h*w (noise is (B, 4C, h, w)). */
        const kiln_st_tensor *noise = kiln_st_find(sc.ref, "noise");
        CHECK(noise && noise->ndim == 4 && noise->shape[2] * noise->shape[3] == seq);

        float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
        double mu = 0;
        kiln_err err = {0};
        CHECK(kiln_sched_flux2(&sc.cfg, seq, steps, sigmas, timesteps, &mu, &err) == KILN_OK);
        double want_mu = cJSON_GetObjectItemCaseSensitive(sc.meta, "mu")->valuedouble;
        CHECKF(mu == want_mu, "%s mu %.17g want %.17g", cases[c], mu, want_mu);
        CHECK(kiln_sched_flux2_mu(seq, steps) == want_mu);
        check_schedule(&sc, sigmas, timesteps);

        /* The first DiT call's timestep tensor, in the pipeline dtype. */
        const kiln_st_tensor *t32 = kiln_st_find(sc.ref, "transformer_in0.timestep");
        const kiln_st_tensor *t16 = kiln_st_find(sc.ref16, "transformer_in0.timestep");
        CHECK(t32 && t32->dtype == KILN_F32 && t16 && t16->dtype == KILN_BF16);
        if (t32 && t16) {
            CHECK(oracle_bits(kiln_sched_flux2_dit_input(timesteps[0], KILN_F32)) ==
                  oracle_bits(oracle_value(t32, 0)));
            CHECK(oracle_bits(kiln_sched_flux2_dit_input(timesteps[0], KILN_BF16)) ==
                  oracle_bits(oracle_value(t16, 0)));
        }
    next:
        close_case(&sc);
    }
}

static void test_zimage_cases(void)
{
    static const char *cases[] = {"zimage_t2i_256", "zimage_batch2_160x96"};
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        sched_case sc;
        if (open_case(cases[c], &sc))
            goto next;
        CHECK(sc.cfg.use_dynamic_shifting == 0 && sc.cfg.shift == 3.0);
        float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
        kiln_err err = {0};
        CHECK(kiln_sched_zimage(&sc.cfg, sc.steps, sigmas, timesteps, &err) == KILN_OK);
        check_schedule(&sc, sigmas, timesteps);
        /* t = (1000 - tau)/1000 per batch item, fp32 in both pipelines. */
        float t0[2] = {kiln_sched_zimage_dit_input(timesteps[0]),
                       kiln_sched_zimage_dit_input(timesteps[0])};
        const kiln_st_tensor *t = kiln_st_find(sc.ref, "transformer_in0.t");
        size_t batch = t ? (size_t)t->shape[0] : 0;
        CHECK(batch >= 1 && batch <= 2);
        if (batch >= 1 && batch <= 2) {
            check_st_floats(cases[c], sc.ref, "transformer_in0.t", t0, batch);
            check_st_floats(cases[c], sc.ref16, "transformer_in0.t", t0, batch);
        }
    next:
        close_case(&sc);
    }
}

static void klein_spec_case(int64_t seq, int steps, double want_mu, const float *want, int nwant)
{
    kiln_sched_config cfg;
    kiln_sched_config_default(&cfg);
    cfg.use_dynamic_shifting = 1;
    float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
    double mu;
    kiln_err err = {0};
    CHECK(kiln_sched_flux2(&cfg, seq, steps, sigmas, timesteps, &mu, &err) == KILN_OK);
    CHECK_NEAR(mu, want_mu, 5e-7);
    /* The spec prints 8 digits: within 1e-8 is the nearest float (ulp ~6e-8). */
    for (int i = 0; i < nwant; i++)
        CHECK_NEAR(sigmas[i], want[i], 1e-8);
    CHECK(sigmas[0] == 1.0f && sigmas[steps] == 0.0f);
    for (int i = 0; i < steps; i++)
        CHECK(timesteps[i] == sigmas[i] * 1000.0f);
}

static void test_klein_spec_values(void)
{
    klein_spec_case(4096, 4, 2.291180, (const float[]){1.0f, 0.96738404f, 0.90814394f,
                                                       0.76719993f, 0.0f}, 5);
    klein_spec_case(1024, 4, 2.030690, (const float[]){1.0f, 0.95808536f, 0.88398188f,
                                                       0.71749657f, 0.0f}, 5);
    klein_spec_case(4096, 50, 2.023351, (const float[]){1.0f, 0.99730909f, 0.99452138f}, 3);
    klein_spec_case(256, 4, 1.965567, (const float[]){1.0f, 0.95539075f, 0.87713426f,
                                                      0.70411170f, 0.0f}, 5);
}

/* Above 4300 image tokens mu stops depending on the step count and drops. */
static void test_mu_cliff(void)
{
    CHECK(kiln_sched_flux2_mu(4301, 4) == kiln_sched_flux2_mu(4301, 50));
    CHECK(kiln_sched_flux2_mu(4300, 4) != kiln_sched_flux2_mu(4300, 50));
    CHECK_NEAR(kiln_sched_flux2_mu(4300, 4), 2.31, 0.01);
    CHECK_NEAR(kiln_sched_flux2_mu(4301, 4), 1.19, 0.01);
}

static void test_zimage_spec_values(void)
{
    kiln_sched_config cfg;
    kiln_sched_config_default(&cfg);
    cfg.shift = 3.0;
    float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
    kiln_err err = {0};
    CHECK(kiln_sched_zimage(&cfg, 8, sigmas, timesteps, &err) == KILN_OK);
    static const float want[] = {1.0f, 0.95455f, 0.9f, 0.83333f, 0.75f, 0.64286f, 0.5f, 0.3f, 0};
    for (int i = 0; i < 9; i++)
        CHECK_NEAR(sigmas[i], want[i], 5e-6);
    /* torch's fp32 linspace is not a rounded float64 one: for 6 steps s_1 is
     * 0.833333373 (float64 rounded: 0.833333313), so sigma_1 is 0.9375 where a
     * float64 linspace gives 0.93750006. */
    CHECK(kiln_sched_zimage(&cfg, 6, sigmas, timesteps, &err) == KILN_OK);
    float s64 = (float)(1.0 + (1.0 / 6 - 1.0) / 5);
    float from_f64 = (3.0f * s64) / (1.0f + 2.0f * s64);
    CHECKF(sigmas[1] == 0.9375f && from_f64 == nextafterf(0.9375f, 1.0f), "%.9g vs %.9g",
           (double)sigmas[1], (double)from_f64);
    CHECK(kiln_sched_zimage(&cfg, 1, sigmas, timesteps, &err) == KILN_OK);
    CHECK(sigmas[0] == 1.0f && sigmas[1] == 0.0f && timesteps[0] == 1000.0f);
}

static void test_dit_time(void)
{
    /* pipeline.md §6: three bf16 roundings. */
    CHECK(kiln_sched_flux2_dit_time(955.3907470703125f, KILN_BF16) == 956.0f);
    CHECK(kiln_sched_flux2_dit_time(877.13427734375f, KILN_BF16) == 876.0f);
    CHECK(kiln_sched_flux2_dit_time(1000.0f, KILN_BF16) == 1000.0f);
    /* fp32: t/1000*1000 can move t by an ulp but no more; bf16 values stay bf16. */
    kiln_sched_config cfg;
    kiln_sched_config_default(&cfg);
    cfg.use_dynamic_shifting = 1;
    float sigmas[51], timesteps[50];
    kiln_err err = {0};
    CHECK(kiln_sched_flux2(&cfg, 4096, 50, sigmas, timesteps, NULL, &err) == KILN_OK);
    for (int i = 0; i < 50; i++) {
        float t = kiln_sched_flux2_dit_time(timesteps[i], KILN_F32);
        CHECK(fabsf(t - timesteps[i]) <= nextafterf(timesteps[i], 2000.0f) - timesteps[i]);
        float b = kiln_sched_flux2_dit_time(timesteps[i], KILN_BF16);
        CHECK(b == kiln_round_bf16(b) && fabsf(b - timesteps[i]) <= 8.0f);
    }
    /* ... and sometimes does (about 2% of fp32 values in [1, 1000]). */
    CHECK(kiln_sched_flux2_dit_time(1.95314026f, KILN_F32) == 1.95314038f);
}

static kiln_status parse_str(const char *text, kiln_sched_config *cfg, kiln_err *err)
{
    cJSON *j = cJSON_Parse(text);
    CHECK(j != NULL);
    kiln_status st = kiln_sched_config_parse(j, cfg, err);
    cJSON_Delete(j);
    return st;
}

static void test_config(void)
{
    kiln_sched_config cfg;
    kiln_err err = {0};
    CHECK(parse_str("{}", &cfg, &err) == KILN_OK);
    CHECK(cfg.num_train_timesteps == 1000 && cfg.shift == 1.0 && !cfg.use_dynamic_shifting);
    CHECK(parse_str("{\"shift_terminal\": null, \"use_karras_sigmas\": false, "
                    "\"time_shift_type\": \"linear\"}", &cfg, &err) == KILN_OK);
    CHECK(parse_str("{\"use_karras_sigmas\": true}", &cfg, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(strstr(err.msg, "use_karras_sigmas") != NULL);
    CHECK(parse_str("{\"invert_sigmas\": true}", &cfg, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(parse_str("{\"stochastic_sampling\": true}", &cfg, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(parse_str("{\"shift_terminal\": 0.02}", &cfg, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(parse_str("{\"use_dynamic_shifting\": true, \"time_shift_type\": \"linear\"}", &cfg,
                    &err) == KILN_ERR_UNSUPPORTED);
    CHECK(parse_str("{\"_class_name\": \"DDIMScheduler\"}", &cfg, &err) == KILN_ERR_UNSUPPORTED);
    CHECK(parse_str("{\"shift\": \"3\"}", &cfg, &err) == KILN_ERR_FORMAT);
    CHECK(strstr(err.msg, "scheduler_config.json") != NULL);
    CHECK(parse_str("{\"shift\": -1}", &cfg, &err) == KILN_ERR_FORMAT);
    CHECK(parse_str("{\"num_train_timesteps\": 0}", &cfg, &err) == KILN_ERR_FORMAT);
    CHECK(parse_str("{\"time_shift_type\": 1}", &cfg, &err) == KILN_ERR_FORMAT);
    CHECK(parse_str("[]", &cfg, &err) == KILN_ERR_FORMAT);
    CHECK(kiln_sched_config_load("/nonexistent-kiln-dir", &cfg, &err) == KILN_ERR_NOT_FOUND);
    CHECK(strstr(err.msg, "/nonexistent") == NULL);

    float s[2], t[1];
    kiln_sched_config_default(&cfg);
    CHECK(kiln_sched_zimage(&cfg, 0, s, t, &err) == KILN_ERR_INVALID);
    CHECK(kiln_sched_flux2(&cfg, 256, KILN_SCHED_MAX_STEPS + 1, s, t, NULL, &err) ==
          KILN_ERR_INVALID);
    CHECK(kiln_sched_flux2(&cfg, 0, 1, s, t, NULL, &err) == KILN_ERR_INVALID);
    cfg.use_dynamic_shifting = 1;
    CHECK(kiln_sched_zimage(&cfg, 1, s, t, &err) == KILN_ERR_UNSUPPORTED);
}

/* Preview steps: the documented table for klein's 4 and Z-Image's 9 steps,
 * never the last step (its estimate is the final result), distinct and
 * rising for every run and count. */
static void test_preview_steps(void)
{
    int k[3];
    CHECK(kiln_sched_preview_steps(4, 1, k) == 1 && k[0] == 1);
    CHECK(kiln_sched_preview_steps(4, 2, k) == 2 && k[0] == 1 && k[1] == 2);
    CHECK(kiln_sched_preview_steps(4, 3, k) == 3 && k[0] == 0 && k[1] == 1 && k[2] == 2);
    CHECK(kiln_sched_preview_steps(9, 2, k) == 2 && k[0] == 2 && k[1] == 5);
    CHECK(kiln_sched_preview_steps(9, 3, k) == 3 && k[0] == 2 && k[1] == 4 && k[2] == 6);
    CHECK(kiln_sched_preview_steps(2, 3, k) == 1 && k[0] == 0);
    CHECK(kiln_sched_preview_steps(1, 3, k) == 0);
    CHECK(kiln_sched_preview_steps(9, 0, k) == 0);
    for (int run = 1; run <= 50; run++)
        for (int p = 1; p <= 3; p++) {
            int n = kiln_sched_preview_steps(run, p, k);
            CHECKF(n == (p < run - 1 ? p : run - 1), "run %d previews %d: %d", run, p, n);
            for (int j = 0; j < n; j++)
                CHECK(k[j] >= 0 && k[j] < run - 1 && (j == 0 || k[j] > k[j - 1]));
        }
}

int main(void)
{
    RUN(test_preview_steps);
    RUN(test_klein_cases);
    RUN(test_zimage_cases);
    RUN(test_klein_spec_values);
    RUN(test_mu_cliff);
    RUN(test_zimage_spec_values);
    RUN(test_dit_time);
    RUN(test_config);
    return test_finish();
}
