/* The cuda_ipc transport: device slabs exported once with
 * cudaIpcGetMemHandle, first-fit ranges, and a consumer-side cache of
 * cudaIpcOpenMemHandle mappings.  Built for real only with the CUDA
 * backend (KILN_HAVE_CUDA); otherwise creation reports that the build has
 * no CUDA. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport.h"

#ifdef KILN_HAVE_CUDA
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "log.h"
#include "slab_ranges.h"

#define MIB ((size_t)1 << 20)
#define DEFAULT_SLAB (64 * MIB)
#define DEFAULT_MAX ((size_t)16 << 30)
#define MAX_IDLE_MAPPINGS 16

_Static_assert(sizeof(cudaIpcMemHandle_t) <= KILN_PROTO_IPC_HANDLE,
               "a CUDA IPC handle must fit in a tensor reference");

typedef struct dslab {
    char name[KILN_PROTO_SLAB_MAX];
    uint8_t *base; /* device memory */
    size_t size;
    cudaIpcMemHandle_t handle;
    kiln_slab_ranges ranges;
} dslab;

typedef struct dmap {
    char name[KILN_PROTO_SLAB_MAX];
    uint8_t handle[KILN_PROTO_IPC_HANDLE];
    uint8_t *base;
    int refs;
    uint64_t last_use;
} dmap;

typedef struct ipc_impl {
    pthread_mutex_t mu;
    char owner[KILN_PROTO_ID_MAX];
    char stage[16];
    int device;
    size_t slab_bytes, max_bytes, total;
    dslab **slabs; /* pointers: the process registry refers to them */
    int n_slabs, cap_slabs;
    dmap *maps;
    int n_maps, cap_maps, open, local_open;
    uint64_t tick;
} ipc_impl;

/* Slabs exported by this process.  CUDA refuses cudaIpcOpenMemHandle on
 * memory of the calling process, so a consumer in the producer's own
 * process (tests, stages sharing a process) finds the slab here instead. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static dslab **registry;
static int n_registry, cap_registry;
static atomic_uint next_slab_id;

static int registry_add(dslab *s)
{
    pthread_mutex_lock(&registry_mu);
    if (n_registry == cap_registry) {
        int cap = cap_registry ? 2 * cap_registry : 8;
        dslab **v = realloc(registry, (size_t)cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&registry_mu);
            return -1;
        }
        registry = v, cap_registry = cap;
    }
    registry[n_registry++] = s;
    pthread_mutex_unlock(&registry_mu);
    return 0;
}

static void registry_remove(dslab *s)
{
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < n_registry; i++)
        if (registry[i] == s) {
            registry[i] = registry[--n_registry];
            break;
        }
    pthread_mutex_unlock(&registry_mu);
}

/* Runs with `device` current, restoring the caller's device after. */
typedef struct device_scope {
    int prev, ok;
} device_scope;

static cudaError_t scope_enter(device_scope *sc, int device)
{
    sc->ok = cudaGetDevice(&sc->prev) == cudaSuccess;
    return cudaSetDevice(device);
}

static void scope_leave(device_scope *sc)
{
    if (sc->ok)
        cudaSetDevice(sc->prev);
}

static kiln_status cuda_fail(kiln_err *err, cudaError_t e, const char *what)
{
    cudaGetLastError(); /* clear it: these errors are not sticky */
    return kiln_err_set(err, e == cudaErrorMemoryAllocation ? KILN_ERR_NOMEM : KILN_ERR_DEVICE,
                        "cuda_ipc: %s: %s", what, cudaGetErrorString(e));
}

/* "/kiln-cuda-<stage>-<pid>-<n>-<MiB>": the size travels in the label so
 * a consumer can bound-check offsets without asking the driver. */
static size_t label_size(const char *name)
{
    const char *dash = strrchr(name, '-');
    if (!dash || !dash[1])
        return 0;
    char *end;
    unsigned long long mib = strtoull(dash + 1, &end, 10);
    return *end || mib > SIZE_MAX / MIB ? 0 : (size_t)mib * MIB;
}

