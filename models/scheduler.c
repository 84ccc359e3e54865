/* Flow-matching schedules (diffusers FlowMatchEulerDiscreteScheduler.set_timesteps
 * as called by Flux2KleinPipeline and ZImagePipeline), bit for bit.
 *
 * Every fp32 operation is a separate rounding, as in numpy/torch; this file is
 * compiled with -ffp-contract=off (models/meson.build) and the one place where
 * torch's compiled kernel fuses a multiply-add is written as fmaf(). */
#include "models/scheduler.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "common/json.h"

#define CONFIG_LABEL "scheduler/scheduler_config.json"

void kiln_sched_config_default(kiln_sched_config *cfg)
{
    cfg->num_train_timesteps = 1000;
    cfg->shift = 1.0;
    cfg->use_dynamic_shifting = 0;
}

/* A boolean option that must be false (or absent) for the schedules here. */
static kiln_status require_false(const cJSON *json, const char *key, kiln_err *err)
{
    int v = 0;
    kiln_status st = kiln_json_bool(json, key, 0, 0, &v, err);
    if (st) {
        kiln_err_wrap(err, CONFIG_LABEL);
        return st;
    }
    if (v)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "%s: %s = true is not supported",
                            CONFIG_LABEL, key);
    return KILN_OK;
}

/* An optional string: *out is NULL when the key is absent or null. */
static kiln_status opt_string(const cJSON *json, const char *key, const char **out, kiln_err *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(json, key);
    *out = NULL;
    if (!v || cJSON_IsNull(v))
        return KILN_OK;
    if (!cJSON_IsString(v))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: key '%s' must be a string", CONFIG_LABEL,
                            key);
    *out = v->valuestring;
    return KILN_OK;
}

kiln_status kiln_sched_config_parse(const cJSON *json, kiln_sched_config *cfg, kiln_err *err)
{
    if (!cJSON_IsObject(json))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: not a JSON object", CONFIG_LABEL);
    kiln_sched_config_default(cfg);

    const char *cls, *shift_type;
    kiln_status st = opt_string(json, "_class_name", &cls, err);
    if (!st)
        st = opt_string(json, "time_shift_type", &shift_type, err);
    if (st)
        return st;
    if (cls && strcmp(cls, "FlowMatchEulerDiscreteScheduler") != 0)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "%s: scheduler class %s is not supported",
                            CONFIG_LABEL, cls);

    double shift_terminal = 0;
    st = kiln_json_int(json, "num_train_timesteps", 1000, &cfg->num_train_timesteps, err);
    if (!st)
        st = kiln_json_double(json, "shift", 0, 1.0, &cfg->shift, err);
    if (!st)
        st = kiln_json_bool(json, "use_dynamic_shifting", 0, 0, &cfg->use_dynamic_shifting, err);
    if (!st)
        st = kiln_json_double(json, "shift_terminal", 0, 0.0, &shift_terminal, err);
    if (st) {
        kiln_err_wrap(err, CONFIG_LABEL);
        return st;
    }
    if (cfg->num_train_timesteps < 1 || cfg->num_train_timesteps > 1000000)
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: num_train_timesteps %lld out of range",
                            CONFIG_LABEL, (long long)cfg->num_train_timesteps);
    if (!(cfg->shift > 0 && cfg->shift < 1e6))
        return kiln_err_set(err, KILN_ERR_FORMAT, "%s: shift %g out of range", CONFIG_LABEL,
                            cfg->shift);
    /* diffusers tests `if shift_terminal:`, so 0 and null both mean off. */
    if (shift_terminal != 0)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "%s: shift_terminal is not supported",
                            CONFIG_LABEL);
    static const char *const off_keys[] = {"use_karras_sigmas", "use_exponential_sigmas",
                                           "use_beta_sigmas", "invert_sigmas",
                                           "stochastic_sampling"};
    for (size_t i = 0; i < sizeof(off_keys) / sizeof(off_keys[0]); i++)
        if ((st = require_false(json, off_keys[i], err)))
            return st;
    /* diffusers' default time_shift_type is "exponential"; "linear" is unverified here. */
    if (cfg->use_dynamic_shifting && shift_type && strcmp(shift_type, "exponential") != 0)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "%s: time_shift_type \"%s\" is not supported", CONFIG_LABEL,
                            shift_type);
    return KILN_OK;
}

kiln_status kiln_sched_config_load(const char *checkpoint_dir, kiln_sched_config *cfg,
                                   kiln_err *err)
{
    char path[4096];
    int len = snprintf(path, sizeof(path), "%s/scheduler/scheduler_config.json", checkpoint_dir);
    if (len < 0 || (size_t)len >= sizeof(path))
        return kiln_err_set(err, KILN_ERR_INVALID, "%s: checkpoint path too long", CONFIG_LABEL);
    kiln_err local = {0};
    cJSON *json = kiln_json_load(path, CONFIG_LABEL, &local);
    if (!json) {
        kiln_err_set(err, local.code, "%s", local.msg);
        return local.code;
    }
    kiln_status st = kiln_sched_config_parse(json, cfg, err);
    cJSON_Delete(json);
    return st;
}

/* Flux2 pipeline's compute_empirical_mu: two fitted lines in the token count,
 * interpolated in the step count between 10 and 200 steps, except above 4300
 * tokens where only the 200-step line is used. */
double kiln_sched_flux2_mu(int64_t image_seq_len, int num_steps)
{
    const double a1 = 8.73809524e-05, b1 = 1.89833333;
    const double a2 = 0.00016927, b2 = 0.45666666;
    double n_tok = (double)image_seq_len;
    if (image_seq_len > 4300)
        return a2 * n_tok + b2;
    double m200 = a2 * n_tok + b2;
    double m10 = a1 * n_tok + b1;
    double a = (m200 - m10) / 190.0;
    double b = m200 - 200.0 * a;
    return a * (double)num_steps + b;
}

