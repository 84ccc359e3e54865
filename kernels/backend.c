#include "backend.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend_impl.h"

kiln_backend *kiln_backend_create(const char *name, int device, kiln_err *err)
{
    if (!strcmp(name, "cpu"))
        return kiln_cpu_backend_create(err);
#ifdef KILN_HAVE_CUDA
    if (!strcmp(name, "cuda"))
        return kiln_cuda_backend_create(device, err);
#else
    (void)device;
    if (!strcmp(name, "cuda")) {
        kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this build of kiln has no CUDA backend");
        return NULL;
    }
#endif
    kiln_err_set(err, KILN_ERR_INVALID, "unknown backend '%s' (expected cpu or cuda)", name);
    return NULL;
}

void kiln_backend_destroy(kiln_backend *be)
{
    if (be)
        be->ops->destroy(be);
}

kiln_status kiln_backend_mem_info(kiln_backend *be, size_t *used_bytes, size_t *total_bytes,
                                  kiln_err *err)
{
    size_t free_b = 0, total = 0;
    if (!be->ops->mem_info)
        return kiln_err_set(err, KILN_ERR_UNSUPPORTED, "the %s backend has no device memory",
                            be->name);
    kiln_status st = be->ops->mem_info(be, &free_b, &total);
    if (st)
        return kiln_err_set(err, st, "%s backend: cannot read the device's memory", be->name);
    *used_bytes = total - free_b;
    *total_bytes = total;
    return KILN_OK;
}

kiln_status kiln_be_check(kiln_backend *be, kiln_err *err)
{
    kiln_status st = be->error.code;
    if (st && err)
        *err = be->error;
    if (!kiln_be_lost(be))
        kiln_err_clear(&be->error);
    return st;
}

