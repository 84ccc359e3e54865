/* The denoise stage's family-free part: the stage's life, the job's
 * checks, the initial noise; each family's DiT and loop sits behind the
 * seam (family_stages.h: denoise_klein.c, denoise_zimage.c). */
#include "denoise_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "models/rng.h"

int kiln_precision_parse(const char *s, kiln_precision *out)
{
    if (!strcmp(s, "exact"))
        *out = KILN_PRECISION_EXACT;
    else if (!strcmp(s, "fp8"))
        *out = KILN_PRECISION_FP8;
    else
        return -1;
    return 0;
}

const char *kiln_precision_name(kiln_precision p)
{
    return p == KILN_PRECISION_FP8 ? "fp8" : "exact";
}

static void log_precision(kiln_precision precision, int fp8_weights)
{
    if (precision == KILN_PRECISION_FP8)
        KILN_LOG_INFO("denoise: fp8 mode: %d transformer block weights in E4M3", fp8_weights);
}

kiln_denoise_stage *kiln_denoise_stage_create(kiln_backend *be, const kiln_checkpoint *ck,
                                              kiln_err *err)
{
    return kiln_denoise_stage_create_at(be, ck, KILN_PRECISION_EXACT, err);
}

kiln_denoise_stage *kiln_denoise_stage_create_at(kiln_backend *be, const kiln_checkpoint *ck,
                                                 kiln_precision precision, kiln_err *err)
{
    kiln_denoise_stage *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    int fp8 = 0;
    const cJSON *sched_json = kiln_checkpoint_config(ck, "scheduler", err);
    if (!sched_json || kiln_sched_config_parse(sched_json, &s->sched, err))
        goto fail;
    s->traits = kiln_model_traits_of(ck);
    s->family = kiln_family_stages_of(ck);
    s->loop = s->family->denoise;
    if (s->loop->load(s, ck, precision, &fp8, err))
        goto fail;
    log_precision(precision, fp8);
    return s;
fail:
    kiln_denoise_stage_destroy(s);
    return NULL;
}

void kiln_denoise_stage_destroy(kiln_denoise_stage *s)
{
    if (!s)
        return;
    if (s->loop)
        s->loop->destroy(s->dit);
    free(s);
}

kiln_model_traits kiln_denoise_stage_traits(const kiln_denoise_stage *s) { return s->traits; }

int64_t kiln_denoise_stage_channels(const kiln_denoise_stage *s) { return s->channels; }

int64_t kiln_denoise_stage_image_channels(const kiln_denoise_stage *s)
{
    return s->channels * s->family->image_moments;
}

int64_t kiln_denoise_stage_mask_len(const kiln_denoise_stage *s, int width, int height)
{
    int cell = s->family->mask_cell;
    return (int64_t)(width / cell) * (height / cell);
}

/* Draws n values of every row into out (B rows of n), row b from seeds[b]
 * (batch_noise: all rows from seeds[0]), each generator first skipping
 * `skip` values (a sample draw that came first) into skipped when given. */
static kiln_status draw_rows(const kiln_denoise_job *job, kiln_dtype dt, size_t skip,
                             float *skipped, float *out, size_t n, kiln_err *err)
{
    kiln_rng *g = kiln_rng_create(job->seeds[0], err);
    if (!g)
        return err ? err->code : KILN_ERR_NOMEM;
    float *tmp = skip && !skipped ? malloc(skip * sizeof *tmp) : NULL;
    kiln_status st = skip && !skipped && !tmp
                         ? kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for the draws")
                         : KILN_OK;
    int64_t rows = job->batch_noise ? 1 : job->B;
    for (int64_t b = 0; b < rows && !st; b++) {
        kiln_rng_seed(g, job->seeds[b]);
        if (skip)
            st = kiln_randn(g, skipped ? skipped + skip * (size_t)b : tmp, skip, dt, err);
        if (!st)
            st = kiln_randn(g, out + n * (size_t)b, job->batch_noise ? n * (size_t)job->B : n,
                            dt, err);
    }
    /* One sample draw serves every row when one generator drew it. */
    for (int64_t b = 1; !st && skipped && job->batch_noise && b < job->B; b++)
        memcpy(skipped + skip * (size_t)b, skipped, skip * sizeof *skipped);
    free(tmp);
    kiln_rng_destroy(g);
    return st;
}

