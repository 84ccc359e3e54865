/* kiln flow-matching scheduler: the sigma/timestep schedules of diffusers'
 * FlowMatchEulerDiscreteScheduler as the FLUX.2 klein and Z-Image pipelines
 * drive it, bit for bit, plus the timestep value each DiT actually sees.
 *
 *   kiln_sched_config cfg;
 *   if (kiln_sched_config_load("ckpt/klein-4b", &cfg, &err)) return err.code;
 *   float sigmas[5], timesteps[4];
 *   double mu;
 *   if (kiln_sched_flux2(&cfg, h * w, 4, sigmas, timesteps, &mu, &err)) return err.code;
 *   for (int i = 0; i < 4; i++) {
 *       float t = kiln_sched_flux2_dit_time(timesteps[i], KILN_BF16); // what the DiT embeds
 *       ... x += (sigmas[i + 1] - sigmas[i]) * v ...
 *   }
 *
 * The schedules follow shared/spec/pipeline.md §5 (klein) and
 * z-image-turbo.md §4 step 3 (Z-Image): sigmas has n + 1 entries (the last is
 * 0), timesteps n entries (sigma * num_train_timesteps in fp32).  All
 * functions are pure and thread-safe.
 */
#ifndef KILN_MODELS_SCHEDULER_H
#define KILN_MODELS_SCHEDULER_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "common/error.h"
#include "common/tensor.h"

/* Largest step count accepted (bounds the caller's buffers). */
#define KILN_SCHED_MAX_STEPS 1000

/* The keys of scheduler/scheduler_config.json that the supported schedules
 * read; absent keys take diffusers' constructor defaults. */
typedef struct kiln_sched_config {
    int64_t num_train_timesteps; /* 1000 */
    double shift;                /* 1.0; the static shift (Z-Image: 3.0) */
    int use_dynamic_shifting;    /* false; klein: true (exponential shift by mu) */
} kiln_sched_config;

/* diffusers' defaults (num_train_timesteps 1000, shift 1.0, no dynamic
 * shifting). */
void kiln_sched_config_default(kiln_sched_config *cfg);

/* Parses a scheduler_config.json object.  Options that change the schedule
 * in ways this code does not implement (Karras/exponential/beta sigmas,
 * invert_sigmas, shift_terminal, stochastic_sampling, a "linear" time shift,
 * another scheduler class) fail with KILN_ERR_UNSUPPORTED; a mistyped or
 * out-of-range value with KILN_ERR_FORMAT. */
kiln_status kiln_sched_config_parse(const cJSON *json, kiln_sched_config *cfg, kiln_err *err);

/* Reads <checkpoint_dir>/scheduler/scheduler_config.json.  A missing file is
 * KILN_ERR_NOT_FOUND; messages name "scheduler/scheduler_config.json". */
kiln_status kiln_sched_config_load(const char *checkpoint_dir, kiln_sched_config *cfg,
                                   kiln_err *err);

/* FLUX.2 klein's empirical mu (double precision, with the cliff above 4300
 * image tokens).  image_seq_len counts output-image tokens only (h * w), never
 * reference tokens; num_steps is the num_inference_steps argument. */
double kiln_sched_flux2_mu(int64_t image_seq_len, int num_steps);

/* The klein schedule: s = linspace(1, 1/n, n) in float64 rounded to fp32,
 * then (dynamic shifting) sigma = E / (E + (1/s - 1)) in fp32 with
 * E = fl32(exp(mu)), mu = kiln_sched_flux2_mu(image_seq_len, n); or (static)
 * the shift of kiln_sched_zimage.  sigmas[n + 1], timesteps[n]; *mu may be
 * NULL and gets the mu used (also when static shifting ignores it).  Fails
 * with KILN_ERR_INVALID for n outside 1..KILN_SCHED_MAX_STEPS or a
 * non-positive image_seq_len. */
kiln_status kiln_sched_flux2(const kiln_sched_config *cfg, int64_t image_seq_len, int num_steps,
                             float *sigmas, float *timesteps, double *mu, kiln_err *err);

/* The Z-Image schedule: s = torch.linspace(1, 1/n, n) in fp32 (torch's CPU
 * kernel, not a rounded float64 linspace), then the static shift
 * sigma = fl32(S*s) / fl32(1 + fl32(S1*s)) with S = fl32(shift),
 * S1 = fl32(shift - 1).  A config with dynamic shifting is
 * KILN_ERR_UNSUPPORTED (Z-Image's mu path is not implemented); a bad n is
 * KILN_ERR_INVALID. */
kiln_status kiln_sched_zimage(const kiln_sched_config *cfg, int num_steps, float *sigmas,
                              float *timesteps, kiln_err *err);

/* FLUX.2: the timestep tensor the klein pipeline passes to its DiT,
 * `timestep.to(dt) / 1000` for the scheduler's fp32 timestep t (dt: KILN_F32
 * or KILN_BF16, the pipeline dtype; another dtype is a bug and asserts). */
float kiln_sched_flux2_dit_input(float t, kiln_dtype dt);

/* FLUX.2: the value the DiT's sinusoidal embedding sees after its own
 * `* 1000` in its dtype: fp32 fl32(fl32(t/1000)*1000), bf16
 * bf16(bf16(bf16(t)/1000)*1000) (e.g. 955.39 -> 956.0 in bf16). */
float kiln_sched_flux2_dit_time(float t, kiln_dtype dt);

/* Z-Image: the DiT's time input (1000 - t)/1000 in fp32 (it is fp32 in
 * both the fp32 and the bf16 pipeline). */
float kiln_sched_zimage_dit_input(float t);

/* Previews (the service's partial images; no diffusers counterpart): the
 * steps of a run of `run` steps (0 .. run-1, counted from the first step
 * that runs) whose estimate of the clean latents is shown.  The estimate
 * of step k is x0 = x_k - sigma_k * v_k, the Euler step from x_k straight
 * to sigma 0 with the step's velocity (the pipeline's velocity: Z-Image's
 * is the DiT output negated); the last step's estimate is the final
 * result itself, so previews split the steps before it into `previews` + 1
 * equal parts: k_j = floor((j + 1) (run - 1) / (previews + 1)), j = 0 ..
 * previews-1, duplicates dropped.  Writes the distinct steps in rising
 * order to out (room for `previews` entries) and returns their count:
 * min(previews, run - 1) (0 for previews <= 0 or run <= 1). */
int kiln_sched_preview_steps(int run, int previews, int *out);

#endif
