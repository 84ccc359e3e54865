/* A job's tensors: opening its input references, placing outputs in the
 * shm pool or inline, and the `done` / `release` replies. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "worker_impl.h"

const kiln_msg_job *kiln_worker_job_msg(const kiln_worker_job *j) { return &j->msg->job; }

kiln_backend *kiln_worker_backend(kiln_worker *w) { return w->be; }

static int job_cancelled(const kiln_worker_job *j)
{
    return atomic_load(&((kiln_worker_job *)j)->cancelled);
}

int kiln_worker_cancelled(const kiln_worker_job *j)
{
    return job_cancelled(j) || (j->stop && atomic_load(j->stop));
}

static int watched_cancelled(void *user)
{
    kiln_worker *w = user;
    for (int i = 0; i < w->n_watch; i++)
        if (!kiln_worker_cancelled(w->watch[i]))
            return 0;
    return w->n_watch > 0;
}

void kiln_worker_watch(kiln_worker *w, kiln_worker_job **jobs, int n)
{
    w->watch = jobs;
    w->n_watch = n;
    kiln_be_set_cancel(w->be, n > 0 ? watched_cancelled : NULL, w);
    if (n == 0 && w->be->error.code == KILN_ERR_CANCELLED)
        kiln_be_check(w->be, NULL);
}

static kiln_transport *transport_for(kiln_worker *w, kiln_ref_kind k)
{
    return k == KILN_REF_SHM        ? w->shm
           : k == KILN_REF_INLINE   ? w->inl
           : k == KILN_REF_CUDA_IPC ? w->cuda
                                    : NULL;
}

/* The data socket the gateway said to fetch `owner`'s inputs from, or
 * NULL when they open here. */
static const kiln_fetch_src *fetch_src(const kiln_msg_job *job, const char *owner)
{
    for (int i = 0; i < job->n_src; i++)
        if (!strcmp(job->src[i].owner, owner))
            return &job->src[i];
    return NULL;
}

static kiln_status open_input(kiln_worker *w, kiln_worker_job *j, const char *name, int required,
                              job_input **out, const void **data, kiln_err *err)
{
    *out = NULL;
    const kiln_tensor_ref *ref = kiln_ref_map_get(&j->msg->job.in, name);
    if (!ref)
        return required ? kiln_err_set(err, KILN_ERR_INVALID, "input %s missing", name) : KILN_OK;
    const kiln_fetch_src *src = ref->kind != KILN_REF_INLINE ? fetch_src(&j->msg->job, ref->owner)
                                                              : NULL;
    kiln_transport *tx = src ? NULL : transport_for(w, ref->kind);
    if (!src && !tx)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "input %s: %s references are not supported "
                            "by this replica", name, kiln_ref_kind_name(ref->kind));
    if (j->n_in == KILN_PROTO_MAX_TENSORS)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "input %s opened too often", name);
    void *fetched = NULL;
    if (src ? worker_data_fetch(w, j, src, ref, &fetched, err)
            : kiln_transport_open(tx, ref, data, err))
        return kiln_err_wrap(err, "input %s", name);
    job_input *in = &j->in[j->n_in++];
    memset(in, 0, sizeof *in);
    in->ref = *ref;
    in->tx = tx;
    in->fetched = fetched;
    if (fetched)
        *data = fetched;
    *out = in;
    return KILN_OK;
}

kiln_status kiln_worker_input_host(kiln_worker *w, kiln_worker_job *j, const char *name,
                                   int required, const kiln_tensor_ref **ref, const void **data,
                                   kiln_err *err)
{
    job_input *in;
    *ref = NULL, *data = NULL;
    const kiln_tensor_ref *r = kiln_ref_map_get(&j->msg->job.in, name);
    if (r && r->kind == KILN_REF_CUDA_IPC)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "input %s: wanted in host memory, got a "
                            "cuda_ipc reference", name);
    kiln_status st = open_input(w, j, name, required, &in, data, err);
    if (!st && in)
        *ref = &in->ref;
    return st;
}

