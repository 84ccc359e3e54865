/* Private parts of the denoise stage, shared by denoise_stage.c (checks,
 * noise and the calls through the family seam) and each family's loop
 * (denoise_klein.c, denoise_zimage.c). */
#ifndef KILN_ENGINE_DENOISE_INTERNAL_H
#define KILN_ENGINE_DENOISE_INTERNAL_H

#include "denoise_stage.h"
#include "family_stages.h"
#include "models/scheduler.h"

struct kiln_denoise_stage {
    kiln_backend *be;
    const kiln_family_stages *family; /* the checkpoint's */
    const kiln_denoise_loop *loop;    /* family->denoise */
    void *dit;                     /* the loop's DiT (and what it keeps across runs) */
    kiln_sched_config sched;
    kiln_model_traits traits;
    int64_t channels;
    /* The VAE's latent normalisation (vae/config.json), for families
     * whose images come as posterior moments (image_moments 2): the
     * sample is normalised here, where the row's generator is. */
    double vae_scaling, vae_shift;
};

/* Inpainting's kept region, on the host in fp32 as the pipelines blend:
 * after a step x = (1 - m) x (sigma x noise + (1 - sigma) x img) + m x x,
 * with sigma the next step's (after the last, the image itself). */
typedef struct denoise_keep {
    float *noise;     /* (B, N, C) each row's noise */
    float *img;       /* (img_rows, N, C): one shared row, or each row's (img_rows = B) */
    int64_t img_rows;
    float *mask;      /* (N, C): 1 repaint .. 0 keep */
    float *host;      /* (B, N, C) scratch */
} denoise_keep;

/* The start of img2img and inpainting, host f32 (B, N, C) in x:
 * scale_noise's sigma x noise + (1 - sigma) x image, x holding the noise
 * and img img_rows (1 or B) rows.  With keep, also fills keep's noise and
 * image (keep->mask and img_rows set by the caller).  KILN_ERR_NOMEM. */
kiln_status denoise_start(float *x, const float *img, int64_t img_rows, float sigma, int64_t B,
                          int64_t NC, denoise_keep *keep, kiln_err *err);
/* After a step (or on a preview's estimate, last = 1): the blend above on
 * x (B, N, C) f32 in backend memory. */
kiln_status denoise_keep_blend(kiln_backend *be, const denoise_keep *k, kiln_tensor *x,
                               float sigma, int last, int64_t B, int64_t NC, kiln_err *err);
void denoise_keep_free(denoise_keep *k);

/* The rows' draws from their generators, host f32 (B, N, C) each, as the
 * pipeline draws them: with eps (families sampling the image posterior,
 * when the job has an image), each row's sample draw first, then its
 * noise; batch_noise draws the noise of every row from seeds[0] (after
 * one sample draw). */
kiln_status denoise_draw(const kiln_denoise_stage *s, const kiln_denoise_job *job, float *eps,
                         float *noise, kiln_err *err);

/* A family's DiT and loop, its entry of the seam (family_stages.h). */
struct kiln_denoise_loop {
    /* Loads the DiT of ck into s->dit, at `precision` (FP8: its block
     * weights quantised, their count in *fp8_weights), and sets
     * s->channels (s->be and s->traits are set).  err set on failure;
     * s->dit, when set, is then freed by destroy. */
    kiln_status (*load)(kiln_denoise_stage *s, const kiln_checkpoint *ck, kiln_precision precision,
                        int *fp8_weights, kiln_err *err);
    void (*destroy)(void *dit); /* NULL-safe */
    /* 1: the initial noise is drawn in fp32 on every backend; 0: in the
     * backend's dtype (unless the job's fp32_noise). */
    int noise_fp32;
    /* The initial noise, B rows of channels*h*w floats drawn as the
     * pipeline's latents (host f32 in grid), to the DiT's tokens (B, h*w,
     * channels) in out (h, w: the image in 16-pixel tokens). */
    void (*pack_noise)(const kiln_denoise_stage *s, const float *grid, float *out, int64_t B,
                       int64_t h, int64_t w);
    /* The loop, after kiln_denoise_run checked the job; out as there. */
    kiln_status (*run)(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                       kiln_err *err);
};

/* The loops, for the family entries (family_klein.c, family_zimage.c). */
extern const kiln_denoise_loop kiln_denoise_loop_klein, kiln_denoise_loop_zimage;

/* Image plus text tokens per DiT forward, in every family's loop.  The
 * DiT's activations grow with rows x tokens (about 140 KB a token for
 * klein-4B, 640 MB for a 1024x1024 row), and a 1024x1024 row (4608 tokens)
 * already fills the GPU, so a batch of large images runs a row at a time
 * (small ones still together): the service's peak memory stays that of one
 * row while its batches keep their queueing benefit.  Rows never interact
 * in the DiT. */
#define DENOISE_PASS_TOKENS 8192

#endif