static kiln_status new_slab(ipc_impl *im, size_t size, dslab **out, kiln_err *err)
{
    if (im->total + size > im->max_bytes)
        return kiln_err_set(err, KILN_ERR_BUSY, "cuda_ipc pool full (%zu of %zu bytes in slabs)",
                            im->total, im->max_bytes);
    if (im->n_slabs == im->cap_slabs) {
        int cap = im->cap_slabs ? 2 * im->cap_slabs : 4;
        dslab **v = realloc(im->slabs, (size_t)cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        im->slabs = v, im->cap_slabs = cap;
    }
    dslab *s = calloc(1, sizeof *s);
    if (!s || kiln_slab_ranges_init(&s->ranges, size)) {
        free(s);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    snprintf(s->name, sizeof s->name, "/kiln-cuda-%s-%ld-%u-%zu", im->stage, (long)getpid(),
             atomic_fetch_add(&next_slab_id, 1), size / MIB);
    s->size = size;
    device_scope sc;
    cudaError_t e = scope_enter(&sc, im->device);
    const char *what = "cudaSetDevice";
    if (e == cudaSuccess) {
        what = "cudaMalloc";
        e = cudaMalloc((void **)&s->base, size);
    }
    if (e == cudaSuccess) {
        what = "cudaIpcGetMemHandle";
        e = cudaIpcGetMemHandle(&s->handle, s->base);
    }
    if (e != cudaSuccess || registry_add(s)) {
        if (s->base)
            cudaFree(s->base);
        scope_leave(&sc);
        kiln_slab_ranges_release(&s->ranges);
        free(s);
        return e != cudaSuccess ? cuda_fail(err, e, what)
                                : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    scope_leave(&sc);
    im->slabs[im->n_slabs++] = s;
    im->total += size;
    *out = s;
    return KILN_OK;
}

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static kiln_status ipc_alloc(kiln_transport *t, size_t bytes, kiln_tensor_ref *ref, void **ptr,
                             kiln_err *err)
{
    ipc_impl *im = t->impl;
    uint64_t len = round_up(bytes ? bytes : 1, KILN_PROTO_ALIGN), off = 0;
    pthread_mutex_lock(&im->mu);
    dslab *s = NULL;
    for (int i = 0; i < im->n_slabs && !s; i++)
        if (!kiln_slab_ranges_take(&im->slabs[i]->ranges, len, &off))
            s = im->slabs[i];
    kiln_status st = KILN_OK;
    if (!s) {
        size_t size = len > im->slab_bytes ? round_up(len, MIB) : im->slab_bytes;
        st = new_slab(im, size, &s, err);
        if (!st && kiln_slab_ranges_take(&s->ranges, len, &off))
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    if (!st) {
        snprintf(ref->owner, sizeof ref->owner, "%s", im->owner);
        snprintf(ref->slab, sizeof ref->slab, "%s", s->name);
        ref->off = off;
        memcpy(ref->handle, &s->handle, sizeof s->handle);
        ref->device = im->device;
        *ptr = s->base + off;
    }
    pthread_mutex_unlock(&im->mu);
    return st;
}

static kiln_status ipc_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err)
{
    ipc_impl *im = t->impl;
    uint64_t len = round_up(ref->len ? ref->len : 1, KILN_PROTO_ALIGN);
    if (strcmp(ref->owner, im->owner))
        return kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc free: owned by %s, not %s",
                            ref->owner, im->owner);
    int rc = 1;
    pthread_mutex_lock(&im->mu);
    for (int i = 0; i < im->n_slabs; i++)
        if (!strcmp(im->slabs[i]->name, ref->slab)) {
            rc = kiln_slab_ranges_give(&im->slabs[i]->ranges, ref->off, len);
            break;
        }
    pthread_mutex_unlock(&im->mu);
    if (rc < 0)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (rc)
        return kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc free: %s+%llu is not a live range",
                            ref->slab, (unsigned long long)ref->off);
    return KILN_OK;
}

/* A slab of this process with the ref's label and handle, or NULL. */
static uint8_t *local_slab(const kiln_tensor_ref *ref)
{
    uint8_t *base = NULL;
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < n_registry && !base; i++)
        if (!strcmp(registry[i]->name, ref->slab) &&
            !memcmp(&registry[i]->handle, ref->handle, sizeof registry[i]->handle))
            base = registry[i]->base;
    pthread_mutex_unlock(&registry_mu);
    return base;
}

