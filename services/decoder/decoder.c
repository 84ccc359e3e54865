/* kiln-decoder: packed latents to encoded images (engine/decode_stage.h
 * for the VAE, then PNG/JPEG/WebP with KILN_IMAGE_ENCODE_DEFAULTS and the
 * request's format and quality, exactly as `kiln generate` writes files).
 *
 * Jobs of the same size decode as one batch (the VAE treats rows
 * independently); the 8-bit images are encoded on a small thread pool
 * while the backend thread moves on to the next batch, and each job is
 * answered when its last image is encoded. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "engine/decode_stage.h"
#include "services/common/pool.h"
#include "services/common/worker.h"

typedef struct dec_state {
    kiln_backend *be;
    kiln_decode_stage *dec;
    kiln_pool *pool;
} dec_state;

static void *dec_load(kiln_backend *be, const kiln_checkpoint *ck, const kiln_worker_opts *o,
                      kiln_err *err)
{
    dec_state *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->be = be;
    int threads = o->image_threads;
    if (!threads) {
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        threads = cpus < 2 ? 1 : cpus > 8 ? 4 : (int)(cpus / 2);
    }
    s->pool = kiln_pool_create(threads, err);
    if (s->pool)
        KILN_LOG_INFO("kiln-decoder: %d image encoder thread(s)", threads);
    s->dec = s->pool ? kiln_decode_stage_create(be, ck, err) : NULL;
    if (s->dec && kiln_decode_stage_set_banding(s->dec, kiln_worker_band_pixels(o),
                                                o->vae_band_rows, err)) {
        kiln_decode_stage_destroy(s->dec);
        s->dec = NULL;
    }
    if (!s->dec) {
        kiln_pool_destroy(s->pool);
        free(s);
        return NULL;
    }
    return s;
}

static void dec_unload(void *state)
{
    dec_state *s = state;
    kiln_pool_destroy(s->pool); /* finishes the images still being encoded */
    kiln_decode_stage_destroy(s->dec);
    free(s);
}

static int dec_rows(const kiln_msg_job *j)
{
    const kiln_tensor_ref *l = kiln_ref_map_get(&j->in, "latents");
    return l && l->shape[0] > 0 && l->shape[0] <= KILN_PROTO_MAX_ROWS ? (int)l->shape[0] : 1;
}

static int dec_compatible(const kiln_msg_job *head, const kiln_msg_job *j)
{
    return head->decode.width == j->decode.width && head->decode.height == j->decode.height;
}

/* The images of one job being encoded on the pool. */
typedef struct job_images {
    kiln_worker *w;
    kiln_worker_job *job;
    atomic_int remaining;
    pthread_mutex_t mu; /* first error */
    kiln_err err;
    double t_submit; /* for the job's image_encode timing */
} job_images;

typedef struct image_task {
    job_images *ji;
    int row;
    kiln_image img;
} image_task;

static void finish_images(job_images *ji)
{
    /* The last task of the job runs this, so nothing else touches its
     * timings now. */
    kiln_worker_timing(ji->job, "image_encode", kiln_now_ms() - ji->t_submit);
    kiln_worker_done(ji->w, ji->job, ji->err.code, &ji->err);
    pthread_mutex_destroy(&ji->mu);
    free(ji);
}

static void encode_task(void *arg)
{
    image_task *t = arg;
    job_images *ji = t->ji;
    const kiln_job_decode *d = &kiln_worker_job_msg(ji->job)->decode;
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.format = d->format;
    o.quality = d->compression;
    kiln_buf file = {0};
    kiln_err err = {0};
    if (!kiln_worker_cancelled(ji->job) &&
        (kiln_image_encode(&t->img, &o, &file, &err) ||
         kiln_worker_output_image(ji->job, t->row, &file, &err))) {
        pthread_mutex_lock(&ji->mu);
        if (!ji->err.code)
            ji->err = err;
        pthread_mutex_unlock(&ji->mu);
    }
    kiln_buf_free(&file);
    kiln_image_free(&t->img);
    free(t);
    if (atomic_fetch_sub(&ji->remaining, 1) == 1)
        finish_images(ji);
}

/* Hands job i's decoded rows to the pool (taking the images). */
static void submit_images(dec_state *s, kiln_worker *w, kiln_worker_job *job, kiln_image *imgs,
                          int rows)
{
    job_images *ji = calloc(1, sizeof *ji);
    kiln_err err = {0};
    if (!ji || pthread_mutex_init(&ji->mu, NULL)) {
        free(ji);
        for (int r = 0; r < rows; r++)
            kiln_image_free(&imgs[r]);
        kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
        kiln_worker_done(w, job, err.code, &err);
        return;
    }
    ji->w = w, ji->job = job, ji->t_submit = kiln_now_ms();
    /* One extra count held while submitting, so the job cannot finish
     * before every row is queued. */
    atomic_store(&ji->remaining, rows + 1);
    for (int r = 0; r < rows; r++) {
        image_task *t = malloc(sizeof *t);
        if (t) {
            *t = (image_task){.ji = ji, .row = r, .img = imgs[r]};
            if (!kiln_pool_submit(s->pool, encode_task, t, &err))
                continue;
            free(t);
        } else {
            kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
        }
        kiln_image_free(&imgs[r]);
        pthread_mutex_lock(&ji->mu);
        if (!ji->err.code)
            ji->err = err;
        pthread_mutex_unlock(&ji->mu);
        atomic_fetch_sub(&ji->remaining, 1);
    }
    if (atomic_fetch_sub(&ji->remaining, 1) == 1)
        finish_images(ji);
}

