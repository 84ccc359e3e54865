/* The denoise stage's family dispatch and the FLUX.2 klein loop; the
 * Z-Image loop is in denoise_zimage.c. */
#include "denoise_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "models/latents.h"
#include "models/rng.h"
#include "models/scheduler.h"

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
    s->family = kiln_family_of(ck)->id;
    if (s->family == KILN_FAMILY_ZIMAGE) {
        s->zdit = kiln_zimage_dit_load(be, ck, err);
        if (!s->zdit ||
            (precision == KILN_PRECISION_FP8 && kiln_zimage_dit_quantize_fp8(s->zdit, &fp8, err)))
            goto fail;
        s->channels = kiln_zimage_dit_get_config(s->zdit)->patch_features;
        log_precision(precision, fp8);
        return s;
    }
    s->dit = kiln_flux2_dit_load(be, ck, err);
    if (!s->dit ||
        (precision == KILN_PRECISION_FP8 && kiln_flux2_dit_quantize_fp8(s->dit, &fp8, err)))
        goto fail;
    log_precision(precision, fp8);
    s->channels = kiln_flux2_dit_get_config(s->dit)->in_channels;
    if (s->traits.kv_cache) {
        s->kv = kiln_flux2_kv_cache_create(s->dit, err);
        if (!s->kv)
            goto fail;
    }
    return s;
fail:
    kiln_denoise_stage_destroy(s);
    return NULL;
}

void kiln_denoise_stage_destroy(kiln_denoise_stage *s)
{
    if (!s)
        return;
    kiln_flux2_kv_cache_destroy(s->kv);
    kiln_flux2_dit_destroy(s->dit);
    kiln_zimage_dit_destroy(s->zdit);
    free(s);
}

kiln_model_traits kiln_denoise_stage_traits(const kiln_denoise_stage *s) { return s->traits; }

int64_t kiln_denoise_stage_channels(const kiln_denoise_stage *s) { return s->channels; }

kiln_status kiln_denoise_noise(const kiln_denoise_stage *s, const kiln_denoise_job *job,
                               float *out, kiln_err *err)
{
    int64_t h = job->height / 16, w = job->width / 16, c = s->channels;
    int zimage = s->family == KILN_FAMILY_ZIMAGE;
    size_t per_row = (size_t)(c * h * w);
    /* klein draws in the pipeline dtype, Z-Image always in fp32
     * (spec/pipeline.md section 3, z-image-turbo.md §4 item 2). */
    kiln_dtype dt = s->be->act_dtype == KILN_BF16 && !job->fp32_noise && !zimage ? KILN_BF16
                                                                                  : KILN_F32;
    float *grid = malloc(per_row * (size_t)job->B * sizeof *grid);
    if (!grid)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for the initial noise");
    kiln_status st = KILN_OK;
    kiln_rng *g = kiln_rng_create(job->seeds[0], err);
    if (!g) {
        free(grid);
        return err ? err->code : KILN_ERR_NOMEM;
    }
    if (job->batch_noise) {
        st = kiln_randn(g, grid, per_row * (size_t)job->B, dt, err);
    } else {
        for (int64_t b = 0; b < job->B && !st; b++) {
            kiln_rng_seed(g, job->seeds[b]);
            st = kiln_randn(g, grid + per_row * (size_t)b, per_row, dt, err);
        }
    }
    kiln_rng_destroy(g);
    if (!st && zimage) {
        /* drawn as latents (B, C, 2h, 2w), handed on as the DiT's tokens */
        const kiln_zimage_dit_config *zc = kiln_zimage_dit_get_config(s->zdit);
        kiln_latents_zimage_patchify(grid, out, job->B, zc->in_channels, zc->patch, h, w);
    } else if (!st) {
        kiln_latents_pack(grid, out, job->B, c, h, w);
    }
    free(grid);
    return st;
}

