/* kiln-denoiser: the DiT loop of the checkpoint's family
 * (engine/denoise_stage.h) over embeddings from kiln-encoder (with each
 * prompt's token count), producing latents for kiln-decoder.
 *
 * Rows are in the request plan's layout (engine/plan.h), as `kiln
 * generate` lays them out: prompt-major, row b of a job is prompt b / n and
 * uses seeds[b]; under CFG the single negative embedding is on every row
 * (the gateway sends `neg` exactly when the plan runs CFG).  Jobs of the same
 * size, steps, guidance and text length, without references and without
 * batch_noise (whose single draw depends on the whole batch), run as one
 * batch: the engine treats rows independently, so each job's latents are
 * the bytes it gets alone.
 *
 * A job with `previews` (a streamed request's partial_images) gets a
 * `partial` with its rows of the estimate of the clean latents at each of
 * its preview steps (kiln_sched_preview_steps of the steps that run;
 * engine/denoise_stage.h on_preview), sent at once while the run goes on;
 * the latents the job ends with are the same bytes either way. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/denoise_stage.h"
#include "models/scheduler.h"
#include "services/common/worker.h"

typedef struct den_state {
    kiln_backend *be;
    kiln_denoise_stage *den;
} den_state;

static void *den_load(kiln_backend *be, const kiln_checkpoint *ck, const kiln_worker_opts *o,
                      kiln_err *err)
{
    den_state *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    s->den = kiln_denoise_stage_create_at(be, ck, o->precision, err);
    if (!s->den) {
        free(s);
        return NULL;
    }
    return s;
}

static void den_unload(void *state)
{
    den_state *s = state;
    kiln_denoise_stage_destroy(s->den);
    free(s);
}

static int den_rows(const kiln_msg_job *j) { return j->denoise.n_seeds; }

static int den_compatible(const kiln_msg_job *head, const kiln_msg_job *j)
{
    const kiln_job_denoise *a = &head->denoise, *b = &j->denoise;
    const kiln_tensor_ref *ea = kiln_ref_map_get(&head->in, "embeds");
    const kiln_tensor_ref *eb = kiln_ref_map_get(&j->in, "embeds");
    return a->width == b->width && a->height == b->height && a->steps == b->steps &&
           !memcmp(&a->guidance, &b->guidance, sizeof a->guidance) && !a->batch_noise &&
           !b->batch_noise && !kiln_ref_map_get(&head->in, "ref_tokens") &&
           !kiln_ref_map_get(&j->in, "ref_tokens") &&
           !kiln_ref_map_get(&head->in, "neg") == !kiln_ref_map_get(&j->in, "neg") && ea && eb &&
           ea->dtype == eb->dtype && ea->ndim == 3 && eb->ndim == 3 &&
           ea->shape[1] == eb->shape[1] && ea->shape[2] == eb->shape[2];
}

/* One job's inputs, checked against its parameters. */
typedef struct prep {
    kiln_worker_job *job;
    kiln_tensor emb, neg, ref_tokens;
    const int32_t *ref_ids;
    int64_t R;
    /* real tokens per prompt row (the encoder's), copied: an input
     * fetched by value need not be 4-byte aligned */
    int txt_len[KILN_PROTO_MAX_PROMPTS], neg_len[1];
    int has_neg_len;
    const float *mask; /* inpainting: N floats from the encoder, else NULL */
} prep;

/* An I32 vector input of n entries (txt_len and neg_len). */
static kiln_status lens_input(kiln_worker *w, prep *p, const char *name, int64_t n, int *out,
                              kiln_err *err)
{
    const kiln_tensor_ref *ref;
    const void *data;
    if (kiln_worker_input_host(w, p->job, name, 1, &ref, &data, err))
        return kiln_err_wrap(err, "the encoder's token count of each prompt is missing");
    if (ref->dtype != KILN_I32 || ref->ndim != 1 || ref->shape[0] != n ||
        n > KILN_PROTO_MAX_PROMPTS)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s must be (%lld) I32", name, (long long)n);
    memcpy(out, data, (size_t)n * sizeof *out);
    return KILN_OK;
}

