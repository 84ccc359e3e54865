/* kiln-encoder: prompts to text embeddings (tokenizer + Qwen3) with each
 * row's real-token count (txt_len, neg_len), and edit references to latent
 * tokens (VAE encoder), as engine/encode_stage.h computes them for
 * `kiln generate` / `kiln edit`.
 *
 * A batch joins the prompts (and negative prompts) of every job with the
 * same max_seq into one kiln_encode_prompts call; Qwen3 rows never
 * interact, so each job's rows are the bytes it gets alone; rows already
 * seen come from the stage's prompt cache (--prompt-cache-mb).  References
 * are encoded per job (their sizes differ). */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "engine/encode_stage.h"
#include "engine/inpaint.h"
#include "services/common/worker.h"

typedef struct enc_state {
    kiln_backend *be;
    kiln_encode_stage *enc;
    double cache_logged_ms; /* when the prompt cache's counters were last logged */
} enc_state;

/* The prompt cache's counters, at most once a minute while it sees
 * traffic (and at exit), so an operator can size --prompt-cache-mb. */
static void log_cache(enc_state *s, int force)
{
    kiln_prompt_cache_stats c;
    kiln_encode_stage_cache_stats(s->enc, &c);
    double now = kiln_now_ms();
    if (!c.max_bytes || (!force && now - s->cache_logged_ms < 60000.0))
        return;
    s->cache_logged_ms = now;
    KILN_LOG_INFO("kiln-encoder: prompt cache: %llu hits, %llu misses (%llu first seen, not "
                  "cached), %llu evictions, %zu rows in %.1f of %.0f MiB",
                  (unsigned long long)c.hits, (unsigned long long)c.misses,
                  (unsigned long long)c.deferred, (unsigned long long)c.evictions, c.entries,
                  (double)c.bytes / (1 << 20),
                  (double)c.max_bytes / (1 << 20));
}

static void *enc_load(kiln_backend *be, const kiln_checkpoint *ck, const kiln_worker_opts *o,
                      kiln_err *err)
{
    enc_state *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    kiln_encode_opts eo = {.n_out_layers = o->n_out_layers, .with_references = 1,
                           .prompt_cache_bytes = (size_t)o->prompt_cache_mb << 20};
    memcpy(eo.out_layers, o->out_layers, sizeof eo.out_layers);
    s->be = be;
    s->cache_logged_ms = kiln_now_ms();
    s->enc = kiln_encode_stage_create(be, ck, &eo, err);
    if (s->enc && kiln_encode_stage_set_banding(s->enc, kiln_worker_band_pixels(o),
                                                o->vae_band_rows, err)) {
        kiln_encode_stage_destroy(s->enc);
        s->enc = NULL;
    }
    if (!s->enc) {
        free(s);
        return NULL;
    }
    return s;
}

static void enc_unload(void *state)
{
    enc_state *s = state;
    log_cache(s, 1);
    kiln_encode_stage_destroy(s->enc);
    free(s);
}

static int enc_rows(const kiln_msg_job *j) { return j->encode.n_prompts + (j->encode.negative != NULL); }

static int enc_compatible(const kiln_msg_job *head, const kiln_msg_job *j)
{
    return head->encode.max_seq == j->encode.max_seq;
}

/* Reference i of the job, decoded as `kiln edit` reads it and shrunk to its
 * prepared size at once, so that a job holds one reference as uploaded at a
 * time, not all of them (eight 64 MP uploads would be 1.5 GiB).  Decoding
 * and downscaling a large one takes a while: a cancel stops between those
 * (the VAE encoder stops at its next op: kiln_worker_watch).  *mp gets the
 * megapixels it had. */
static kiln_status take_reference(kiln_worker_job *job, const kiln_model_traits *traits, int i,
                                  kiln_image *img, double *mp, int *w0, int *h0, kiln_err *err)
{
    const kiln_bytes *ref = &kiln_worker_job_msg(job)->encode.refs[i];
    if (kiln_worker_cancelled(job))
        return kiln_err_set(err, KILN_ERR_CANCELLED, "request cancelled");
    kiln_status st = kiln_image_decode(ref->data, ref->len, NULL, img, err);
    if (!st && kiln_worker_cancelled(job))
        return kiln_err_set(err, KILN_ERR_CANCELLED, "request cancelled");
    if (!st)
        *mp = (double)img->width * img->height / 1e6, *w0 = img->width, *h0 = img->height;
    if (!st && traits->shrink_images)
        st = kiln_image_flux2_ref_shrink(img, err);
    return st ? kiln_err_wrap(err, "image %d", i) : KILN_OK;
}