static int first_step(const kiln_denoise_job *job);

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
         job->init_tokens->shape[2] != s->channels || job->latents_in))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: img2img needs strength in (0, 1] and the image's (1, N, C) "
                            "tokens at the output size");
    if (job->mask && (!(job->strength > 0) || s->traits.kv_cache))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: inpainting needs a strength, and no reference K/V cache");
    if (job->preview_at && !job->on_preview)
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: preview_at without on_preview");
    if (job->strength > 0 && first_step(job) >= job->steps)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: strength %g leaves none of the %d steps to run",
                            job->strength, job->steps);
    if (kiln_model_cfg_runs(&s->traits, job->guidance) &&
        (!job->neg_embeds || job->neg_embeds->ndim != 3 ||
         memcmp(job->neg_embeds->shape, job->embeds->shape, sizeof job->embeds->shape)))
        return kiln_err_set(err, KILN_ERR_INVALID, "denoise: CFG needs negative embeddings");
    if (s->zdit && (job->R || job->strength != 0))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "denoise: Z-Image takes no reference or img2img image");
    return KILN_OK;
}

/* Tokens per DiT forward (DENOISE_PASS_TOKENS, denoise_internal.h).  The
 * DiT's activations grow with rows x tokens (about 140 KB a token for klein-4B, 640 MB for a 1024x1024 row), and a
 * 1024x1024 row (4608 tokens) already fills the GPU, so a batch of large
 * images runs a row at a time (small ones still together): the service's
 * peak memory stays that of one row while its batches keep their queueing
 * benefit.  Rows never interact in the DiT. */

/* Per-forward state shared by the steps of one run. */
typedef struct loop_ctx {
    kiln_denoise_stage *s;
    const kiln_denoise_job *job;
    int64_t N, T;
    int32_t *img_ids, *txt_ids, *ids_with_refs, *ids_refs_first;
    kiln_tensor x_in; /* [x ; ref] (plain edits) or [ref ; x] (KV extract) */
    kiln_tensor v_all, v, v_neg;
    float *t;
} loop_ctx;

static kiln_status forward(loop_ctx *c, const kiln_tensor *txt, int step, kiln_tensor *x,
                           kiln_tensor *v_out, kiln_err *err)
{
    kiln_denoise_stage *s = c->s;
    kiln_backend *be = s->be;
    const kiln_denoise_job *job = c->job;
    kiln_flux2_dit_input in = {.txt = txt, .t = c->t, .txt_ids = c->txt_ids};
    if (s->traits.kv_cache && job->R) {
        if (step == 0) {
            /* Reference tokens first, then the image (spec flux2-klein.md §6). */
            kiln_be_copy_rows(be, &c->x_in, job->R, x, 0, c->N);
            in.x = &c->x_in, in.img_ids = c->ids_refs_first;
            in.kv_mode = KILN_FLUX2_KV_EXTRACT, in.num_ref = job->R, in.kv = s->kv;
        } else {
            in.x = x, in.img_ids = c->img_ids;
            in.kv_mode = KILN_FLUX2_KV_CACHED, in.kv = s->kv;
        }
        return kiln_flux2_dit_forward(s->dit, &in, v_out, err);
    }
    /* Plain generation, or a plain edit: [x ; ref] every step, the
     * reference rows of the output dropped. */
    const kiln_tensor *xs = x, *vs = v_out;
    if (job->R) {
        kiln_be_copy_rows(be, &c->x_in, 0, x, 0, c->N);
        xs = &c->x_in, vs = &c->v_all;
    }
    int64_t B = x->shape[0], tokens = c->T + c->N + job->R;
    int64_t per = DENOISE_PASS_TOKENS / tokens > 1 ? DENOISE_PASS_TOKENS / tokens : 1;
    in.img_ids = job->R ? c->ids_with_refs : c->img_ids;
    for (int64_t b0 = 0; b0 < B; b0 += per) {
        int64_t n = B - b0 < per ? B - b0 : per;
        kiln_tensor xv = kiln_tensor_batch_view(xs, b0, n);
        kiln_tensor tv = kiln_tensor_batch_view(txt, b0, n);
        kiln_tensor vv = kiln_tensor_batch_view(vs, b0, n);
        in.x = &xv, in.txt = &tv, in.t = c->t + b0;
        if (kiln_flux2_dit_forward(s->dit, &in, &vv, err))
            return err ? err->code : KILN_ERR_INTERNAL;
    }
    if (job->R)
        kiln_be_copy_rows(be, v_out, 0, &c->v_all, 0, c->N);
    return kiln_be_check(be, err);
}

