/* Decoded image files by reference (docs/ARCHITECTURE.md, "Images by
 * reference"): a decoder whose /dev/shm the gateway can open leaves each
 * file in a range of its shm pool and names it in its done (out
 * "image.<row>"), which spares the bus (CURVE encryption, TCP) the few MB
 * of every image.  The gateway copies the files out, checks that each
 * range still held its file after the copy (else the bytes may be another
 * request's) and frees the ranges at once: from here on the done is what
 * an inline one is, for the response, the previews and the traces. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "scheduler_impl.h"

/* The largest file one image of q can be: TurboJPEG's worst case, 6 bytes
 * a pixel (PNG and WebP stay below), and 64 KiB of headers, as the
 * gateway's bus frame limit counts it (gateway.c, max_frame_in). */
static uint64_t max_file(const kiln_request *q)
{
    return (uint64_t)q->width * (uint64_t)q->height * 6 + (64u << 10);
}

/* KILN_ERR_INVALID (why in err) unless every reference of d is an image
 * file j's dispatch asked for: checked before anything is mapped. */
static kiln_status check_refs(const sched_job *j, const kiln_request *q, const kiln_msg_done *d,
                              kiln_err *err)
{
    if (!(j->image_kinds & KILN_TRANSPORT_BIT(KILN_REF_SHM)))
        return kiln_err_set(err, KILN_ERR_INVALID, "references the gateway did not ask for");
    if (d->n_images + d->out.n != q->n)
        return kiln_err_set(err, KILN_ERR_INVALID, "%d images inline and %d by reference for %d",
                            d->n_images, d->out.n, q->n);
    for (int i = 0; i < d->out.n; i++) {
        const kiln_named_ref *e = &d->out.items[i];
        int row = kiln_image_ref_row(e->name);
        if (row < 0 || row >= q->n)
            return kiln_err_set(err, KILN_ERR_INVALID, "output '%s' is no image of the request",
                                e->name);
        if (e->ref.kind != KILN_REF_SHM || e->ref.dtype != KILN_U8 || e->ref.ndim != 1)
            return kiln_err_set(err, KILN_ERR_INVALID, "%s is not a shm range of bytes", e->name);
        if (!e->ref.len || e->ref.len > max_file(q))
            return kiln_err_set(err, KILN_ERR_INVALID, "%s holds %llu bytes (a %dx%d file: 1 to "
                                "%llu)", e->name, (unsigned long long)e->ref.len, q->width,
                                q->height, (unsigned long long)max_file(q));
    }
    return KILN_OK;
}

/* Copies the files of out into dst (at off[i] for item i): open (the
 * range's header names the allocation), copy, verify (it still does),
 * close.  KILN_ERR_INVALID for a range outside its slab; others
 * (KILN_ERR_NOT_FOUND: freed or handed out again, the slab gone; _IO: it
 * cannot be mapped) mean the decoder's memory is gone. */
static kiln_status copy_files(kiln_transport *rx, const kiln_ref_map *out, uint8_t *dst,
                              const size_t *off, kiln_err *err)
{
    for (int i = 0; i < out->n; i++) {
        const kiln_tensor_ref *ref = &out->items[i].ref;
        const void *p;
        if (kiln_transport_open(rx, ref, &p, err))
            return kiln_err_wrap(err, "%s", out->items[i].name);
        memcpy(dst + off[i], p, (size_t)ref->len);
        kiln_status st = kiln_transport_verify(rx, ref, err);
        kiln_transport_close(rx, ref);
        if (st)
            return kiln_err_wrap(err, "%s", out->items[i].name);
    }
    return KILN_OK;
}

int sched_images_take(kiln_sched *s, sched_replica *r, sched_job *j, kiln_msg *m, double now)
{
    kiln_msg_done *d = &m->done;
    const kiln_request *q = j->parent ? &j->parent->req.plan.req : &j->req.plan.req;
    if (!d->out.n) {
        kiln_metrics_image_handoffs(s->metrics, KILN_IMAGE_VIA_INLINE, d->n_images);
        return 0;
    }
    kiln_err err = {0};
    size_t off[KILN_PROTO_MAX_TENSORS], total = 0;
    uint8_t *bytes = NULL;
    kiln_status st = check_refs(j, q, d, &err);
    for (int i = 0; !st && i < d->out.n; i++)
        off[i] = total, total += (size_t)d->out.items[i].ref.len;
    if (!st && !(bytes = malloc(total)))
        st = kiln_err_set(&err, KILN_ERR_NOMEM, "out of memory for %zu bytes of images", total);
    if (!st)
        st = copy_files(s->opts.images, &d->out, bytes, off, &err);
    /* Read or not, the ranges are the decoder's again. */
    sched_free_map(s, &d->out);
    if (st) {
        kiln_metrics_image_handoffs(s->metrics, KILN_IMAGE_VIA_FAILED, d->out.n);
        free(bytes);
        kiln_msg_free(m);
        if (st == KILN_ERR_INVALID || st == KILN_ERR_NOMEM) {
            sched_detach(s, j);
            if (st == KILN_ERR_NOMEM)
                sched_fail(s, j, 503, "stage_unavailable", "the gateway is out of memory");
            else
                sched_fail(s, j, 500, "server_error", "the decode replica %s handed its images "
                           "wrongly: %s", r->id, err.msg);
        } else {
            KILN_LOG_WARN("gateway: request %s (job %llu): the images of %s cannot be read: %s",
                          j->req.request_id, (unsigned long long)j->id, r->id, err.msg);
            /* A slab that is there but cannot be mapped will not map next
             * time either: without this every request would fail twice. */
            if (st == KILN_ERR_IO && !r->images_inline) {
                r->images_inline = 1;
                KILN_LOG_WARN("gateway: %s's images come inline from now on", r->id);
            }
            sched_restart_lost(s, j, "images", KILN_STAGE_DECODE, now);
        }
        return 1;
    }
    /* Every row in order: those by reference from the copies, the others
     * as they came, in order. */
    kiln_bytes rows[KILN_PROTO_MAX_ROWS] = {0};
    for (int i = 0; i < d->out.n; i++)
        rows[kiln_image_ref_row(d->out.items[i].name)] =
            (kiln_bytes){bytes + off[i], (size_t)d->out.items[i].ref.len};
    int n_refs = d->out.n, next = 0;
    for (int row = 0; row < q->n; row++)
        if (!rows[row].data)
            rows[row] = d->images[next++];
    memcpy(d->images, rows, (size_t)q->n * sizeof *rows);
    d->n_images = q->n;
    d->out.n = 0;
    free(j->image_bytes);
    j->image_bytes = bytes;
    kiln_metrics_image_handoffs(s->metrics, KILN_IMAGE_VIA_SHM, n_refs);
    kiln_metrics_image_handoffs(s->metrics, KILN_IMAGE_VIA_INLINE, q->n - n_refs);
    return 0;
}