static kiln_status prepare(const den_state *s, kiln_worker *w, prep *p, kiln_err *err)
{
    const kiln_job_denoise *d = &kiln_worker_job_msg(p->job)->denoise;
    if (kiln_worker_input(w, p->job, "embeds", 1, &p->emb, err))
        return err->code;
    if (p->emb.ndim != 3 || p->emb.shape[0] * d->n != d->n_seeds)
        return kiln_err_set(err, KILN_ERR_INVALID, "embeds must be (P, T, J) with P * n = %d rows",
                            d->n_seeds);
    /* The gateway's plan sends the negative prompt's embedding exactly
     * when CFG runs; the denoise stage refuses a CFG job without it. */
    if (kiln_worker_input(w, p->job, "neg", 0, &p->neg, err))
        return err->code;
    if (p->neg.data && (p->neg.ndim != 3 || p->neg.shape[0] != 1 ||
                        p->neg.shape[1] != p->emb.shape[1] || p->neg.shape[2] != p->emb.shape[2]))
        return kiln_err_set(err, KILN_ERR_INVALID, "neg must be (1, T, J) like embeds");
    /* Each row's real tokens, for DiTs that read only those (Z-Image);
     * an encoder always sends them. */
    p->has_neg_len = p->neg.data != NULL;
    if (lens_input(w, p, "txt_len", p->emb.shape[0], p->txt_len, err) ||
        (p->neg.data && lens_input(w, p, "neg_len", 1, p->neg_len, err)))
        return err->code;
    if (kiln_worker_input(w, p->job, "ref_tokens", 0, &p->ref_tokens, err))
        return err->code;
    if (!p->ref_tokens.data)
        return KILN_OK;
    const kiln_tensor_ref *ids_ref;
    const void *ids;
    if (kiln_worker_input_host(w, p->job, "ref_ids", 1, &ids_ref, &ids, err))
        return err->code;
    if (p->ref_tokens.ndim != 3 || p->ref_tokens.shape[0] != 1 || ids_ref->dtype != KILN_I32 ||
        ids_ref->ndim != 2 || ids_ref->shape[0] != p->ref_tokens.shape[1] || ids_ref->shape[1] != 4)
        return kiln_err_set(err, KILN_ERR_INVALID, "ref_tokens (1, R, C) and ref_ids (R, 4) I32 "
                            "do not match");
    p->ref_ids = ids;
    p->R = p->ref_tokens.shape[1];
    const kiln_tensor_ref *mask_ref = NULL;
    const void *mask = NULL;
    if (kiln_worker_input_host(w, p->job, "mask", 0, &mask_ref, &mask, err))
        return err->code;
    if (mask_ref) {
        int64_t len = kiln_denoise_stage_mask_len(s->den, d->width, d->height);
        if (mask_ref->dtype != KILN_F32 || mask_ref->ndim != 1 || mask_ref->shape[0] != len ||
            p->R != (int64_t)(d->width / 16) * (d->height / 16) || !(d->strength > 0))
            return kiln_err_set(err, KILN_ERR_INVALID, "mask must be (%lld) F32 at the output "
                                "size, with one image of that size and a strength",
                                (long long)len);
        p->mask = mask;
    }
    return KILN_OK;
}

/* Batch rows from the jobs' tensors in the plan's row layout
 * (engine/plan.h): each job's rows after the previous job's, row b of a job
 * from its prompt kiln_plan_row_prompt(b, n), or its one negative. */
static kiln_status gather(kiln_backend *be, prep *ps, int n, int neg, int64_t B, kiln_tensor *dst,
                          kiln_err *err)
{
    const kiln_tensor *first = neg ? &ps[0].neg : &ps[0].emb;
    int64_t shape[3] = {B, first->shape[1], first->shape[2]};
    if (kiln_be_alloc(be, dst, be->act_dtype, 3, shape))
        return kiln_be_check(be, err);
    int64_t b = 0;
    for (int i = 0; i < n; i++) {
        const kiln_job_denoise *d = &kiln_worker_job_msg(ps[i].job)->denoise;
        kiln_denoise_expand_rows(be, dst, b, neg ? &ps[i].neg : &ps[i].emb, d->n_seeds,
                                 neg ? d->n_seeds : d->n);
        b += d->n_seeds;
    }
    return kiln_be_check(be, err);
}

typedef struct batch_ctx {
    kiln_worker *w;
    prep *ps;
    int n;
    double t_first_step; /* when step 0 was queued: the end of the setup */
    kiln_backend *be;
    int mark_first_step; /* the device-time mark before step 0 (-1: none) */
    /* Previews (partial images): job i wants n_pv[i] of them, at the run's
     * steps pv[i][0..n_pv[i]) (kiln_sched_preview_steps), of its rows
     * [row0[i], row0[i] + rows). */
    int (*pv)[KILN_PROTO_MAX_PREVIEWS];
    int *n_pv;
    int64_t *row0;
} batch_ctx;

/* The preview index of `step` for job i, or -1. */
static int preview_index(const batch_ctx *c, int i, int step)
{
    for (int k = 0; k < c->n_pv[i]; k++)
        if (c->pv[i][k] == step)
            return k;
    return -1;
}