static kiln_status prepare(loop_ctx *c, kiln_err *err)
{
    kiln_denoise_stage *s = c->s;
    kiln_backend *be = s->be;
    const kiln_denoise_job *job = c->job;
    int64_t B = job->B, N = c->N, R = job->R, C = s->channels, T = c->T;
    c->img_ids = malloc((size_t)N * 4 * sizeof(int32_t));
    c->txt_ids = malloc((size_t)T * 4 * sizeof(int32_t));
    c->ids_with_refs = malloc((size_t)(N + R) * 4 * sizeof(int32_t));
    c->ids_refs_first = malloc((size_t)(N + R) * 4 * sizeof(int32_t));
    c->t = malloc((size_t)B * sizeof(float));
    if (!c->img_ids || !c->txt_ids || !c->ids_with_refs || !c->ids_refs_first || !c->t)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_latents_image_ids(c->img_ids, job->height / 16, job->width / 16);
    kiln_latents_text_ids(c->txt_ids, T);
    memcpy(c->ids_with_refs, c->img_ids, (size_t)N * 4 * sizeof(int32_t));
    if (R) {
        memcpy(c->ids_with_refs + N * 4, job->ref_ids, (size_t)R * 4 * sizeof(int32_t));
        memcpy(c->ids_refs_first, job->ref_ids, (size_t)R * 4 * sizeof(int32_t));
        memcpy(c->ids_refs_first + R * 4, c->img_ids, (size_t)N * 4 * sizeof(int32_t));
        int64_t shape[] = {B, N + R, C};
        if (kiln_be_alloc(be, &c->x_in, be->act_dtype, 3, shape) ||
            (!s->traits.kv_cache && kiln_be_alloc(be, &c->v_all, be->act_dtype, 3, shape)))
            return kiln_be_check(be, err);
        /* The reference rows never change during the loop: place them once. */
        int64_t ref_row = s->traits.kv_cache ? 0 : N;
        for (int64_t b = 0; b < B; b++) {
            kiln_tensor row = kiln_tensor_batch_view(&c->x_in, b, 1);
            kiln_be_copy_rows(be, &row, ref_row, job->ref_tokens, 0, R);
        }
    }
    int64_t vshape[] = {B, N, C};
    kiln_be_alloc(be, &c->v, be->act_dtype, 3, vshape);
    if (kiln_model_cfg_runs(&s->traits, job->guidance))
        kiln_be_alloc(be, &c->v_neg, be->act_dtype, 3, vshape);
    return kiln_be_check(be, err);
}

static void release(loop_ctx *c)
{
    kiln_backend *be = c->s->be;
    free(c->img_ids), free(c->txt_ids), free(c->ids_with_refs), free(c->ids_refs_first);
    free(c->t);
    kiln_be_free(be, &c->x_in), kiln_be_free(be, &c->v_all);
    kiln_be_free(be, &c->v), kiln_be_free(be, &c->v_neg);
}

int kiln_denoise_first_step(int steps, double strength)
{
    return kiln_request_first_step(steps, strength);
}

static int first_step(const kiln_denoise_job *job)
{
    return kiln_denoise_first_step(job->steps, job->strength);
}

