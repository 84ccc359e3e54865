/* The transport interface's wrappers and the inline transport. */
#include "transport.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

void kiln_transport_destroy(kiln_transport *t)
{
    if (t)
        t->ops->destroy(t);
}

kiln_status kiln_transport_alloc(kiln_transport *t, kiln_dtype dt, int ndim, const int64_t *shape,
                                 kiln_tensor_ref *ref, void **ptr, kiln_err *err)
{
    memset(ref, 0, sizeof *ref);
    *ptr = NULL;
    ref->kind = t->kind;
    ref->dtype = dt;
    ref->ndim = ndim;
    if (ndim < 1 || ndim > KILN_MAX_DIMS)
        return kiln_err_set(err, KILN_ERR_INVALID, "transport: bad rank %d", ndim);
    uint64_t bytes = kiln_dtype_size(dt);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (shape[i] && bytes > UINT64_MAX / (uint64_t)shape[i]))
            return kiln_err_set(err, KILN_ERR_INVALID, "transport: bad shape");
        ref->shape[i] = shape[i];
        bytes *= (uint64_t)shape[i];
    }
    if (!bytes && !kiln_dtype_size(dt))
        return kiln_err_set(err, KILN_ERR_INVALID, "transport: bad dtype");
    if (bytes > SIZE_MAX / 2)
        return kiln_err_set(err, KILN_ERR_TOO_LARGE, "transport: tensor too large");
    ref->len = bytes;
    kiln_status st = t->ops->alloc(t, (size_t)bytes, ref, ptr, err);
    if (st)
        *ptr = NULL;
    return st;
}

kiln_status kiln_transport_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    if (ref->kind != t->kind)
        return kiln_err_set(err, KILN_ERR_INVALID, "transport %s: cannot free a %s reference",
                            kiln_ref_kind_name(t->kind), kiln_ref_kind_name(ref->kind));
    return t->ops->free(t, ref, err);
}

kiln_status kiln_transport_open(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                                kiln_err *err)
{
    *ptr = NULL;
    if (kiln_tensor_ref_check(ref, err))
        return err ? err->code : KILN_ERR_INVALID;
    if (ref->kind != t->kind)
        return kiln_err_set(err, KILN_ERR_INVALID, "transport %s: cannot open a %s reference",
                            kiln_ref_kind_name(t->kind), kiln_ref_kind_name(ref->kind));
    return t->ops->open(t, ref, ptr, err);
}

kiln_status kiln_transport_verify(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    if (ref->kind != t->kind)
        return kiln_err_set(err, KILN_ERR_INVALID, "transport %s: cannot verify a %s reference",
                            kiln_ref_kind_name(t->kind), kiln_ref_kind_name(ref->kind));
    return t->ops->verify(t, ref, err);
}

void kiln_transport_close(kiln_transport *t, const kiln_tensor_ref *ref)
{
    if (ref->kind == t->kind)
        t->ops->close(t, ref);
}

void kiln_transport_forget(kiln_transport *t, uint64_t epoch)
{
    if (t->ops->forget)
        t->ops->forget(t, epoch);
}

void kiln_transport_stats_get(kiln_transport *t, kiln_transport_stats *st)
{
    memset(st, 0, sizeof *st);
    t->ops->stats(t, st);
}

/* ---- inline ---- */

/* The producer's live buffers, so a free of anything else is refused
 * rather than handed to free(3). */
typedef struct inline_impl {
    pthread_mutex_t mu;
    void **live;
    size_t *sizes;
    int n, cap;
    int open;
} inline_impl;

static kiln_status inline_alloc(kiln_transport *t, size_t bytes, kiln_tensor_ref *ref, void **ptr,
                                kiln_err *err)
{
    inline_impl *im = t->impl;
    size_t rounded = (bytes + KILN_PROTO_ALIGN - 1) / KILN_PROTO_ALIGN * KILN_PROTO_ALIGN;
    void *p = aligned_alloc(KILN_PROTO_ALIGN, rounded ? rounded : KILN_PROTO_ALIGN);
    if (!p)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for an inline tensor");
    pthread_mutex_lock(&im->mu);
    if (im->n == im->cap) {
        int cap = im->cap ? 2 * im->cap : 16;
        void **live = realloc(im->live, (size_t)cap * sizeof *live);
        if (live)
            im->live = live;
        size_t *sizes = live ? realloc(im->sizes, (size_t)cap * sizeof *sizes) : NULL;
        if (sizes)
            im->sizes = sizes, im->cap = cap;
        if (!live || !sizes) {
            pthread_mutex_unlock(&im->mu);
            free(p);
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for an inline tensor");
        }
    }
    im->live[im->n] = p;
    im->sizes[im->n++] = bytes;
    pthread_mutex_unlock(&im->mu);
    ref->data = p;
    *ptr = p;
    return KILN_OK;
}

static kiln_status inline_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    inline_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    for (int i = 0; i < im->n; i++)
        if (im->live[i] == ref->data && im->sizes[i] == ref->len) {
            void *p = im->live[i];
            im->live[i] = im->live[--im->n];
            im->sizes[i] = im->sizes[im->n];
            pthread_mutex_unlock(&im->mu);
            free(p);
            return KILN_OK;
        }
    pthread_mutex_unlock(&im->mu);
    return kiln_err_set(err, KILN_ERR_INVALID, "inline transport: not a live buffer of ours");
}

static kiln_status inline_open(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                               kiln_err *err)
{
    (void)err;
    inline_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    im->open++;
    pthread_mutex_unlock(&im->mu);
    *ptr = ref->data;
    return KILN_OK;
}

/* Inline bytes belong to the message that carried them: nobody can free
 * or reuse them under the reader. */
static kiln_status inline_verify(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    (void)t, (void)ref, (void)err;
    return KILN_OK;
}

static void inline_close(kiln_transport *t, const kiln_tensor_ref *ref)
{
    (void)ref;
    inline_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    if (im->open > 0)
        im->open--;
    pthread_mutex_unlock(&im->mu);
}

static void inline_stats(kiln_transport *t, kiln_transport_stats *st)
{
    inline_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    st->live = im->n;
    for (int i = 0; i < im->n; i++)
        st->used_bytes += im->sizes[i];
    st->open = im->open;
    pthread_mutex_unlock(&im->mu);
}

static void inline_destroy(kiln_transport *t)
{
    inline_impl *im = t->impl;
    for (int i = 0; i < im->n; i++)
        free(im->live[i]);
    free(im->live);
    free(im->sizes);
    pthread_mutex_destroy(&im->mu);
    free(im);
    free(t);
}

static const kiln_transport_ops inline_ops = {
    .alloc = inline_alloc, .free = inline_free, .open = inline_open, .close = inline_close,
    .verify = inline_verify, .stats = inline_stats, .destroy = inline_destroy,
};

kiln_transport *kiln_transport_inline_create(kiln_err *err)
{
    kiln_transport *t = calloc(1, sizeof *t);
    inline_impl *im = calloc(1, sizeof *im);
    if (!t || !im || pthread_mutex_init(&im->mu, NULL)) {
        free(t), free(im);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    t->ops = &inline_ops;
    t->kind = KILN_REF_INLINE;
    t->impl = im;
    return t;
}