/* Edit references: decoded, then VAE-encoded.  Outputs ref_tokens
 * (1, R, C) and ref_ids (R, 4). */
static kiln_status encode_refs(enc_state *s, kiln_worker *w, kiln_worker_job *job, kiln_err *err)
{
    const kiln_job_encode *e = &kiln_worker_job_msg(job)->encode;
    kiln_image imgs[KILN_PROTO_MAX_EDIT_REFS] = {{0}};
    kiln_tensor tokens = {0};
    int32_t *ids = NULL;
    int64_t R = 0;
    kiln_status st = KILN_OK;
    double mp = 0, t0 = kiln_now_ms();
    int w0 = 0, h0 = 0;
    kiln_model_traits traits = kiln_encode_stage_traits(s->enc);
    for (int i = 0; i < e->n_refs && !st; i++) {
        double one = 0;
        st = take_reference(job, &traits, i, &imgs[i], &one, &w0, &h0, err);
        mp += one;
    }
    /* img2img's and inpainting's image: resized to its prepared size, not
     * cropped, as FluxImg2ImgPipeline and Flux2KleinInpaintPipeline
     * preprocess it (engine/inpaint.h); the sizes kiln_request_resolve
     * checked are the image's as uploaded (w0 x h0). */
    if (!st && (e->mask.len || e->start))
        st = kiln_inpaint_prepare_image(&imgs[0], &traits, err);
    /* Inpainting: the mask at the family's grid, as kiln edit --mask makes it. */
    float *grid = NULL;
    int64_t N = 0;
    if (!st && e->mask.len) {
        kiln_image mask = {0};
        st = kiln_image_decode_mask(e->mask.data, e->mask.len, NULL, &mask, err);
        if (!st && (mask.width != w0 || mask.height != h0))
            st = kiln_err_set(err, KILN_ERR_INVALID, "mask must have the image's size %dx%d",
                              w0, h0);
        if (!st)
            st = kiln_encode_mask(s->enc, &mask, imgs[0].width, imgs[0].height, &grid, &N, err);
        kiln_image_free(&mask);
    }
    if (!st) {
        /* Operators (and the admission test) see what uploads cost here. */
        KILN_LOG_INFO("kiln-encoder: job %llu: %d reference(s) of %.1f MP in all decoded and "
                      "shrunk in %.0f ms", (unsigned long long)kiln_worker_job_msg(job)->job,
                      e->n_refs, mp, kiln_now_ms() - t0);
        st = kiln_encode_references(s->enc, imgs, e->n_refs, &tokens, &ids, &R, err);
    }
    if (!st)
        st = kiln_worker_output(w, job, "ref_tokens", &tokens, 0, 1, 0, err);
    if (!st)
        st = kiln_worker_output_host(w, job, "ref_ids", KILN_I32, 2, (int64_t[]){R, 4}, ids, err);
    if (!st && grid)
        st = kiln_worker_output_host(w, job, "mask", KILN_F32, 1, (int64_t[]){N}, grid, err);
    kiln_be_free(s->be, &tokens);
    free(ids), free(grid);
    for (int i = 0; i < e->n_refs; i++)
        kiln_image_free(&imgs[i]);
    return st;
}

/* One kiln_encode_prompts call over the batch's rows: each job's prompts,
 * then its negative prompt; lens[row] gets each row's real tokens.  *ms
 * gets its wall time and *gpu_ms its device time (CUDA events; -1 on the
 * CPU or when unknown). */