void kiln_be_lose(kiln_backend *be, const char *fmt, ...)
{
    char msg[KILN_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    kiln_err_set(&be->error, KILN_ERR_DEVICE, "device lost: %s", msg);
    __atomic_store_n(&be->lost, 1, __ATOMIC_RELEASE);
}

int kiln_be_lost(const kiln_backend *be) { return __atomic_load_n(&be->lost, __ATOMIC_ACQUIRE); }

void kiln_be_set_cancel(kiln_backend *be, int (*cancel)(void *user), void *user)
{
    be->cancel = cancel;
    be->cancel_user = user;
}

void kiln_be_fail(kiln_backend *be, kiln_status code, const char *fmt, ...)
{
    if (be->error.code)
        return;
    be->error.code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(be->error.msg, sizeof be->error.msg, fmt, ap);
    va_end(ap);
}

kiln_status kiln_be_alloc(kiln_backend *be, kiln_tensor *t, kiln_dtype dt, int ndim,
                          const int64_t *shape)
{
    memset(t, 0, sizeof *t);
    if (be->error.code)
        return be->error.code;
    kiln_status st = be->ops->alloc(be, t, dt, ndim, shape);
    if (st && !be->error.code)
        kiln_be_fail(be, st, "backend allocation failed");
    return st;
}

void kiln_be_free(kiln_backend *be, kiln_tensor *t)
{
    if (t && t->data)
        be->ops->free(be, t);
}

kiln_status kiln_be_from_host(kiln_backend *be, kiln_tensor *t, int ndim, const int64_t *shape,
                              const void *host, kiln_dtype host_dtype)
{
    if (kiln_be_alloc(be, t, be->act_dtype, ndim, shape))
        return be->error.code;
    be->ops->upload(be, t, host, host_dtype);
    return be->error.code;
}

/* --- arena ---------------------------------------------------------------- */

#define ARENA_ALIGN 256 /* enough for vectorised CPU loops and CUDA loads */
#define ARENA_MAX_BLOCKS 64

struct kiln_arena {
    kiln_backend *be;
    kiln_tensor blocks[ARENA_MAX_BLOCKS];
    size_t sizes[ARENA_MAX_BLOCKS];
    int nblocks;
    size_t used; /* in the last block */
    size_t total_requested;
    size_t block_start; /* total_requested when the last block was added */
    size_t high;        /* most of total_requested since the reset (rewinds lower it) */
    uint64_t epoch;
};

kiln_arena *kiln_arena_create(kiln_backend *be, size_t initial_bytes, kiln_err *err)
{
    kiln_arena *a = calloc(1, sizeof *a);
    if (!a) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    a->be = be;
    if (initial_bytes) {
        if (be->ops->alloc(be, &a->blocks[0], KILN_U8, 1, (int64_t[]){(int64_t)initial_bytes})) {
            kiln_err_set(err, KILN_ERR_NOMEM, "cannot allocate %zu bytes of scratch memory",
                         initial_bytes);
            free(a);
            return NULL;
        }
        a->sizes[0] = initial_bytes;
        a->nblocks = 1;
    }
    return a;
}

void kiln_arena_destroy(kiln_arena *a)
{
    if (!a)
        return;
    for (int i = 0; i < a->nblocks; i++)
        a->be->ops->free(a->be, &a->blocks[i]);
    free(a);
}

static int arena_grow(kiln_arena *a, size_t need)
{
    if (a->nblocks == ARENA_MAX_BLOCKS)
        return -1;
    size_t size = need;
    if (a->nblocks && a->sizes[a->nblocks - 1] * 2 > size)
        size = a->sizes[a->nblocks - 1] * 2;
    if (size < (1u << 20))
        size = 1u << 20;
    kiln_tensor *b = &a->blocks[a->nblocks];
    if (a->be->ops->alloc(a->be, b, KILN_U8, 1, (int64_t[]){(int64_t)size}))
        return -1;
    a->epoch++;
    a->sizes[a->nblocks++] = size;
    a->used = 0;
    a->block_start = a->total_requested;
    return 0;
}

kiln_status kiln_arena_tensor(kiln_arena *a, kiln_tensor *t, kiln_dtype dt, int ndim,
                              const int64_t *shape)
{
    kiln_backend *be = a->be;
    kiln_tensor_set_shape(t, dt, ndim, shape);
    t->data = NULL;
    t->on_device = strcmp(be->name, "cpu") != 0;
    if (be->error.code)
        return be->error.code;
    size_t bytes = (kiln_tensor_nbytes(t) + ARENA_ALIGN - 1) & ~(size_t)(ARENA_ALIGN - 1);
    if (!a->nblocks || a->used + bytes > a->sizes[a->nblocks - 1]) {
        if (arena_grow(a, bytes)) {
            kiln_be_fail(be, KILN_ERR_NOMEM, "cannot grow scratch memory by %zu bytes", bytes);
            return KILN_ERR_NOMEM;
        }
    }
    t->data = (char *)a->blocks[a->nblocks - 1].data + a->used;
    a->used += bytes;
    a->total_requested += bytes;
    if (a->total_requested > a->high)
        a->high = a->total_requested;
    return KILN_OK;
}

void kiln_arena_reset(kiln_arena *a)
{
    /* Several blocks mean the last forward outgrew the arena: replace them by
     * one block that fits the whole of it, so the next forward allocates
     * nothing. */
    if (a->nblocks > 1) {
        size_t want = a->high;
        for (int i = 0; i < a->nblocks; i++)
            a->be->ops->free(a->be, &a->blocks[i]);
        a->nblocks = 0;
        if (arena_grow(a, want))
            kiln_be_fail(a->be, KILN_ERR_NOMEM, "cannot allocate %zu bytes of scratch", want);
    }
    a->used = 0;
    a->total_requested = 0;
    a->block_start = 0;
    a->high = 0;
}

kiln_status kiln_arena_reserve(kiln_arena *a, size_t bytes)
{
    kiln_backend *be = a->be;
    if (be->error.code)
        return be->error.code;
    if (a->total_requested) {
        kiln_be_fail(be, KILN_ERR_INTERNAL, "arena: reserve with tensors handed out");
        return KILN_ERR_INTERNAL;
    }
    if (a->nblocks == 1 && a->sizes[0] >= bytes)
        return KILN_OK;
    for (int i = 0; i < a->nblocks; i++)
        be->ops->free(be, &a->blocks[i]);
    a->nblocks = 0;
    a->epoch++;
    if (arena_grow(a, bytes)) {
        kiln_be_fail(be, KILN_ERR_NOMEM, "cannot allocate %zu bytes of scratch", bytes);
        return KILN_ERR_NOMEM;
    }
    return KILN_OK;
}

size_t kiln_arena_mark(const kiln_arena *a) { return a->total_requested; }

void kiln_arena_rewind(kiln_arena *a, size_t mark)
{
    if (mark > a->total_requested || mark < a->block_start)
        return;
    a->used = mark - a->block_start;
    a->total_requested = mark;
}

uint64_t kiln_arena_epoch(const kiln_arena *a) { return a->epoch; }

size_t kiln_arena_capacity(const kiln_arena *a)
{
    size_t total = 0;
    for (int i = 0; i < a->nblocks; i++)
        total += a->sizes[i];
    return total;
}
