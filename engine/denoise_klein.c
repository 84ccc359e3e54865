/* The FLUX.2 klein DiT and denoising loop (the seam's entry is
 * family_klein.c): diffusers' Flux2KleinPipeline.__call__ from the noise to
 * the last latents, with its edit references ([x ; ref] every step), the
 * 9B-kv reference K/V cache (Flux2KleinKVPipeline: the references' K/V
 * extracted on the first step, then cached), classifier-free guidance of
 * the base checkpoints, img2img (FluxImg2ImgPipeline's start) and
 * inpainting (Flux2KleinInpaintPipeline's blend). */
#include <stdlib.h>
#include <string.h>

#include "denoise_internal.h"
#include "models/flux2_dit.h"
#include "models/latents.h"

/* kiln_denoise_stage.dit of a klein checkpoint. */
typedef struct klein_dit {
    kiln_flux2_dit *dit;
    kiln_flux2_kv_cache *kv; /* the 9B-kv pipeline's reference cache, or NULL */
} klein_dit;

static void destroy(void *dit)
{
    klein_dit *m = dit;
    if (!m)
        return;
    kiln_flux2_kv_cache_destroy(m->kv);
    kiln_flux2_dit_destroy(m->dit);
    free(m);
}

static kiln_status load(kiln_denoise_stage *s, const kiln_checkpoint *ck, kiln_precision precision,
                        int *fp8_weights, kiln_err *err)
{
    klein_dit *m = calloc(1, sizeof *m);
    if (!m)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    s->dit = m;
    m->dit = kiln_flux2_dit_load(s->be, ck, err);
    if (!m->dit || (precision == KILN_PRECISION_FP8 &&
                    kiln_flux2_dit_quantize_fp8(m->dit, fp8_weights, err)))
        return err ? err->code : KILN_ERR_INTERNAL;
    s->channels = kiln_flux2_dit_get_config(m->dit)->in_channels;
    if (s->traits.kv_cache) {
        m->kv = kiln_flux2_kv_cache_create(m->dit, err);
        if (!m->kv)
            return err ? err->code : KILN_ERR_INTERNAL;
    }
    return KILN_OK;
}

/* Drawn as latents (B, C, h, w) (spec/pipeline.md section 3), packed to
 * tokens as _pack_latents does. */
static void pack_noise(const kiln_denoise_stage *s, const float *grid, float *out, int64_t B,
                       int64_t h, int64_t w)
{
    kiln_latents_pack(grid, out, B, s->channels, h, w);
}

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
    klein_dit *m = s->dit;
    kiln_backend *be = s->be;
    const kiln_denoise_job *job = c->job;
    kiln_flux2_dit_input in = {.txt = txt, .t = c->t, .txt_ids = c->txt_ids};
    if (s->traits.kv_cache && job->R) {
        if (step == 0) {
            /* Reference tokens first, then the image (spec flux2-klein.md §6). */
            kiln_be_copy_rows(be, &c->x_in, job->R, x, 0, c->N);
            in.x = &c->x_in, in.img_ids = c->ids_refs_first;
            in.kv_mode = KILN_FLUX2_KV_EXTRACT, in.num_ref = job->R, in.kv = m->kv;
        } else {
            in.x = x, in.img_ids = c->img_ids;
            in.kv_mode = KILN_FLUX2_KV_CACHED, in.kv = m->kv;
        }
        return kiln_flux2_dit_forward(m->dit, &in, v_out, err);
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
        if (kiln_flux2_dit_forward(m->dit, &in, &vv, err))
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

/* img2img's image (1, N, C) to the host, and inpainting's mask (N, one a
 * token) over the channels, prepare_mask_latents' repeat. */
static kiln_status image_and_mask(kiln_backend *be, const kiln_denoise_job *job, int64_t N,
                                  int64_t C, float *img, denoise_keep *keep, kiln_err *err)
{
    kiln_be_download(be, job->init_tokens, img);
    if (kiln_be_check(be, err))
        return err ? err->code : KILN_ERR_INTERNAL;
    if (!keep)
        return KILN_OK;
    if (!(keep->mask = malloc((size_t)(N * C) * sizeof *keep->mask)))
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (int64_t t = 0; t < N; t++)
        for (int64_t c = 0; c < C; c++)
            keep->mask[t * C + c] = job->mask[t];
    return KILN_OK;
}

static kiln_status run(kiln_denoise_stage *s, const kiln_denoise_job *job, kiln_tensor *out,
                       kiln_err *err)
{
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
    int first = kiln_denoise_first_step(job->steps, job->strength);
    /* img2img's start; inpainting keeps the noise and the image for its
     * blends. */
    denoise_keep keep = {0};
    if (!st && job->strength > 0) {
        float *img = malloc((size_t)(N * C) * sizeof *img);
        st = img ? image_and_mask(be, job, N, C, img, job->mask ? &keep : NULL, err)
                 : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        if (!st)
            st = denoise_start(x0, img, 1, sigmas[first], B, N * C, job->mask ? &keep : NULL, err);
        free(img);
    }
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
                st = denoise_keep_blend(be, &keep, &x0_est, 0.0f, 1, B, N * C, err);
            if (!st)
                st = job->on_preview(job->user, i - first, &x0_est, err);
        }
        if (!st) {
            kiln_be_euler_step(be, out, &c.v, sigmas[i + 1] - sigmas[i]);
            st = kiln_be_check(be, err);
        }
        if (!st && job->mask)
            st = denoise_keep_blend(be, &keep, out, sigmas[i + 1], i == job->steps - 1, B, N * C,
                                    err);
    }
    denoise_keep_free(&keep);
    kiln_be_free(be, &x0_est);
    release(&c);
    if (st)
        kiln_be_free(be, out);
    return st;
}

/* klein draws its noise in the pipeline dtype (spec/pipeline.md section 3). */
const kiln_denoise_loop kiln_denoise_loop_klein = {load, destroy, 0, pack_noise, run};