kiln_status kiln_worker_input(kiln_worker *w, kiln_worker_job *j, const char *name, int required,
                              kiln_tensor *t, kiln_err *err)
{
    memset(t, 0, sizeof *t);
    job_input *in;
    const void *data;
    kiln_status st = open_input(w, j, name, required, &in, &data, err);
    if (st || !in)
        return st;
    kiln_backend *be = w->be;
    if (!strcmp(be->name, "cpu") && in->ref.dtype == be->act_dtype) {
        /* The CPU backend's tensors are plain host memory: use the mapped
         * range in place.  It is read-only, which the stages respect (their
         * inputs are const). */
        kiln_tensor_set_shape(t, in->ref.dtype, in->ref.ndim, in->ref.shape);
        t->data = (void *)data;
        return KILN_OK;
    }
    if (in->ref.kind == KILN_REF_CUDA_IPC) {
        /* The producer's device slab, mapped into this process: used in
         * place, read-only like the shm case. */
        if (in->ref.dtype != be->act_dtype)
            return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "input %s: cuda_ipc %s, the backend "
                                "computes in %s", name, kiln_dtype_name(in->ref.dtype),
                                kiln_dtype_name(be->act_dtype));
        kiln_tensor_set_shape(t, in->ref.dtype, in->ref.ndim, in->ref.shape);
        t->data = (void *)data;
        t->on_device = 1;
        return KILN_OK;
    }
    if (kiln_be_from_host(be, &in->t, in->ref.ndim, in->ref.shape, data, in->ref.dtype)) {
        kiln_be_check(be, err);
        return kiln_err_wrap(err, "input %s", name);
    }
    in->uploaded = 1;
    *t = in->t;
    return KILN_OK;
}

void kiln_worker_release_inputs(kiln_worker *w, kiln_worker_job *j)
{
    if (j->released)
        return;
    j->released = 1;
    for (int i = 0; i < j->n_in; i++)
        if (j->in[i].ref.kind == KILN_REF_CUDA_IPC) {
            kiln_be_sync(w->be);
            break;
        }
    for (int i = 0; i < j->n_in; i++) {
        kiln_err err = {0};
        /* A fetched input was verified by its owner when it sent it. */
        if (j->in[i].tx && kiln_transport_verify(j->in[i].tx, &j->in[i].ref, &err)) {
            KILN_LOG_WARN("%s: job %llu: %s", w->ops->binary, (unsigned long long)j->msg->job.job,
                          err.msg);
            j->inputs_lost = 1;
        }
        if (j->in[i].uploaded)
            kiln_be_free(w->be, &j->in[i].t);
        if (j->in[i].tx)
            kiln_transport_close(j->in[i].tx, &j->in[i].ref);
        free(j->in[i].fetched);
        j->in[i].fetched = NULL;
    }
    /* A halted incarnation's releases would not count. */
    if (worker_halted(w))
        return;
    /* Every shm and cuda_ipc input goes back to its owner, opened or not. */
    kiln_msg *m = calloc(1, sizeof *m);
    if (!m) {
        KILN_LOG_ERROR("worker: out of memory releasing inputs of job %llu",
                       (unsigned long long)j->msg->job.job);
        return;
    }
    m->type = KILN_MSG_RELEASE;
    const kiln_ref_map *in = &j->msg->job.in;
    for (int i = 0; i < in->n; i++)
        if (in->items[i].ref.kind != KILN_REF_INLINE)
            m->refs.refs[m->refs.n++] = in->items[i].ref;
    if (m->refs.n)
        worker_send(w, m);
    free(m);
}

static kiln_status add_output(kiln_worker_job *j, const char *name, kiln_transport *tx,
                              const kiln_tensor_ref *ref, kiln_err *err)
{
    if (j->n_out == KILN_PROTO_MAX_TENSORS ||
        kiln_ref_map_put(&j->done->done.out, name, ref, err)) {
        kiln_transport_free(tx, ref, NULL);
        return kiln_err_set(err, KILN_ERR_INTERNAL, "too many outputs");
    }
    j->out[j->n_out++] = (job_output){.tx = tx, .ref = *ref};
    return KILN_OK;
}

/* Copies rows [row0, row0 + rows) of src into a new reference of the
 * transport kiln_worker_output describes; *tx_out is where it returns. */
