/* The Z-Image DiT and denoising loop (the seam's entry is family_zimage.c),
 * as diffusers' ZImagePipeline.__call__ runs it
 * (spec/z-image-turbo.md §4): fp32 latents drawn as (B, 16, H/8, W/8) and
 * handed to the DiT as patch tokens cast to the model dtype; the shifted
 * schedule with the DiT time (1000 - tau) / 1000; the model output negated;
 * with CFG (guidance > 0) pos + g * (pos - neg) on the fp32 outputs; the
 * Euler step in fp32.
 *
 * Every DiT call is kept: the last one (at sigma_{N-1} = 3/11 for N = 9)
 * feeds the final Euler step x + (0 - sigma_{N-1}) v, whose dt is not 0, so
 * skipping it cannot give the same latents (tests/oracle/test_pipeline.c
 * shows the last step moving the oracle's latents).
 *
 * Image-to-image and inpainting as ZImageImg2ImgPipeline and
 * ZImageInpaintPipeline run them: each row's posterior sample and noise
 * (start_image), the steps from get_timesteps' start, and inpainting's
 * blend after every step at the VAE's latent pixels. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "denoise_internal.h"
#include "models/latents.h"
#include "models/zimage_dit.h"

static kiln_status load(kiln_denoise_stage *s, const kiln_checkpoint *ck, kiln_precision precision,
                        int *fp8_weights, kiln_err *err)
{
    kiln_zimage_dit *dit = kiln_zimage_dit_load(s->be, ck, err);
    s->dit = dit;
    if (!dit || (precision == KILN_PRECISION_FP8 &&
                 kiln_zimage_dit_quantize_fp8(dit, fp8_weights, err)))
        return err ? err->code : KILN_ERR_INTERNAL;
    s->channels = kiln_zimage_dit_get_config(dit)->patch_features;
    /* img2img's sample is normalised here (diffusers' AutoencoderKL
     * defaults when the config omits the factors). */
    const cJSON *vae = kiln_checkpoint_config(ck, "vae", err);
    if (!vae ||
        kiln_json_double(vae, "scaling_factor", 0, 0.18215, &s->vae_scaling, err) ||
        kiln_json_double(vae, "shift_factor", 0, 0.0, &s->vae_shift, err))
        return err ? err->code : KILN_ERR_FORMAT;
    return KILN_OK;
}

static void destroy(void *dit) { kiln_zimage_dit_destroy(dit); }

/* Drawn as latents (B, in_channels, 2h, 2w) in fp32 (z-image-turbo.md §4
 * item 2), handed to the DiT as its patch tokens. */
static void pack_noise(const kiln_denoise_stage *s, const float *grid, float *out, int64_t B,
                       int64_t h, int64_t w)
{
    const kiln_zimage_dit_config *zc = kiln_zimage_dit_get_config(s->dit);
    kiln_latents_zimage_patchify(grid, out, B, zc->in_channels, zc->patch, h, w);
}

typedef struct zi_loop {
    kiln_denoise_stage *s;
    const kiln_denoise_job *job;
    int64_t h, w, N;
    kiln_tensor x_in;   /* the latents in be->act_dtype (aliases out on fp32 backends) */
    kiln_tensor v, v_neg, v_cfg;
    kiln_tensor x0, x0_act; /* previews: the estimate (fp32, and in act_dtype) */
    int64_t *len, *nlen;
    float *t;
    denoise_keep keep; /* inpainting */
} zi_loop;

/* ZImageImg2ImgPipeline's start (and ZImageInpaintPipeline's): each row
 * draws its posterior sample, then its noise; its image is the sample
 * normalised, x0 its noise scaled to the start sigma with it.  On the host
 * in fp32: DiagonalGaussianDistribution's mean + exp(0.5 logvar) eps
 * (logvar clamped to [-30, 20]), then (x - shift) x scale. */
static kiln_status start_image(zi_loop *c, float sigma, float *x0, kiln_err *err)
{
    kiln_denoise_stage *s = c->s;
    const kiln_denoise_job *job = c->job;
    const int64_t B = job->B, N = c->N, C = s->channels;
    float *eps = malloc((size_t)(B * N * C) * sizeof *eps);
    float *moments = malloc((size_t)(N * 2 * C) * sizeof *moments);
    float *img = malloc((size_t)(B * N * C) * sizeof *img);
    kiln_status st = !eps || !moments || !img ? kiln_err_set(err, KILN_ERR_NOMEM, "out of memory")
                                              : denoise_draw(s, job, eps, x0, err);
    if (!st) {
        kiln_be_download(s->be, job->init_tokens, moments);
        st = kiln_be_check(s->be, err);
    }
    const float shift = (float)s->vae_shift, scale = (float)s->vae_scaling;
    for (int64_t b = 0; b < B && !st; b++)
        for (int64_t t = 0; t < N; t++)
            for (int64_t f = 0; f < C; f++) {
                const float *m = moments + t * 2 * C;
                float logvar = m[C + f] < -30.0f ? -30.0f : m[C + f] > 20.0f ? 20.0f : m[C + f];
                float std = expf(0.5f * logvar);
                size_t k = (size_t)((b * N + t) * C + f);
                float sample = m[f] + std * eps[k];
                img[k] = (sample - shift) * scale;
            }
    if (!st && job->mask && !(c->keep.mask = malloc((size_t)(N * C) * sizeof *c->keep.mask)))
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (!st && job->mask) {
        /* The mask (1, 1, 2h, 2w) over the channels, as latents, patchified
         * like them (eps is spent: its room holds the channels' copies). */
        const kiln_zimage_dit_config *zc = kiln_zimage_dit_get_config(s->dit);
        int64_t z = zc->in_channels, plane = 4 * N;
        for (int64_t ch = 0; ch < z; ch++)
            memcpy(eps + ch * plane, job->mask, (size_t)plane * sizeof *eps);
        kiln_latents_zimage_patchify(eps, c->keep.mask, 1, z, zc->patch, c->h, c->w);
    }
    if (!st)
        st = denoise_start(x0, img, B, sigma, B, N * C, job->mask ? &c->keep : NULL, err);
    free(eps), free(moments), free(img);
    return st;
}