static kiln_status steps_error(int num_steps, kiln_err *err)
{
    return kiln_err_set(err, KILN_ERR_INVALID, "num_inference_steps %d out of range 1..%d",
                        num_steps, KILN_SCHED_MAX_STEPS);
}

/* numpy.linspace(1.0, 1/n, n) in float64 (i * step + start, last element set
 * to the endpoint), then .astype(float32). */
static void linspace_f64_to_f32(int n, float *s)
{
    double stop = 1.0 / n;
    if (n == 1) {
        s[0] = 1.0f;
        return;
    }
    double step = (stop - 1.0) / (double)(n - 1);
    for (int i = 0; i < n - 1; i++)
        s[i] = (float)((double)i * step + 1.0);
    s[n - 1] = (float)stop;
}

/* torch.linspace(1.0, 1/n, n) in fp32 on the CPU: a scalar loop that counts
 * from the start for the first half and back from the end for the second
 * (ATen RangeFactoriesKernel.cpp).  `start + step * i` is fused into one FMA
 * because torch's AVX2 kernels are compiled with FMA contraction (the same
 * build whose fused polynomials the noise generator reproduces); the fusion
 * changes sigmas for n = 13, 15, 17, ..., never for the usual 8 or 9 steps,
 * and the oracle covers n = 8 only. */
static void linspace_torch_f32(int n, float *s)
{
    const float start = 1.0f, end = (float)(1.0 / n);
    if (n == 1) {
        s[0] = start;
        return;
    }
    const float step = (end - start) / (float)(n - 1);
    const int halfway = n / 2;
    for (int i = 0; i < n; i++)
        s[i] = i < halfway ? fmaf(step, (float)i, start)
                           : fmaf(-step, (float)(n - 1 - i), end);
}

/* set_timesteps after the base sigmas: shift, timesteps = sigma * T in fp32,
 * and the appended terminal 0.  numpy/torch promote the Python scalars (e^mu,
 * shift, shift - 1, T) to fp32 first, then every operation rounds to fp32. */
static void shift_and_finish(const kiln_sched_config *cfg, double mu, int n, float *sigmas,
                             float *timesteps)
{
    if (cfg->use_dynamic_shifting) {
        const float e = (float)exp(mu);
        for (int i = 0; i < n; i++) {
            float inv = 1.0f / sigmas[i];
            float d = inv - 1.0f; /* (1/s - 1) ** 1.0 is exact */
            float den = e + d;
            sigmas[i] = e / den;
        }
    } else {
        const float shift = (float)cfg->shift, shift_m1 = (float)(cfg->shift - 1.0);
        for (int i = 0; i < n; i++) {
            float num = shift * sigmas[i];
            float den = 1.0f + shift_m1 * sigmas[i];
            sigmas[i] = num / den;
        }
    }
    const float t_scale = (float)cfg->num_train_timesteps;
    for (int i = 0; i < n; i++)
        timesteps[i] = sigmas[i] * t_scale;
    sigmas[n] = 0.0f;
}

kiln_status kiln_sched_flux2(const kiln_sched_config *cfg, int64_t image_seq_len, int num_steps,
                             float *sigmas, float *timesteps, double *mu, kiln_err *err)
{
    if (num_steps < 1 || num_steps > KILN_SCHED_MAX_STEPS)
        return steps_error(num_steps, err);
    if (image_seq_len < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "image token count %lld is not positive",
                            (long long)image_seq_len);
    double m = kiln_sched_flux2_mu(image_seq_len, num_steps);
    linspace_f64_to_f32(num_steps, sigmas);
    shift_and_finish(cfg, m, num_steps, sigmas, timesteps);
    if (mu)
        *mu = m;
    return KILN_OK;
}

kiln_status kiln_sched_zimage(const kiln_sched_config *cfg, int num_steps, float *sigmas,
                              float *timesteps, kiln_err *err)
{
    if (num_steps < 1 || num_steps > KILN_SCHED_MAX_STEPS)
        return steps_error(num_steps, err);
    if (cfg->use_dynamic_shifting)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED,
                            "%s: dynamic shifting is not supported for Z-Image", CONFIG_LABEL);
    linspace_torch_f32(num_steps, sigmas);
    shift_and_finish(cfg, 0.0, num_steps, sigmas, timesteps);
    return KILN_OK;
}

/* The DiT-side division and multiplication run on the CPU in the oracle
 * (true division); on CUDA torch multiplies by fl32(1/1000) instead, which
 * never changes the bf16 result (pipeline.md §6). */
float kiln_sched_flux2_dit_input(float t, kiln_dtype dt)
{
    assert(dt == KILN_F32 || dt == KILN_BF16);
    if (dt == KILN_BF16)
        return kiln_round_bf16(kiln_round_bf16(t) / 1000.0f);
    return t / 1000.0f;
}

float kiln_sched_flux2_dit_time(float t, kiln_dtype dt)
{
    float in = kiln_sched_flux2_dit_input(t, dt);
    if (dt == KILN_BF16)
        return kiln_round_bf16(in * 1000.0f);
    return in * 1000.0f;
}

float kiln_sched_zimage_dit_input(float t)
{
    float remaining = 1000.0f - t;
    return remaining / 1000.0f;
}

int kiln_sched_preview_steps(int run, int previews, int *out)
{
    int n = 0;
    for (int j = 0; j < previews && run > 1; j++) {
        int k = (int)((int64_t)(j + 1) * (run - 1) / (previews + 1));
        if (!n || out[n - 1] != k)
            out[n++] = k;
    }
    return n;
}