static kiln_status make_ref(kiln_worker *w, kiln_worker_job *j, const char *name,
                            const kiln_tensor *src, int64_t row0, int64_t rows, int as_inline,
                            kiln_transport **tx_out, kiln_tensor_ref *ref_out, kiln_err *err)
{
    if (src->ndim < 1 || row0 < 0 || rows < 1 || row0 + rows > src->shape[0])
        return kiln_err_set(err, KILN_ERR_INTERNAL, "output %s: bad rows", name);
    kiln_tensor view = *src;
    size_t row_bytes = kiln_tensor_nbytes(src) / (size_t)src->shape[0];
    view.shape[0] = rows;
    view.data = (char *)src->data + (size_t)row0 * row_bytes;
    kiln_tensor_ref ref;
    void *dst;
    /* cuda_ipc unless the gateway said no replica of the next stage could
     * open it (outk): then the host copy below, which any can fetch. */
    unsigned allowed = j->msg->job.out_kinds;
    if (src->on_device && w->cuda_out && !as_inline &&
        (!allowed || (allowed & KILN_TRANSPORT_BIT(KILN_REF_CUDA_IPC)))) {
        /* Device to device, and the copy complete before done can carry
         * the reference. */
        if (kiln_transport_alloc(w->cuda, src->dtype, view.ndim, view.shape, &ref, &dst, err))
            return kiln_err_wrap(err, "output %s", name);
        kiln_tensor d = view;
        d.data = dst;
        kiln_be_copy(w->be, &d, &view);
        kiln_be_sync(w->be);
        if (kiln_be_check(w->be, err)) {
            kiln_transport_free(w->cuda, &ref, NULL);
            return kiln_err_wrap(err, "output %s", name);
        }
        *tx_out = w->cuda, *ref_out = ref;
        return KILN_OK;
    }
    /* Device tensors come down as f32 (the consumer converts on upload). */
    kiln_dtype dt = src->on_device ? KILN_F32 : src->dtype;
    kiln_transport *tx = as_inline ? w->inl : w->shm;
    if (kiln_transport_alloc(tx, dt, view.ndim, view.shape, &ref, &dst, err))
        return kiln_err_wrap(err, "output %s", name);
    if (src->on_device) {
        kiln_be_download(w->be, &view, dst);
        if (kiln_be_check(w->be, err)) {
            kiln_transport_free(tx, &ref, NULL);
            return kiln_err_wrap(err, "output %s", name);
        }
    } else {
        memcpy(dst, view.data, (size_t)ref.len);
    }
    *tx_out = tx, *ref_out = ref;
    return KILN_OK;
}

kiln_status kiln_worker_output(kiln_worker *w, kiln_worker_job *j, const char *name,
                               const kiln_tensor *src, int64_t row0, int64_t rows, int as_inline,
                               kiln_err *err)
{
    kiln_transport *tx;
    kiln_tensor_ref ref;
    if (make_ref(w, j, name, src, row0, rows, as_inline, &tx, &ref, err))
        return err ? err->code : KILN_ERR_INTERNAL;
    return add_output(j, name, tx, &ref, err);
}

kiln_status kiln_worker_partial(kiln_worker *w, kiln_worker_job *j, int preview,
                                const kiln_tensor *src, int64_t row0, int64_t rows, kiln_err *err)
{
    if (job_cancelled(j) || worker_halted(w))
        return KILN_OK; /* nobody waits for it */
    kiln_transport *tx;
    kiln_tensor_ref ref;
    if (make_ref(w, j, "latents", src, row0, rows, 0, &tx, &ref, err))
        return err ? err->code : KILN_ERR_INTERNAL;
    kiln_msg *m = calloc(1, sizeof *m); /* a kiln_msg is ~20 KB: not on the stack */
    kiln_status st = m ? KILN_OK : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (!st) {
        m->type = KILN_MSG_PARTIAL;
        m->done = (kiln_msg_done){.job = j->msg->job.job, .ok = 1, .preview = preview};
        st = kiln_ref_map_put(&m->done.out, "latents", &ref, err);
    }
    if (!st && worker_send(w, m))
        st = kiln_err_set(err, KILN_ERR_INTERNAL, "the preview could not be sent");
    free(m);
    /* Sent, the range is the gateway's to hand on (it comes back through
     * `free`, as a done's outputs do); not sent, it is ours again. */
    if (st)
        kiln_transport_free(tx, &ref, NULL);
    return st;
}

