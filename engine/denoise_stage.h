/* The denoise stage: initial noise, the flow-matching schedule and the DiT
 * loop of the checkpoint's family: FLUX.2 klein (text-to-image, edits, the
 * 9B-kv reference cache and classifier-free guidance for base checkpoints)
 * or Z-Image (text-to-image, CFG when guidance > 0; fp32 latents on every
 * backend, as ZImagePipeline keeps them).
 *
 *   kiln_denoise_stage *dn = kiln_denoise_stage_create(be, ck, &err);
 *   kiln_denoise_job job = {.B = 1, .embeds = &emb, .width = 512, .height = 512,
 *                           .steps = 4, .guidance = 1.0f, .seeds = &seed};
 *   kiln_tensor lat;                                  // (B, N, C) packed latents
 *   if (kiln_denoise_run(dn, &job, &lat, &err)) ...
 *   ... kiln_be_free(be, &lat); kiln_denoise_stage_destroy(dn);
 *
 * Rows never interact: row b's noise is drawn alone from seeds[b] (unless
 * batch_noise asks for diffusers' single-generator draw) and every op
 * treats rows independently, so a row's latents do not depend on the batch
 * it ran in.
 *
 * Thread-safety: a stage uses its backend and scratch memory, so it belongs
 * to the backend's thread.
 */
#ifndef KILN_ENGINE_DENOISE_STAGE_H
#define KILN_ENGINE_DENOISE_STAGE_H

#include <stdint.h>

#include "common/checkpoint.h"
#include "kernels/backend.h"
#include "family.h"
#include "plan.h"

typedef struct kiln_denoise_stage kiln_denoise_stage;

typedef struct kiln_denoise_job {
    int64_t B;                     /* rows */
    const kiln_tensor *embeds;     /* (B, T, J) prompt embeddings */
    const kiln_tensor *neg_embeds; /* (B, T, J) negative embeddings, used when CFG runs */
    /* Z-Image: real tokens of each row of embeds / neg_embeds (1..T; the
     * encode stage's lens_out); the DiT reads those rows only.  Unused by
     * klein, whose DiT reads every row. */
    const int *txt_len, *neg_len;
    int width, height;             /* output pixels, multiples of 16 */
    int steps;
    float guidance;                /* CFG runs when kiln_model_cfg_runs says so */
    const uint64_t *seeds;         /* [B] per-row seeds */
    int batch_noise;               /* one draw for all rows from seeds[0] */
    int fp32_noise;                /* draw fp32 noise even on a bf16 backend (oracle runs) */
    const float *latents_in;       /* optional host (B, N, C) initial latents instead of noise */
    /* Image-to-image, as diffusers' FluxImg2ImgPipeline does it (diffusers
     * releases no FLUX.2 klein img2img pipeline; Flux2KleinInpaintPipeline
     * starts the same way): with strength in (0, 1], init_tokens (1, N, C)
     * (the input image resized to W x H, engine/inpaint.h, then encoded,
     * patchified, BN-normalised and packed as an edit reference is) are
     * noised to the schedule's sigma at step kiln_denoise_first_step (the
     * scheduler's scale_noise: sigma * noise + (1 - sigma) * image, the
     * noise drawn as for text-to-image) and only the steps from there run,
     * each with its own sigma.  strength 1 is text-to-image from the same
     * noise.  0: not img2img. */
    const kiln_tensor *init_tokens;
    double strength;
    /* Z-Image (ZImageImg2ImgPipeline): init_tokens (1, N, 2C) hold the
     * posterior's mean and log-variance (kiln_encode_references); each row
     * draws its sample eps from its generator before its noise, and its
     * image is ((mean + exp(0.5 clamp(logvar, -30, 20)) eps) - shift) x
     * scale (the VAE's factors) in fp32, so rows of one image differ as
     * their seeds do. */
    /* Inpainting, as diffusers' Flux2KleinInpaintPipeline and
     * ZImageInpaintPipeline: with mask (kiln_denoise_stage_mask_len
     * floats, 1 repaint .. 0 keep, kiln_encode_mask; shared by the rows),
     * init_tokens and strength start the run as above, and after every
     * step the latents are (1 - mask) x the image noised to the next step's
     * sigma (the image itself after the last step) + mask x the latents.
     * On klein the caller passes the image as the edit reference too
     * (ref_tokens, ids t = 10; kiln_denoise_job_image): the pipeline
     * conditions on it.  Not with the reference K/V cache. */
    const float *mask;
    const kiln_tensor *ref_tokens; /* (1, R, C) edit references, or NULL */
    const int32_t *ref_ids;        /* (R, 4) */
    int64_t R;
    /* Polled before each step; a non-zero return stops the run with
     * KILN_ERR_CANCELLED. */
    int (*cancelled)(void *user);
    /* Optional: told when step `step` (0 .. steps-1) is about to be queued,
     * for timing (the service reports setup and per-step time) and as
     * proof of progress (a service replica whose steps stand still while it
     * has work is fenced). */
    void (*on_step)(void *user, int step);
    /* Optional previews (the service's partial images): at each step
     * (counted as on_step counts them) for which preview_at returns
     * non-zero, after the step's velocity v is known (CFG applied) and
     * before the latents move, the current estimate of the clean latents
     * x0 = x - sigma x v (the Euler step to sigma 0, in the pipeline's
     * velocity convention: models/scheduler.h kiln_sched_preview_steps)
     * is computed into a scratch tensor shaped like `out` in
     * be->act_dtype, with inpainting's kept region blended in as after
     * the last step, and handed to on_preview.  The latents themselves are
     * never touched, so the run's result is the same bytes with or without
     * previews.  A non-zero return from on_preview stops the run with
     * that status. */
    int (*preview_at)(void *user, int step);
    kiln_status (*on_preview)(void *user, int step, const kiln_tensor *x0, kiln_err *err);
    void *user;
} kiln_denoise_job;