static kiln_status check_latents(const kiln_worker_job *job, const kiln_tensor *t, kiln_err *err)
{
    const kiln_job_decode *d = &kiln_worker_job_msg(job)->decode;
    int64_t N = (int64_t)(d->height / 16) * (d->width / 16);
    if (t->ndim != 3 || t->shape[0] < 1 || t->shape[1] != N)
        return kiln_err_set(err, KILN_ERR_INVALID, "latents must be (B, %lld, C) for %dx%d",
                            (long long)N, d->width, d->height);
    return KILN_OK;
}

static void dec_run(void *state, kiln_worker *w, kiln_worker_job **jobs, int n)
{
    dec_state *s = state;
    kiln_backend *be = s->be;
    kiln_tensor in[KILN_PROTO_MAX_ROWS], lat = {0};
    kiln_worker_job *live[KILN_PROTO_MAX_ROWS];
    int m = 0;
    int64_t B = 0;
    for (int i = 0; i < n; i++) {
        kiln_err err = {0};
        if (kiln_worker_input(w, jobs[i], "latents", 1, &in[m], &err) ||
            check_latents(jobs[i], &in[m], &err) ||
            (m && (in[m].shape[2] != in[0].shape[2] || in[m].dtype != in[0].dtype) &&
             kiln_err_set(&err, KILN_ERR_INVALID, "latents differ from the batch's"))) {
            kiln_worker_done(w, jobs[i], err.code, &err);
            continue;
        }
        B += in[m].shape[0];
        live[m++] = jobs[i];
    }
    if (!m)
        return;
    kiln_err err = {0};
    kiln_status st = KILN_OK;
    kiln_image *imgs = calloc((size_t)B, sizeof *imgs);
    if (!imgs)
        st = kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory");
    const kiln_tensor *x = &in[0];
    if (!st && m > 1) {
        /* Concatenate the jobs' rows. */
        int64_t shape[3] = {B, in[0].shape[1], in[0].shape[2]};
        if (kiln_be_alloc(be, &lat, in[0].dtype, 3, shape) == KILN_OK) {
            int64_t row = 0;
            for (int i = 0; i < m; i++) {
                kiln_tensor dv = kiln_tensor_batch_view(&lat, row, in[i].shape[0]);
                kiln_be_copy(be, &dv, &in[i]);
                row += in[i].shape[0];
            }
        }
        st = kiln_be_check(be, &err);
        x = &lat;
    }
    int width = kiln_worker_job_msg(live[0])->decode.width;
    int height = kiln_worker_job_msg(live[0])->decode.height;
    double t_vae = kiln_now_ms();
    /* Device time of the VAE (CUDA events; none on the CPU): the images
     * come back to the host, so reading it waits for nothing more. */
    kiln_be_timer_reset(be);
    int mark0 = kiln_be_timer_mark(be), mark1 = -1;
    kiln_worker_watch(w, live, m);
    if (!st)
        st = kiln_decode_run(s->dec, x, width, height, imgs, NULL, &err);
    if (!st)
        mark1 = kiln_be_timer_mark(be);
    kiln_worker_watch(w, NULL, 0);
    t_vae = kiln_now_ms() - t_vae;
    double gpu_vae = st ? -1 : kiln_be_timer_ms(be, mark0, mark1);
    kiln_be_free(be, &lat);
    int64_t row = 0;
    for (int i = 0; i < m; i++) {
        int rows = (int)in[i].shape[0];
        kiln_worker_release_inputs(w, live[i]); /* on this thread: it frees backend memory */
        if (st) {
            kiln_worker_done(w, live[i], st, &err);
        } else {
            kiln_worker_timing(live[i], "vae", t_vae);
            if (gpu_vae >= 0)
                kiln_worker_timing(live[i], "gpu_vae", gpu_vae);
            submit_images(s, w, live[i], imgs + row, rows);
        }
        row += rows;
    }
    free(imgs);
}

const kiln_stage_ops kiln_decoder_ops = {
    .stage = KILN_STAGE_DECODE,
    .binary = "kiln-decoder",
    .load = dec_load,
    .unload = dec_unload,
    .rows = dec_rows,
    .compatible = dec_compatible,
    .run = dec_run,
};