kiln_status kiln_worker_output_host(kiln_worker *w, kiln_worker_job *j, const char *name,
                                    kiln_dtype dt, int ndim, const int64_t *shape,
                                    const void *data, kiln_err *err)
{
    kiln_tensor_ref ref;
    void *dst;
    if (kiln_transport_alloc(w->inl, dt, ndim, shape, &ref, &dst, err))
        return kiln_err_wrap(err, "output %s", name);
    memcpy(dst, data, (size_t)ref.len);
    return add_output(j, name, w->inl, &ref, err);
}

kiln_status kiln_worker_output_image(kiln_worker_job *j, int row, kiln_buf *img, kiln_err *err)
{
    if (row < 0 || row >= KILN_PROTO_MAX_ROWS)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "image row %d out of range", row);
    kiln_buf *images = atomic_load(&j->images);
    if (!images) {
        /* Rows encoded at once race to allocate: one array wins, the
         * others are dropped (a plain store lost the winner's rows:
         * "image 0 missing" under the GPU soak, 2026-12-06). */
        kiln_buf *mine = calloc(KILN_PROTO_MAX_ROWS, sizeof *mine);
        if (!mine)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        if (atomic_compare_exchange_strong(&j->images, &images, mine))
            images = mine;
        else
            free(mine);
    }
    kiln_buf_free(&images[row]);
    images[row] = *img;
    memset(img, 0, sizeof *img);
    return KILN_OK;
}

void kiln_worker_timing(kiln_worker_job *j, const char *name, double ms)
{
    kiln_msg_done *d = &j->done->done;
    for (int i = 0; i < d->n_ms; i++)
        if (!strcmp(d->ms[i].name, name)) {
            d->ms[i].ms = ms;
            return;
        }
    if (d->n_ms < KILN_PROTO_MAX_TIMINGS)
        d->ms[d->n_ms++] = (kiln_timing){.name = name, .ms = ms > 0 ? ms : 0};
}

void worker_job_free(kiln_worker_job *j)
{
    kiln_buf *images = atomic_load(&j->images);
    if (images)
        for (int i = 0; i < KILN_PROTO_MAX_ROWS; i++)
            kiln_buf_free(&images[i]);
    free(images);
    free(j->done);
    kiln_msg_free(j->msg);
    free(j);
}

/* Image file `row` as output "image.<row>" in a range of the shm pool,
 * which the gateway reads and frees (docs/ARCHITECTURE.md, "Images by
 * reference"): the range stays ours until its `free`, as any output's.
 * Fails (and the file goes inline) when the pool has no room now or the
 * done has no name left for it. */
static kiln_status image_ref(kiln_worker *w, kiln_worker_job *j, int row, const kiln_buf *file,
                             kiln_err *err)
{
    if (j->n_out == KILN_PROTO_MAX_TENSORS)
        return kiln_err_set(err, KILN_ERR_BUSY, "no output name left");
    char name[KILN_PROTO_TENSOR_NAME_MAX];
    kiln_image_ref_name(row, name);
    kiln_tensor_ref ref;
    void *dst;
    kiln_status st = kiln_transport_alloc(w->shm, KILN_U8, 1, (int64_t[]){(int64_t)file->len},
                                          &ref, &dst, err);
    if (st)
        return st;
    memcpy(dst, file->data, file->len);
    return add_output(j, name, w->shm, &ref, err);
}

/* Fills done.images from the rows the stage produced (all rows below the
 * highest must be present); those the gateway takes by reference
 * (job.decode.image_kinds) go into the shm pool instead, each row falling
 * back to inline on its own when that fails. */
static kiln_status collect_images(kiln_worker *w, kiln_worker_job *j, kiln_err *err)
{
    kiln_msg_done *d = &j->done->done;
    d->n_images = 0;
    kiln_buf *images = atomic_load(&j->images);
    if (!images)
        return KILN_OK;
    const kiln_msg_job *job = &j->msg->job;
    int by_ref = job->stage == KILN_STAGE_DECODE &&
                 (job->decode.image_kinds & KILN_TRANSPORT_BIT(KILN_REF_SHM));
    int top = -1;
    for (int i = 0; i < KILN_PROTO_MAX_ROWS; i++)
        if (images[i].len)
            top = i;
    for (int i = 0; i <= top; i++) {
        if (!images[i].len)
            return kiln_err_set(err, KILN_ERR_INTERNAL, "image %d missing", i);
        kiln_err why = {0};
        if (by_ref && !image_ref(w, j, i, &images[i], &why))
            continue;
        if (by_ref)
            KILN_LOG_DEBUG("%s: job %llu: image %d goes inline: %s", w->ops->binary,
                           (unsigned long long)job->job, i, why.msg);
        d->images[d->n_images++] = (kiln_bytes){images[i].data, images[i].len};
    }
    return KILN_OK;
}