/* How the DiT computes (--precision of kiln generate, kiln serve and
 * kiln-denoiser).  EXACT, the default: everything in be->act_dtype (bf16
 * on CUDA, fp32 on the CPU), the oracle's bars.  FP8 (opt-in): the
 * transformer blocks' linear layers as E4M3 GEMMs with per-tensor scales
 * (kiln_flux2_dit_quantize_fp8, kiln_zimage_dit_quantize_fp8;
 * docs/PERFORMANCE.md "FP8 mode"): faster on GPUs with FP8 tensor cores,
 * at a cost in quality; the CPU backend computes the same quantisation in
 * fp32 (the reference the CUDA kernels are tested against). */
typedef enum kiln_precision {
    KILN_PRECISION_EXACT = 0,
    KILN_PRECISION_FP8,
} kiln_precision;

/* "exact" or "fp8" -> *out; -1 for anything else. */
int kiln_precision_parse(const char *s, kiln_precision *out);
const char *kiln_precision_name(kiln_precision p);

/* Loads the transformer and the scheduler config.  NULL with err set. */
kiln_denoise_stage *kiln_denoise_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                              kiln_err *err);
/* The same at a precision (kiln_denoise_stage_create is EXACT). */
kiln_denoise_stage *kiln_denoise_stage_create_at(kiln_backend *be, const kiln_checkpoint *ck,
                                                 kiln_precision precision, kiln_err *err);
void kiln_denoise_stage_destroy(kiln_denoise_stage *s);

/* The request defaults this checkpoint implies (CFG, KV cache, steps). */
kiln_model_traits kiln_denoise_stage_traits(const kiln_denoise_stage *s);

/* The role of a job's one input image by the request's strength and mask
 * (the front ends' shared rule): with neither, `tokens` (1, R, C) and
 * `ids` are edit references; with a strength (kiln_plan), image-to-image
 * starts from them (no reference); with a mask too, inpainting starts from
 * them and, on klein, keeps them as the reference.  tokens NULL:
 * text-to-image. */
void kiln_denoise_job_image(const kiln_denoise_stage *s, kiln_denoise_job *job,
                            const kiln_tensor *tokens, const int32_t *ids, int64_t R,
                            double strength, const float *mask);

/* dst's rows [row0, row0 + rows) from src's in the plan's row layout: row
 * row0 + b gets src row kiln_plan_row_prompt(b, n) (n = rows: the one
 * negative on every row).  dst (B, T, J) and src (P, T, J) of one dtype in
 * backend memory; errors through kiln_be_check. */
void kiln_denoise_expand_rows(kiln_backend *be, kiln_tensor *dst, int64_t row0,
                              const kiln_tensor *src, int64_t rows, int n);
/* Features per latent token C: the DiT's in_channels for klein (packed
 * latents), in_channels x patch^2 for Z-Image (its patch tokens). */
int64_t kiln_denoise_stage_channels(const kiln_denoise_stage *s);
/* Features per token of an img2img or inpainting image (init_tokens): the
 * channels for klein, twice them for Z-Image (the posterior's mean and
 * log-variance, kiln_encode_references). */
int64_t kiln_denoise_stage_image_channels(const kiln_denoise_stage *s);
/* Floats of an inpainting mask at width x height (kiln_encode_mask):
 * klein one a token, Z-Image one a VAE latent pixel (4 a token). */
int64_t kiln_denoise_stage_mask_len(const kiln_denoise_stage *s, int width, int height);

/* Draws the initial noise as diffusers does: klein (B, C, H/16, W/16) per
 * row (or for the whole batch with batch_noise) in the backend's dtype
 * (bf16 draw on bf16 backends unless fp32_noise), packed; Z-Image (B, 16,
 * H/8, W/8) in fp32, patchified (models/latents.h), after each row's
 * posterior sample draw when the job has an image.  Host (B, N, C) f32 in
 * `out`. */
kiln_status kiln_denoise_noise(const kiln_denoise_stage *s, const kiln_denoise_job *job,
                               float *out, kiln_err *err);

/* The step img2img and inpainting start at: kiln_request_first_step
 * (diffusers' get_timesteps of FluxImg2ImgPipeline and
 * Flux2KleinInpaintPipeline; 0 when strength <= 0: text-to-image).  The
 * run takes steps - kiln_denoise_first_step steps, at least one. */
int kiln_denoise_first_step(int steps, double strength);

/* Runs the whole loop.  `out` is allocated here as (B, N, C) of
 * be->act_dtype (caller frees with kiln_be_free); Z-Image's latents stay
 * fp32 through the loop and are cast at the end.  Errors: KILN_ERR_INVALID
 * for inconsistent job fields, KILN_ERR_CANCELLED, backend failures. */
kiln_status kiln_denoise_run(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                             kiln_err *err);

#endif