kiln_status denoise_draw(const kiln_denoise_stage *s, const kiln_denoise_job *job, float *eps,
                         float *noise, kiln_err *err)
{
    int64_t h = job->height / 16, w = job->width / 16, c = s->channels;
    size_t per_row = (size_t)(c * h * w);
    size_t skip = s->family->image_moments == 2 && job->init_tokens ? per_row : 0;
    /* The family's rule: klein draws in the pipeline dtype, Z-Image's
     * text-to-image always in fp32 (spec/pipeline.md section 3,
     * z-image-turbo.md §4 item 2); ZImageImg2ImgPipeline and
     * ZImageInpaintPipeline draw the sample in the VAE's dtype and the
     * noise in the prompt's, the pipeline dtype both. */
    kiln_dtype dt = s->be->act_dtype == KILN_BF16 && !job->fp32_noise &&
                            (!s->loop->noise_fp32 || skip)
                        ? KILN_BF16
                        : KILN_F32;
    float *grid = malloc(per_row * (size_t)job->B * sizeof *grid);
    float *grid_eps = skip && eps ? malloc(per_row * (size_t)job->B * sizeof *grid_eps) : NULL;
    kiln_status st = !grid || (skip && eps && !grid_eps)
                         ? kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for the initial noise")
                         : draw_rows(job, dt, skip, grid_eps, grid, per_row, err);
    if (!st)
        s->loop->pack_noise(s, grid, noise, job->B, h, w);
    if (!st && grid_eps)
        s->loop->pack_noise(s, grid_eps, eps, job->B, h, w);
    free(grid), free(grid_eps);
    return st;
}

kiln_status kiln_denoise_noise(const kiln_denoise_stage *s, const kiln_denoise_job *job,
                               float *out, kiln_err *err)
{
    return denoise_draw(s, job, NULL, out, err);
}

kiln_status denoise_start(float *x, const float *img, int64_t img_rows, float sigma, int64_t B,
                          int64_t NC, denoise_keep *keep, kiln_err *err)
{
    if (keep) {
        size_t all = (size_t)(B * NC) * sizeof(float);
        keep->noise = malloc(all);
        keep->img = malloc((size_t)(img_rows * NC) * sizeof(float));
        keep->host = malloc(all);
        if (!keep->noise || !keep->img || !keep->host)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        memcpy(keep->noise, x, all);
        memcpy(keep->img, img, (size_t)(img_rows * NC) * sizeof(float));
        keep->img_rows = img_rows;
    }
    for (int64_t b = 0; b < B; b++) {
        const float *im = img + (img_rows > 1 ? b * NC : 0);
        for (int64_t k = 0; k < NC; k++)
            x[b * NC + k] = sigma * x[b * NC + k] + (1.0f - sigma) * im[k];
    }
    return KILN_OK;
}

kiln_status denoise_keep_blend(kiln_backend *be, const denoise_keep *k, kiln_tensor *x,
                               float sigma, int last, int64_t B, int64_t NC, kiln_err *err)
{
    kiln_be_download(be, x, k->host);
    if (kiln_be_check(be, err))
        return err ? err->code : KILN_ERR_INTERNAL;
    for (int64_t b = 0; b < B; b++) {
        const float *im = k->img + (k->img_rows > 1 ? b * NC : 0);
        for (int64_t i = 0; i < NC; i++) {
            size_t j = (size_t)(b * NC + i);
            float m = k->mask[i];
            float kept = last ? im[i] : sigma * k->noise[j] + (1.0f - sigma) * im[i];
            k->host[j] = (1.0f - m) * kept + m * k->host[j];
        }
    }
    kiln_be_upload(be, x, k->host, KILN_F32);
    return kiln_be_check(be, err);
}