void kiln_denoise_job_image(kiln_denoise_job *job, const kiln_tensor *tokens,
                            const int32_t *ids, int64_t R, double strength, const float *mask)
{
    job->ref_tokens = tokens, job->ref_ids = ids, job->R = tokens ? R : 0;
    if (!tokens || !(strength > 0))
        return;
    job->init_tokens = tokens, job->strength = strength;
    if (mask) /* inpainting: the image is the start and the reference */
        job->mask = mask;
    else /* img2img: the one image is the start, not a reference */
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

/* Inpainting's blend after a step (prepare_mask_latents' mask over the
 * channels): x = (1 - m) x (sigma x noise + (1 - sigma) x image) + m x x,
 * with sigma the next step's (0 after the last: the image itself), on the
 * host in fp32 as scale_noise and the blend compute it. */
static kiln_status blend_kept(kiln_backend *be, kiln_tensor *x, const float *noise,
                              const float *img, const float *mask, float sigma, int last,
                              int64_t B, int64_t N, int64_t C, float *host, kiln_err *err)
{
    kiln_be_download(be, x, host);
    if (kiln_be_check(be, err))
        return err ? err->code : KILN_ERR_INTERNAL;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < N; t++) {
            float m = mask[t];
            for (int64_t c = 0; c < C; c++) {
                size_t k = (size_t)((b * N + t) * C + c);
                float keep = last ? img[t * C + c]
                                  : sigma * noise[k] + (1.0f - sigma) * img[t * C + c];
                host[k] = (1.0f - m) * keep + m * host[k];
            }
        }
    kiln_be_upload(be, x, host, KILN_F32);
    return kiln_be_check(be, err);
}

/* img2img's starting latents: diffusers' FlowMatchEulerDiscreteScheduler
 * scale_noise, sigma * noise + (1 - sigma) * image, per row, on the host
 * in fp32 (x holds the noise, B rows of N x C). */
static kiln_status noise_image(kiln_backend *be, const kiln_tensor *init, float sigma, float *x,
                               int64_t B, int64_t NC, kiln_err *err)
{
    float *img = malloc((size_t)NC * sizeof *img);
    if (!img)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_be_download(be, init, img);
    kiln_status st = kiln_be_check(be, err);
    for (int64_t b = 0; b < B && !st; b++)
        for (int64_t k = 0; k < NC; k++)
            x[b * NC + k] = sigma * x[b * NC + k] + (1.0f - sigma) * img[k];
    free(img);
    return st;
}