static dmap *find_map(ipc_impl *im, const kiln_tensor_ref *ref)
{
    for (int i = 0; i < im->n_maps; i++)
        if (!strcmp(im->maps[i].name, ref->slab) &&
            !memcmp(im->maps[i].handle, ref->handle, sizeof im->maps[i].handle))
            return &im->maps[i];
    return NULL;
}

static void unmap(ipc_impl *im, int i)
{
    device_scope sc;
    if (scope_enter(&sc, im->device) == cudaSuccess) {
        cudaError_t e = cudaIpcCloseMemHandle(im->maps[i].base);
        if (e != cudaSuccess) {
            cudaGetLastError();
            KILN_LOG_WARN("cudaIpcCloseMemHandle %s: %s", im->maps[i].name, cudaGetErrorString(e));
        }
    }
    scope_leave(&sc);
    im->maps[i] = im->maps[--im->n_maps];
}

/* Closes the least recently used idle mapping once there are too many. */
static void evict(ipc_impl *im)
{
    int idle = 0, lru = -1;
    for (int i = 0; i < im->n_maps; i++)
        if (!im->maps[i].refs) {
            idle++;
            if (lru < 0 || im->maps[i].last_use < im->maps[lru].last_use)
                lru = i;
        }
    if (idle > MAX_IDLE_MAPPINGS)
        unmap(im, lru);
}

static kiln_status map_slab(ipc_impl *im, const kiln_tensor_ref *ref, dmap **out, kiln_err *err)
{
    if (im->n_maps == im->cap_maps) {
        int cap = im->cap_maps ? 2 * im->cap_maps : 8;
        dmap *v = realloc(im->maps, (size_t)cap * sizeof *v);
        if (!v)
            return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        im->maps = v, im->cap_maps = cap;
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, ref->handle, sizeof h);
    void *base = NULL;
    device_scope sc;
    cudaError_t e = scope_enter(&sc, im->device);
    /* Lazy peer access: a slab of another (peer-capable) GPU maps too. */
    if (e == cudaSuccess)
        e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    scope_leave(&sc);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaIpcOpenMemHandle");
    dmap *m = &im->maps[im->n_maps++];
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", ref->slab);
    memcpy(m->handle, ref->handle, sizeof m->handle);
    m->base = base;
    *out = m;
    return KILN_OK;
}

static kiln_status ipc_open(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                            kiln_err *err)
{
    ipc_impl *im = t->impl;
    size_t size = label_size(ref->slab);
    if (!size || strncmp(ref->slab, "/kiln-cuda-", 11) || ref->off > size ||
        ref->len > size - ref->off)
        return kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc ref %s+%llu (%llu bytes) outside "
                            "its slab", ref->slab, (unsigned long long)ref->off,
                            (unsigned long long)ref->len);
    uint8_t *local = local_slab(ref);
    pthread_mutex_lock(&im->mu);
    kiln_status st = KILN_OK;
    if (local) {
        im->local_open++;
        *ptr = local + ref->off;
    } else {
        dmap *m = find_map(im, ref);
        st = m ? KILN_OK : map_slab(im, ref, &m, err);
        if (!st) {
            m->refs++;
            m->last_use = ++im->tick;
            *ptr = m->base + ref->off;
        }
    }
    if (!st)
        im->open++;
    pthread_mutex_unlock(&im->mu);
    return st;
}

static void ipc_close(kiln_transport *t, const kiln_tensor_ref *ref)
{
    ipc_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    dmap *m = find_map(im, ref);
    if (m && m->refs > 0) {
        m->refs--;
        im->open--;
        evict(im);
    } else if (!m && im->local_open > 0) {
        im->local_open--;
        im->open--;
    }
    pthread_mutex_unlock(&im->mu);
}

static void ipc_stats(kiln_transport *t, kiln_transport_stats *st)
{
    ipc_impl *im = t->impl;
    pthread_mutex_lock(&im->mu);
    st->slabs = im->n_slabs;
    st->slab_bytes = im->total;
    for (int i = 0; i < im->n_slabs; i++) {
        int live;
        st->used_bytes += kiln_slab_ranges_used(&im->slabs[i]->ranges, &live);
        st->live += live;
    }
    st->mapped = im->n_maps;
    st->open = im->open;
    pthread_mutex_unlock(&im->mu);
}