void kiln_worker_done(kiln_worker *w, kiln_worker_job *j, kiln_status st, const kiln_err *err)
{
    worker_progress(w);
    /* A job that failed because the device is gone is not the request's
     * failure: the incarnation says bye and stops, and the gateway runs the
     * job elsewhere instead of answering 500. */
    if (st && st != KILN_ERR_CANCELLED && kiln_be_lost(w->be))
        worker_halt(w, WORKER_FAULTED, err && err->msg[0] ? err->msg : "its device is lost");
    worker_unhold(w, j);
    kiln_worker_release_inputs(w, j);
    kiln_err local = {0};
    if (!st && j->inputs_lost)
        st = kiln_err_set(&local, KILN_ERR_NOT_FOUND, "an input was freed while in use"),
        err = &local;
    if (!st && job_cancelled(j))
        st = KILN_ERR_CANCELLED;
    if (st == KILN_ERR_CANCELLED && !job_cancelled(j)) {
        /* Stopped by our shutdown, not by the client: the gateway may
         * re-dispatch it. */
        st = kiln_err_set(&local, KILN_ERR_UNAVAILABLE, "replica shutting down");
        err = &local;
    }
    if (!st)
        st = collect_images(w, j, &local), err = &local;
    kiln_msg_done *d = &j->done->done;
    if (worker_halted(w)) {
        /* Fenced or faulted: the gateway runs this job elsewhere. */
        for (int i = 0; i < j->n_out; i++)
            kiln_transport_free(j->out[i].tx, &j->out[i].ref, NULL);
        worker_job_free(j);
        return;
    }
    j->done->type = KILN_MSG_DONE;
    d->job = j->msg->job.job;
    if (j->t_start > 0)
        kiln_worker_timing(j, "run", kiln_now_ms() - j->t_start);
    d->ok = st == KILN_OK;
    if (!d->ok) {
        d->code = st;
        d->message = st == KILN_ERR_CANCELLED ? "request cancelled"
                     : err && err->msg[0]  ? err->msg
                                           : kiln_status_name(st);
        d->out.n = d->n_images = 0;
        double t_cancel = atomic_load(&j->t_cancel);
        if (st != KILN_ERR_CANCELLED)
            KILN_LOG_WARN("%s: job %llu failed: %s", w->ops->binary, (unsigned long long)d->job,
                          d->message);
        else if (j->t_start > 0 && t_cancel > 0)
            /* How long work went on after the cancel: operators (and the
             * service tests) read it. */
            KILN_LOG_INFO("%s: job %llu stopped %.0f ms after its cancel, %.0f ms into its run",
                          w->ops->binary, (unsigned long long)d->job, kiln_now_ms() - t_cancel,
                          kiln_now_ms() - j->t_start);
    }
    if (d->ok)
        worker_fault_images(w, j);
    if (worker_send(w, j->done)) {
        /* Too big or unencodable: the gateway still gets an answer. */
        kiln_msg *fallback = j->done;
        fallback->done = (kiln_msg_done){.job = j->msg->job.job, .code = KILN_ERR_INTERNAL,
                                         .message = "reply could not be sent"};
        worker_send(w, fallback);
    }
    for (int i = 0; i < j->n_out; i++) {
        /* Inline buffers are in the sent frame now; shm ranges stay for
         * the consumer unless the job failed. */
        if (!d->ok || j->out[i].tx == w->inl)
            kiln_transport_free(j->out[i].tx, &j->out[i].ref, NULL);
    }
    /* The done itself gives the job's credit back (the gateway counts it
     * on receipt); a `ready` here as well would grant a second one. */
    worker_job_free(j);
}