kiln_status kiln_denoise_run(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                             kiln_err *err)
{
    memset(out, 0, sizeof *out);
    if (check_job(s, job, err))
        return err ? err->code : KILN_ERR_INVALID;
    if (s->zdit)
        return denoise_zimage_run(s, job, out, err);
    kiln_backend *be = s->be;
    int64_t B = job->B, C = s->channels;
    int64_t N = (int64_t)(job->height / 16) * (job->width / 16);
    float sigmas[KILN_SCHED_MAX_STEPS + 1], timesteps[KILN_SCHED_MAX_STEPS];
    double mu;
    /* mu counts image tokens only, never reference tokens (pipeline.md §5). */
    if (kiln_sched_flux2(&s->sched, N, job->steps, sigmas, timesteps, &mu, err))
        return err ? err->code : KILN_ERR_INVALID;

    loop_ctx c = {.s = s, .job = job, .N = N, .T = job->embeds->shape[1]};
    float *x0 = malloc((size_t)(B * N * C) * sizeof *x0);
    if (!x0) {
        release(&c);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    kiln_status st = KILN_OK;
    if (job->latents_in)
        memcpy(x0, job->latents_in, (size_t)(B * N * C) * sizeof *x0);
    else
        st = kiln_denoise_noise(s, job, x0, err);
    /* img2img starts at `first`: its sigma noises the image, and the
     * remaining steps take their own timesteps and sigmas, as diffusers'
     * FluxImg2ImgPipeline and Flux2KleinInpaintPipeline step them from the
     * scheduler's begin index.  (An unreleased Flux2KleinImg2ImgPipeline
     * draft, diffusers 4369be3, resets that index to 0 before its loop,
     * stepping with the schedule's first sigmas while the model sees the
     * later timesteps; kiln does not follow it.) */
    int first = first_step(job);
    /* Inpainting keeps the noise and the image for its blends. */
    float *keep_noise = NULL, *keep_img = NULL, *host_x = NULL;
    if (!st && job->mask) {
        keep_noise = malloc((size_t)(B * N * C) * sizeof *keep_noise);
        keep_img = malloc((size_t)(N * C) * sizeof *keep_img);
        host_x = malloc((size_t)(B * N * C) * sizeof *host_x);
        if (!keep_noise || !keep_img || !host_x)
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        else {
            memcpy(keep_noise, x0, (size_t)(B * N * C) * sizeof *x0);
            kiln_be_download(be, job->init_tokens, keep_img);
            st = kiln_be_check(be, err);
        }
    }
    if (!st && job->strength > 0)
        st = noise_image(be, job->init_tokens, sigmas[first], x0, B, N * C, err);
    if (!st)
        st = prepare(&c, err);
    if (!st && kiln_be_from_host(be, out, 3, (int64_t[]){B, N, C}, x0, KILN_F32))
        st = kiln_be_check(be, err);
    free(x0);
    int use_cfg = kiln_model_cfg_runs(&s->traits, job->guidance);
    kiln_tensor x0_est = {0}; /* previews' estimate, allocated on the first */
    for (int i = first; i < job->steps && !st; i++) {
        if (job->cancelled && job->cancelled(job->user)) {
            st = kiln_err_set(err, KILN_ERR_CANCELLED, "request cancelled");
            break;
        }
        if (job->on_step)
            job->on_step(job->user, i - first);
        float t = kiln_sched_flux2_dit_time(timesteps[i], be->act_dtype);
        for (int64_t b = 0; b < B; b++)
            c.t[b] = t;
        st = forward(&c, job->embeds, i - first, out, &c.v, err);
        if (!st && use_cfg) {
            /* diffusers runs the negative prompt as a second forward with the
             * same latents; the KV cache is filled by the first one. */
            st = forward(&c, job->neg_embeds, s->traits.kv_cache ? 1 : i - first, out, &c.v_neg,
                         err);
            kiln_be_cfg(be, &c.v, &c.v, &c.v_neg, job->guidance);
        }
        if (!st && job->preview_at && job->preview_at(job->user, i - first)) {
            /* x0 = x - sigma v: the Euler step to sigma 0 on a copy; with a
             * mask the kept region is blended in as after the last step. */
            if (!x0_est.data)
                kiln_be_alloc(be, &x0_est, out->dtype, 3, out->shape);
            kiln_be_copy(be, &x0_est, out);
            kiln_be_euler_step(be, &x0_est, &c.v, 0.0f - sigmas[i]);
            st = kiln_be_check(be, err);
            if (!st && job->mask)
                st = blend_kept(be, &x0_est, keep_noise, keep_img, job->mask, 0.0f, 1, B, N, C,
                                host_x, err);
            if (!st)
                st = job->on_preview(job->user, i - first, &x0_est, err);
        }
        if (!st) {
            kiln_be_euler_step(be, out, &c.v, sigmas[i + 1] - sigmas[i]);
            st = kiln_be_check(be, err);
        }
        if (!st && job->mask)
            st = blend_kept(be, out, keep_noise, keep_img, job->mask, sigmas[i + 1],
                            i == job->steps - 1, B, N, C, host_x, err);
    }
    free(keep_noise), free(keep_img), free(host_x);
    kiln_be_free(be, &x0_est);
    release(&c);
    if (st)
        kiln_be_free(be, out);
    return st;
}