static int batch_preview_at(void *user, int step)
{
    const batch_ctx *c = user;
    for (int i = 0; i < c->n; i++)
        if (preview_index(c, i, step) >= 0 && !kiln_worker_cancelled(c->ps[i].job))
            return 1;
    return 0;
}

/* Each job that wants this step's preview gets its rows as a `partial`.
 * A preview that cannot be sent costs the client that preview, never the
 * image: the run goes on. */
static kiln_status batch_preview(void *user, int step, const kiln_tensor *x0, kiln_err *err)
{
    batch_ctx *c = user;
    (void)err;
    for (int i = 0; i < c->n; i++) {
        int k = preview_index(c, i, step);
        if (k < 0)
            continue;
        kiln_err perr = {0};
        const kiln_msg_job *mj = kiln_worker_job_msg(c->ps[i].job);
        if (kiln_worker_partial(c->w, c->ps[i].job, k, x0, c->row0[i], mj->denoise.n_seeds, &perr))
            KILN_LOG_WARN("kiln-denoiser: job %llu: preview %d not sent: %s",
                          (unsigned long long)mj->job, k, perr.msg);
    }
    return KILN_OK;
}

static void batch_step(void *user, int step)
{
    batch_ctx *c = user;
    if (step == 0) {
        c->t_first_step = kiln_now_ms();
        c->mark_first_step = kiln_be_timer_mark(c->be);
    }
    kiln_worker_step(c->w);
}

/* The loop stops only when every job of the batch is cancelled (between
 * steps here, and within a step at the next backend op: kiln_worker_watch);
 * a cancelled job in a live batch is answered `cancelled` at the end. */
static int batch_cancelled(void *user)
{
    const batch_ctx *c = user;
    for (int i = 0; i < c->n; i++)
        if (!kiln_worker_cancelled(c->ps[i].job))
            return 0;
    return 1;
}