static void ipc_destroy(kiln_transport *t)
{
    ipc_impl *im = t->impl;
    while (im->n_maps)
        unmap(im, im->n_maps - 1);
    device_scope sc;
    int entered = scope_enter(&sc, im->device) == cudaSuccess;
    for (int i = 0; i < im->n_slabs; i++) {
        dslab *s = im->slabs[i];
        registry_remove(s);
        if (entered && cudaFree(s->base) != cudaSuccess)
            KILN_LOG_WARN("cudaFree of slab %s failed", s->name);
        kiln_slab_ranges_release(&s->ranges);
        free(s);
    }
    scope_leave(&sc);
    free(im->slabs), free(im->maps);
    pthread_mutex_destroy(&im->mu);
    free(im);
    free(t);
}

static const kiln_transport_ops ipc_ops = {
    .alloc = ipc_alloc, .free = ipc_free, .open = ipc_open,
    .close = ipc_close, .stats = ipc_stats, .destroy = ipc_destroy,
};

kiln_transport *kiln_transport_cuda_ipc_create(const char *owner, const char *stage, int device,
                                               size_t slab_bytes, size_t max_bytes, kiln_err *err)
{
    if (!owner || !*owner || strlen(owner) >= KILN_PROTO_ID_MAX || !stage || !*stage ||
        strlen(stage) >= sizeof(((ipc_impl *)0)->stage) || device < 0 || device > 1023) {
        kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc transport: bad owner, stage or device");
        return NULL;
    }
    for (const char *p = stage; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9'))) {
            kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc transport: stage must be [a-z0-9]");
            return NULL;
        }
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || device >= count) {
        cudaGetLastError();
        kiln_err_set(err, KILN_ERR_UNAVAILABLE, "cuda_ipc transport: no CUDA device %d (%s)",
                     device, e != cudaSuccess ? cudaGetErrorString(e) : "out of range");
        return NULL;
    }
    kiln_transport *t = calloc(1, sizeof *t);
    ipc_impl *im = calloc(1, sizeof *im);
    if (!t || !im || pthread_mutex_init(&im->mu, NULL)) {
        free(t), free(im);
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    snprintf(im->owner, sizeof im->owner, "%s", owner);
    snprintf(im->stage, sizeof im->stage, "%s", stage);
    im->device = device;
    im->slab_bytes = round_up(slab_bytes ? slab_bytes : DEFAULT_SLAB, MIB);
    im->max_bytes = max_bytes ? max_bytes : DEFAULT_MAX;
    t->ops = &ipc_ops;
    t->kind = KILN_REF_CUDA_IPC;
    t->impl = im;
    return t;
}

int kiln_transport_cuda_ipc_reachable(int consumer_device, int producer_device)
{
    if (consumer_device == producer_device)
        return 1;
    int can = 0;
    if (cudaDeviceCanAccessPeer(&can, consumer_device, producer_device) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return can;
}

int kiln_transport_cuda_ipc_all_reachable(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        cudaGetLastError();
        return 0;
    }
    for (int a = 0; a < n; a++)
        for (int b = 0; b < n; b++)
            if (!kiln_transport_cuda_ipc_reachable(a, b))
                return 0;
    return 1;
}

#else /* !KILN_HAVE_CUDA */

kiln_transport *kiln_transport_cuda_ipc_create(const char *owner, const char *stage, int device,
                                               size_t slab_bytes, size_t max_bytes, kiln_err *err)
{
    (void)owner, (void)stage, (void)device, (void)slab_bytes, (void)max_bytes;
    kiln_err_set(err, KILN_ERR_UNSUPPORTED, "this build of kiln has no CUDA (cuda_ipc transport)");
    return NULL;
}

int kiln_transport_cuda_ipc_reachable(int consumer_device, int producer_device)
{
    (void)consumer_device, (void)producer_device;
    return 0;
}

int kiln_transport_cuda_ipc_all_reachable(void) { return 0; }

#endif