static kiln_status encode_batch(enc_state *s, kiln_worker *w, kiln_worker_job **jobs, int n,
                                kiln_tensor *emb, int **lens, double *ms, double *gpu_ms,
                                kiln_err *err)
{
    *ms = *gpu_ms = -1;
    int total = 0;
    for (int i = 0; i < n; i++)
        total += enc_rows(kiln_worker_job_msg(jobs[i]));
    const char **rows = malloc((size_t)total * sizeof *rows);
    *lens = malloc((size_t)total * sizeof **lens);
    if (!rows || !*lens) {
        free(rows);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    int r = 0;
    for (int i = 0; i < n; i++) {
        const kiln_job_encode *e = &kiln_worker_job_msg(jobs[i])->encode;
        for (int p = 0; p < e->n_prompts; p++)
            rows[r++] = e->prompts[p];
        if (e->negative)
            rows[r++] = e->negative;
    }
    int max_seq = kiln_worker_job_msg(jobs[0])->encode.max_seq;
    kiln_worker_watch(w, jobs, n);
    double t0 = kiln_now_ms();
    kiln_be_timer_reset(s->be);
    int mark0 = kiln_be_timer_mark(s->be);
    kiln_status st = kiln_encode_prompts(s->enc, rows, total, max_seq, emb, NULL, *lens, err);
    int mark1 = st ? -1 : kiln_be_timer_mark(s->be);
    kiln_worker_watch(w, NULL, 0);
    free(rows);
    if (!st) {
        /* waits for the embeddings, as handing them on would */
        *gpu_ms = kiln_be_timer_ms(s->be, mark0, mark1);
        *ms = kiln_now_ms() - t0;
    }
    return st;
}

static kiln_status emit_lens(kiln_worker *w, kiln_worker_job *job, const char *name,
                             const int *lens, int n, kiln_err *err)
{
    int32_t v[KILN_PROTO_MAX_ROWS];
    for (int i = 0; i < n && i < KILN_PROTO_MAX_ROWS; i++)
        v[i] = lens[i];
    return kiln_worker_output_host(w, job, name, KILN_I32, 1, (int64_t[]){n}, v, err);
}

static void enc_run(void *state, kiln_worker *w, kiln_worker_job **jobs, int n)
{
    enc_state *s = state;
    kiln_err err = {0};
    kiln_tensor emb = {0};
    kiln_prompt_cache_stats c0, c1;
    int *lens = NULL;
    kiln_encode_stage_cache_stats(s->enc, &c0);
    double text_ms, gpu_text_ms;
    kiln_status st = encode_batch(s, w, jobs, n, &emb, &lens, &text_ms, &gpu_text_ms, &err);
    kiln_encode_stage_cache_stats(s->enc, &c1);
    if (st && st != KILN_ERR_CANCELLED && n > 1) {
        /* One bad prompt (say invalid UTF-8) must not fail its neighbours:
         * run the jobs one by one to find it. */
        KILN_LOG_INFO("kiln-encoder: batch of %d failed (%s); retrying one by one", n, err.msg);
        free(lens);
        for (int i = 0; i < n; i++)
            enc_run(state, w, &jobs[i], 1);
        return;
    }
    if (c1.max_bytes) {
        /* The batch's prompt cache lookups, carried by its first job's done
         * (the gateway sums them into kiln_prompt_cache_*_total). */
        kiln_worker_timing(jobs[0], "cache_hits", (double)(c1.hits - c0.hits));
        kiln_worker_timing(jobs[0], "cache_misses", (double)(c1.misses - c0.misses));
        kiln_worker_timing(jobs[0], "cache_evictions", (double)(c1.evictions - c0.evictions));
    }
    int64_t row = 0;
    for (int i = 0; i < n; i++) {
        const kiln_job_encode *e = &kiln_worker_job_msg(jobs[i])->encode;
        kiln_err jerr = err;
        kiln_status jst = st;
        if (!jst && text_ms >= 0)
            kiln_worker_timing(jobs[i], "text_encode", text_ms);
        if (!jst && gpu_text_ms >= 0)
            kiln_worker_timing(jobs[i], "gpu_text_encode", gpu_text_ms);
        if (!jst)
            jst = kiln_worker_output(w, jobs[i], "embeds", &emb, row, e->n_prompts, 0, &jerr);
        if (!jst && e->negative)
            jst = kiln_worker_output(w, jobs[i], "neg", &emb, row + e->n_prompts, 1, 0, &jerr);
        /* Each row's real tokens: Z-Image's DiT reads those rows only
         * (engine/denoise_stage.h txt_len, neg_len). */
        if (!jst)
            jst = emit_lens(w, jobs[i], "txt_len", lens + row, e->n_prompts, &jerr);
        if (!jst && e->negative)
            jst = emit_lens(w, jobs[i], "neg_len", lens + row + e->n_prompts, 1, &jerr);
        if (!jst && e->n_refs) {
            /* References are encoded per job: watched alone. */
            kiln_worker_watch(w, &jobs[i], 1);
            jst = encode_refs(s, w, jobs[i], &jerr);
            kiln_worker_watch(w, NULL, 0);
        }
        row += enc_rows(kiln_worker_job_msg(jobs[i]));
        kiln_worker_done(w, jobs[i], jst, &jerr);
    }
    kiln_be_free(s->be, &emb);
    free(lens);
    log_cache(s, 0);
}

const kiln_stage_ops kiln_encoder_ops = {
    .stage = KILN_STAGE_ENCODE,
    .binary = "kiln-encoder",
    .load = enc_load,
    .unload = enc_unload,
    .rows = enc_rows,
    .compatible = enc_compatible,
    .run = enc_run,
};