static void den_run(void *state, kiln_worker *w, kiln_worker_job **jobs, int n)
{
    den_state *s = state;
    kiln_backend *be = s->be;
    prep *ps = calloc((size_t)n, sizeof *ps);
    uint64_t *seeds = calloc(KILN_PROTO_MAX_ROWS, sizeof *seeds);
    kiln_err err = {0};
    if (!ps || !seeds) {
        kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
        for (int i = 0; i < n; i++)
            kiln_worker_done(w, jobs[i], KILN_ERR_NOMEM, &err);
        free(ps), free(seeds);
        return;
    }
    /* Jobs with bad inputs fail alone; the rest run. */
    int live = 0;
    int64_t B = 0;
    for (int i = 0; i < n; i++) {
        prep *p = &ps[live];
        memset(p, 0, sizeof *p);
        p->job = jobs[i];
        kiln_err jerr = {0};
        if (prepare(s, w, p, &jerr)) {
            kiln_worker_done(w, jobs[i], jerr.code, &jerr);
            continue;
        }
        const kiln_job_denoise *d = &kiln_worker_job_msg(jobs[i])->denoise;
        memcpy(seeds + B, d->seeds, (size_t)d->n_seeds * sizeof *seeds);
        B += d->n_seeds;
        live++;
    }
    if (!live) {
        free(ps), free(seeds);
        return;
    }
    const kiln_job_denoise *d = &kiln_worker_job_msg(ps[0].job)->denoise;
    int cfg = ps[0].neg.data != NULL;
    kiln_tensor emb = {0}, neg = {0}, lat = {0};
    kiln_status st = KILN_OK;
    /* A lone job with one image per prompt uses its input as it came. */
    int own_emb = live > 1 || d->n > 1;
    if (own_emb)
        st = gather(be, ps, live, 0, B, &emb, &err);
    if (!st && cfg && B > 1)
        st = gather(be, ps, live, 1, B, &neg, &err);
    /* Each row's real tokens, in the same layout. */
    int *lens = calloc((size_t)(2 * B), sizeof *lens);
    if (!lens && !st)
        st = kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
    for (int i = 0, b = 0; lens && i < live; i++) {
        const kiln_job_denoise *di = &kiln_worker_job_msg(ps[i].job)->denoise;
        kiln_plan_row_lens(di->n_seeds, di->n, ps[i].txt_len, ps[i].has_neg_len ? ps[i].neg_len[0] : 0,
                           lens + b, lens + B + b);
        b += di->n_seeds;
    }
    int run_steps = d->steps - kiln_denoise_first_step(d->steps, d->strength);
    int(*pv)[KILN_PROTO_MAX_PREVIEWS] = calloc((size_t)live, sizeof *pv);
    int *n_pv = calloc((size_t)live, sizeof *n_pv);
    int64_t *row0 = calloc((size_t)live, sizeof *row0);
    int any_preview = 0;
    if ((!pv || !n_pv || !row0) && !st)
        st = kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
    for (int i = 0, r = 0; !st && i < live; i++) {
        const kiln_job_denoise *di = &kiln_worker_job_msg(ps[i].job)->denoise;
        n_pv[i] = kiln_sched_preview_steps(run_steps, di->previews, pv[i]);
        any_preview |= n_pv[i] > 0;
        row0[i] = r;
        r += di->n_seeds;
    }
    batch_ctx ctx = {w, ps, live, 0, be, -1, pv, n_pv, row0};
    kiln_denoise_job job = {
        .txt_len = lens, .neg_len = lens ? lens + B : NULL,
        .B = B, .embeds = own_emb ? &emb : &ps[0].emb,
        .neg_embeds = cfg ? (B > 1 ? &neg : &ps[0].neg) : NULL,
        .width = d->width, .height = d->height, .steps = d->steps, .guidance = d->guidance,
        .seeds = seeds, .batch_noise = d->batch_noise,
        .cancelled = batch_cancelled, .on_step = batch_step, .user = &ctx,
        .preview_at = any_preview ? batch_preview_at : NULL,
        .on_preview = any_preview ? batch_preview : NULL,
    };
    /* The one image of an edit, img2img or inpainting job (never batched). */
    kiln_denoise_job_image(s->den, &job, ps[0].R ? &ps[0].ref_tokens : NULL, ps[0].ref_ids, ps[0].R,
                           d->strength, ps[0].mask);
    double t_run = kiln_now_ms();
    /* Device time (CUDA events; none on the CPU) beside the wall times:
     * marks at the start, before step 0 and after the last step, read
     * once the batch is done. */
    kiln_be_timer_reset(be);
    int mark_run = kiln_be_timer_mark(be), mark_end = -1;
    kiln_worker_job *watched[KILN_PROTO_MAX_ROWS];
    for (int i = 0; i < live; i++)
        watched[i] = ps[i].job;
    kiln_worker_watch(w, watched, live);
    if (!st && !(st = kiln_denoise_run(s->den, &job, &lat, &err))) {
        mark_end = kiln_be_timer_mark(be);
        /* The outputs below wait for the GPU anyway; waiting here first
         * makes the step time the GPU's. */
        kiln_be_sync(be);
        st = kiln_be_check(be, &err);
    }
    kiln_worker_watch(w, NULL, 0);
    double t_end = kiln_now_ms();
    double gpu_setup = st ? -1 : kiln_be_timer_ms(be, mark_run, ctx.mark_first_step);
    double gpu_steps = st ? -1 : kiln_be_timer_ms(be, ctx.mark_first_step, mark_end);
    kiln_be_free(be, &emb), kiln_be_free(be, &neg);
    int64_t row = 0;
    for (int i = 0; i < live; i++) {
        kiln_err jerr = err;
        kiln_status jst = st;
        int64_t rows = kiln_worker_job_msg(ps[i].job)->denoise.n_seeds;
        kiln_worker_release_inputs(w, ps[i].job);
        if (!jst)
            jst = kiln_worker_output(w, ps[i].job, "latents", &lat, row, rows, 0, &jerr);
        row += rows;
        if (!jst && ctx.t_first_step > 0) {
            kiln_worker_timing(ps[i].job, "setup", ctx.t_first_step - t_run);
            kiln_worker_timing(ps[i].job, "step", (t_end - ctx.t_first_step) / run_steps);
            /* the steps that ran (img2img and inpainting run fewer than
             * asked): the gateway lays out one trace span per step */
            kiln_worker_timing(ps[i].job, "steps", run_steps);
            if (gpu_setup >= 0 && gpu_steps >= 0) {
                kiln_worker_timing(ps[i].job, "gpu_setup", gpu_setup);
                kiln_worker_timing(ps[i].job, "gpu_step", gpu_steps / run_steps);
            }
        }
        kiln_worker_done(w, ps[i].job, jst, &jerr);
    }
    kiln_be_free(be, &lat);
    free(ps), free(seeds), free(lens), free(pv), free(n_pv), free(row0);
}

const kiln_stage_ops kiln_denoiser_ops = {
    .stage = KILN_STAGE_DENOISE,
    .binary = "kiln-denoiser",
    .load = den_load,
    .unload = den_unload,
    .rows = den_rows,
    .compatible = den_compatible,
    .run = den_run,
};