void denoise_keep_free(denoise_keep *k)
{
    free(k->noise), free(k->img), free(k->mask), free(k->host);
    memset(k, 0, sizeof *k);
}

static kiln_status check_job(const kiln_denoise_stage *s, const kiln_denoise_job *job,
                             kiln_err *err)
{
    if (job->B < 1 || !job->seeds || !job->embeds || job->embeds->ndim != 3 ||
        job->embeds->shape[0] != job->B)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: bad batch or embeddings");
    if (job->width < 16 || job->height < 16 || job->width % 16 || job->height % 16)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: size must be a multiple of 16");
    if (job->steps < 1 || job->steps > KILN_SCHED_MAX_STEPS)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: bad step count %d", job->steps);
    if (job->R && (!job->ref_tokens || !job->ref_ids || job->ref_tokens->ndim != 3 ||
                   job->ref_tokens->shape[1] != job->R || job->ref_tokens->shape[2] != s->channels))
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: bad reference tokens");
    if (job->strength != 0 &&
        (!(job->strength > 0 && job->strength <= 1) || !job->init_tokens ||
         job->init_tokens->ndim != 3 || job->init_tokens->shape[0] != 1 ||
         job->init_tokens->shape[1] != (int64_t)(job->width / 16) * (job->height / 16) ||
         job->init_tokens->shape[2] != kiln_denoise_stage_image_channels(s) ||
         job->latents_in))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: img2img needs strength in (0, 1] and the image's (1, N, %lld) "
                            "tokens at the output size",
                            (long long)kiln_denoise_stage_image_channels(s));
    if (job->mask && (!(job->strength > 0) || s->traits.kv_cache))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: inpainting needs a strength, and no reference K/V cache");
    if (job->preview_at && !job->on_preview)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: preview_at without on_preview");
    if (job->strength > 0 && kiln_denoise_first_step(job->steps, job->strength) >= job->steps)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: strength %g leaves none of the %d steps to run",
                            job->strength, job->steps);
    if (kiln_model_cfg_runs(&s->traits, job->guidance) &&
        (!job->neg_embeds || job->neg_embeds->ndim != 3 ||
         memcmp(job->neg_embeds->shape, job->embeds->shape, sizeof job->embeds->shape)))
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: CFG needs negative embeddings");
    if (s->traits.no_references && job->R)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: %s takes no reference images",
                            s->family->title);
    return KILN_OK;
}

int kiln_denoise_first_step(int steps, double strength)
{
    return kiln_request_first_step(steps, strength);
}

void kiln_denoise_job_image(const kiln_denoise_stage *s, kiln_denoise_job *job,
                            const kiln_tensor *tokens, const int32_t *ids, int64_t R,
                            double strength, const float *mask)
{
    job->ref_tokens = tokens, job->ref_ids = ids, job->R = tokens ? R : 0;
    if (!tokens || !(strength > 0))
        return;
    job->init_tokens = tokens, job->strength = strength;
    job->mask = mask;
    /* img2img: the one image is the start, not a reference; inpainting
     * keeps it as the reference too where the family conditions on it
     * (Flux2KleinInpaintPipeline; ZImageInpaintPipeline does not). */
    if (!mask || s->traits.no_references)
        job->ref_tokens = NULL, job->ref_ids = NULL, job->R = 0;
}

void kiln_denoise_expand_rows(kiln_backend *be, kiln_tensor *dst, int64_t row0,
                              const kiln_tensor *src, int64_t rows, int n)
{
    size_t row = kiln_tensor_nbytes(src) / (size_t)src->shape[0];
    for (int64_t b = 0; b < rows; b++) {
        kiln_tensor d = *dst, s = *src;
        d.shape[0] = s.shape[0] = 1;
        d.data = (char *)dst->data + (size_t)(row0 + b) * row;
        s.data = (char *)src->data + (size_t)kiln_plan_row_prompt(b, n) * row;
        kiln_be_copy(be, &d, &s);
    }
}

kiln_status kiln_denoise_run(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                             kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (check_job(s, job, err))
        return err ? err->code : KILN_ERR_INVALID;
    return s->loop->run(s, job, out, err);
}