static kiln_status check_lens(const int *len, const kiln_tensor *emb, int64_t B, const char *what,
                              int64_t *out, kiln_err *err)
{
    if (!len)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: Z-Image needs the %s lengths", what);
    for (int64_t b = 0; b < B; b++) {
        if (len[b] < 1 || len[b] > emb->shape[1])
            return kiln_err_set(err, KILN_ERR_INVALID, "denoise: %s row %lld has length %d of %lld",
                                what, (long long)b, len[b], (long long)emb->shape[1]);
        out[b] = len[b];
    }
    return KILN_OK;
}

/* One forward over rows in passes of at most DENOISE_PASS_TOKENS tokens
 * (rows never interact in the DiT). */
static kiln_status forward(zi_loop *c, const kiln_tensor *txt, const int64_t *len,
                           kiln_tensor *v, kiln_err *err)
{
    const int64_t B = c->job->B, tokens = c->N + txt->shape[1];
    int64_t per = DENOISE_PASS_TOKENS / tokens > 1 ? DENOISE_PASS_TOKENS / tokens : 1;
    for (int64_t b0 = 0; b0 < B; b0 += per) {
        int64_t n = B - b0 < per ? B - b0 : per;
        kiln_tensor xv = kiln_tensor_batch_view(&c->x_in, b0, n);
        kiln_tensor tv = kiln_tensor_batch_view(txt, b0, n);
        kiln_tensor vv = kiln_tensor_batch_view(v, b0, n);
        kiln_zimage_dit_input in = {.x = &xv, .h = c->h, .w = c->w, .cap = &tv,
                                    .cap_len = len + b0, .t = c->t + b0};
        if (kiln_zimage_dit_forward(c->s->dit, &in, &vv, err))
            return err->code;
    }
    return KILN_OK;
}

static kiln_status prepare(zi_loop *c, int use_cfg, float start_sigma, kiln_tensor *out,
                           kiln_err *err)
{
    kiln_denoise_stage *s = c->s;
    kiln_backend *be = s->be;
    const kiln_denoise_job *job = c->job;
    const int64_t B = job->B, C = s->channels;
    c->len = malloc((size_t)(2 * B) * sizeof *c->len);
    c->t = malloc((size_t)B * sizeof *c->t);
    float *x0 = malloc((size_t)(B * c->N * C) * sizeof *x0);
    kiln_status st = KILN_OK;
    if (!c->len || !c->t || !x0) {
        free(x0);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    c->nlen = c->len + B;
    if (check_lens(job->txt_len, job->embeds, B, "prompt", c->len, err) ||
        (use_cfg && check_lens(job->neg_len, job->neg_embeds, B, "negative prompt", c->nlen, err))) {
        free(x0);
        return err->code;
    }
    if (job->latents_in)
        memcpy(x0, job->latents_in, (size_t)(B * c->N * C) * sizeof *x0);
    else if (job->strength > 0)
        st = start_image(c, start_sigma, x0, err);
    else
        st = kiln_denoise_noise(s, job, x0, err);
    const int64_t shape[3] = {B, c->N, C};
    if (!st && !kiln_be_alloc(be, out, KILN_F32, 3, shape))
        kiln_be_upload(be, out, x0, KILN_F32);
    free(x0);
    if (st)
        return st;
    if (be->act_dtype == KILN_F32)
        c->x_in = *out;
    else
        kiln_be_alloc(be, &c->x_in, be->act_dtype, 3, shape);
    kiln_be_alloc(be, &c->v, be->act_dtype, 3, shape);
    if (use_cfg) {
        kiln_be_alloc(be, &c->v_neg, be->act_dtype, 3, shape);
        kiln_be_alloc(be, &c->v_cfg, KILN_F32, 3, shape);
    }
    return kiln_be_check(be, err);
}

/* A preview (kiln_denoise_job.on_preview): x0 = x - sigma (-out) =
 * x + sigma out, the Euler step to sigma 0 in fp32 on a copy of the
 * latents, handed on in be->act_dtype like the final latents. */
static kiln_status preview(zi_loop *c, const kiln_tensor *out, const kiln_tensor *v, float sigma,
                           int step, kiln_err *err)
{
    kiln_backend *be = c->s->be;
    if (!c->x0.data) {
        kiln_be_alloc(be, &c->x0, KILN_F32, 3, out->shape);
        if (be->act_dtype != KILN_F32)
            kiln_be_alloc(be, &c->x0_act, be->act_dtype, 3, out->shape);
    }
    kiln_be_copy(be, &c->x0, out);
    kiln_be_euler_step(be, &c->x0, v, sigma);
    /* Inpainting's kept region as after the last step. */
    kiln_status st = c->job->mask ? denoise_keep_blend(be, &c->keep, &c->x0, 0.0f, 1, c->job->B,
                                                       c->N * c->s->channels, err)
                                  : KILN_OK;
    if (st)
        return st;
    if (c->x0_act.data)
        kiln_be_copy(be, &c->x0_act, &c->x0);
    if (kiln_be_check(be, err))
        return err->code;
    return c->job->on_preview(c->job->user, step, c->x0_act.data ? &c->x0_act : &c->x0, err);
}

static void release(zi_loop *c, const kiln_tensor *out)
{
    kiln_backend *be = c->s->be;
    kiln_be_free(be, &c->x0), kiln_be_free(be, &c->x0_act);
    if (c->x_in.data != out->data)
        kiln_be_free(be, &c->x_in);
    kiln_be_free(be, &c->v), kiln_be_free(be, &c->v_neg), kiln_be_free(be, &c->v_cfg);
    free(c->len), free(c->t);
    denoise_keep_free(&c->keep);
}

static kiln_status run(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                       kiln_err *err)
{
    kiln_backend *be = s->be;
    float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
    if (kiln_sched_zimage(&s->sched, job->steps, sigmas, timesteps, err))
        return err->code;
    const int use_cfg = kiln_model_cfg_runs(&s->traits, job->guidance);
    zi_loop c = {.s = s, .job = job, .h = job->height / 16, .w = job->width / 16};
    c.N = c.h * c.w;
    /* img2img and inpainting start at `first` (SD3's get_timesteps, as
     * ZImageImg2ImgPipeline calls it) and step from the scheduler's begin
     * index there. */
    int first = kiln_denoise_first_step(job->steps, job->strength);
    kiln_status st = prepare(&c, use_cfg, sigmas[first], out, err);
    for (int i = first; i < job->steps && !st; i++) {
        if (job->cancelled && job->cancelled(job->user)) {
            st = kiln_err_set(err, KILN_ERR_CANCELLED, "request cancelled");
            break;
        }
        if (job->on_step)
            job->on_step(job->user, i - first);
        float t = kiln_sched_zimage_dit_input(timesteps[i]);
        for (int64_t b = 0; b < job->B; b++)
            c.t[b] = t;
        if (c.x_in.data != out->data)
            kiln_be_copy(be, &c.x_in, out); /* latents.to(transformer dtype) */
        st = forward(&c, job->embeds, c.len, &c.v, err);
        const kiln_tensor *v = &c.v;
        if (!st && use_cfg) {
            /* diffusers runs [cond ; uncond] as one batch; rows never
             * interact, so two forwards give the same rows.  The backend's
             * cfg is neg + g (pos - neg): with the roles swapped and -g it
             * is pos + g (pos - neg), bit for bit (negation is exact). */
            st = forward(&c, job->neg_embeds, c.nlen, &c.v_neg, err);
            kiln_be_cfg(be, &c.v_cfg, &c.v_neg, &c.v, -job->guidance);
            v = &c.v_cfg;
        }
        if (!st && job->preview_at && job->preview_at(job->user, i - first))
            st = preview(&c, out, v, sigmas[i], i - first, err);
        if (!st) {
            /* x + (sigma_next - sigma) * (-out) == x + (sigma - sigma_next) * out
             * exactly: both products are the negation of one rounding. */
            kiln_be_euler_step(be, out, v, sigmas[i] - sigmas[i + 1]);
            st = kiln_be_check(be, err);
        }
        /* ZImageInpaintPipeline: the blend after every step, the image
         * noised to the next sigma (itself after the last step). */
        if (!st && job->mask)
            st = denoise_keep_blend(be, &c.keep, out, sigmas[i + 1], i == job->steps - 1, job->B,
                                    c.N * s->channels, err);
    }
    release(&c, out);
    if (!st && out->dtype != be->act_dtype) {
        /* Handed on in the backend's dtype like klein's latents: the decode
         * starts with latents.to(vae dtype), the same rounding. */
        kiln_tensor act;
        if (!kiln_be_alloc(be, &act, be->act_dtype, 3, out->shape))
            kiln_be_copy(be, &act, out);
        st = kiln_be_check(be, err);
        kiln_be_free(be, out);
        if (!st)
            *out = act;
    }
    if (st)
        kiln_be_free(be, out);
    return st;
}

/* ZImagePipeline draws its noise in fp32 on every backend. */
const kiln_denoise_loop kiln_denoise_loop_zimage = {load, destroy, 1, pack_noise, run};
