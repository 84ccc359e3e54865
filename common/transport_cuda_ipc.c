/* The cuda_ipc transport: device slabs made with cudaMalloc and exported
 * once with cudaIpcGetMemHandle, mapped by consumers with
 * cudaIpcOpenMemHandle; the bookkeeping around them is common/slab_table's.
 * Built for real only with the CUDA backend (KILN_HAVE_CUDA); otherwise
 * creation reports that the build has no CUDA. */
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
#include "slab_table.h"

#define MIB ((size_t)1 << 20)

_Static_assert(sizeof(cudaIpcMemHandle_t) <= KILN_PROTO_IPC_HANDLE,
               "a CUDA IPC handle must fit in a tensor reference");

/* Slabs exported by this process.  CUDA refuses cudaIpcOpenMemHandle on
 * memory of the calling process, so a consumer in the producer's own
 * process (tests, stages sharing a process) finds the slab here instead. */
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;
static const kiln_slab **registry;
static int n_registry, cap_registry;
static atomic_uint next_slab_id;

static int registry_add(const kiln_slab *s)
{
    pthread_mutex_lock(&registry_mu);
    if (n_registry == cap_registry) {
        int cap = cap_registry ? 2 * cap_registry : 8;
        const kiln_slab **v = realloc(registry, (size_t)cap * sizeof *v);
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

static void registry_remove(const kiln_slab *s)
{
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < n_registry; i++)
        if (registry[i] == s) {
            registry[i] = registry[--n_registry];
            break;
        }
    pthread_mutex_unlock(&registry_mu);
}

/* A slab of this process with the ref's label and handle, or NULL. */
static const uint8_t *local_slab(const kiln_tensor_ref *ref)
{
    const uint8_t *base = NULL;
    pthread_mutex_lock(&registry_mu);
    for (int i = 0; i < n_registry && !base; i++)
        if (!strcmp(registry[i]->name, ref->slab) &&
            !memcmp(registry[i]->handle, ref->handle, sizeof registry[i]->handle))
            base = registry[i]->base;
    pthread_mutex_unlock(&registry_mu);
    return base;
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

/* "/kiln-cuda-<stage>-<epoch>-<pid>-<n>-<MiB>": the size travels in the label so
 * a consumer can bound-check offsets without asking the driver.  0 for a
 * label that is not one of these. */
static size_t label_size(const char *name)
{
    if (strncmp(name, "/kiln-cuda-", 11))
        return 0;
    const char *dash = strrchr(name, '-');
    if (!dash || !dash[1])
        return 0;
    char *end;
    unsigned long long mib = strtoull(dash + 1, &end, 10);
    return *end || mib > SIZE_MAX / MIB ? 0 : (size_t)mib * MIB;
}

static size_t ref_size(const kiln_tensor_ref *ref) { return label_size(ref->slab); }

static kiln_status ipc_make(kiln_slab *s, const char *stage, uint64_t epoch, int device,
                            kiln_err *err)
{
    /* The epoch keeps labels unique per process instance, as shm names
     * (a label only names a slab in frees and logs: the handle maps it). */
    snprintf(s->name, sizeof s->name, "/kiln-cuda-%s-%016llx-%ld-%u-%zu", stage,
             (unsigned long long)epoch, (long)getpid(), atomic_fetch_add(&next_slab_id, 1),
             s->size / MIB);
    cudaIpcMemHandle_t handle;
    device_scope sc;
    cudaError_t e = scope_enter(&sc, device);
    const char *what = "cudaSetDevice";
    if (e == cudaSuccess) {
        what = "cudaMalloc";
        e = cudaMalloc((void **)&s->base, s->size);
    }
    if (e == cudaSuccess) {
        what = "cudaIpcGetMemHandle";
        e = cudaIpcGetMemHandle(&handle, s->base);
    }
    if (e == cudaSuccess)
        memcpy(s->handle, &handle, sizeof handle);
    if (e != cudaSuccess || registry_add(s)) {
        if (s->base)
            cudaFree(s->base);
        scope_leave(&sc);
        return e != cudaSuccess ? cuda_fail(err, e, what)
                                : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    scope_leave(&sc);
    return KILN_OK;
}

static void ipc_unmake(kiln_slab *s, int device)
{
    registry_remove(s);
    device_scope sc;
    if (scope_enter(&sc, device) == cudaSuccess && cudaFree(s->base) != cudaSuccess)
        KILN_LOG_WARN("cudaFree of slab %s failed", s->name);
    scope_leave(&sc);
}

static kiln_status ipc_map(kiln_slab_map *m, int device, kiln_err *err)
{
    cudaIpcMemHandle_t h;
    memcpy(&h, m->handle, sizeof h);
    void *base = NULL;
    device_scope sc;
    cudaError_t e = scope_enter(&sc, device);
    /* Lazy peer access: a slab of another (peer-capable) GPU maps too. */
    if (e == cudaSuccess)
        e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    scope_leave(&sc);
    if (e != cudaSuccess)
        return cuda_fail(err, e, "cudaIpcOpenMemHandle");
    m->base = base;
    m->size = label_size(m->name); /* open has checked the range against it */
    return KILN_OK;
}

static void ipc_unmap(const kiln_slab_map *m, int device)
{
    device_scope sc;
    if (scope_enter(&sc, device) == cudaSuccess) {
        cudaError_t e = cudaIpcCloseMemHandle((void *)m->base);
        if (e != cudaSuccess) {
            cudaGetLastError();
            KILN_LOG_WARN("cudaIpcCloseMemHandle %s: %s", m->name, cudaGetErrorString(e));
        }
    }
    scope_leave(&sc);
}

/* Range headers (slab_table.c) live in device memory: 64 bytes each way,
 * synchronous, outside any stream the callers order their work on. */
static kiln_status ipc_copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind,
                            int device, kiln_err *err)
{
    device_scope sc;
    cudaError_t e = scope_enter(&sc, device);
    if (e == cudaSuccess)
        e = cudaMemcpy(dst, src, n, kind);
    scope_leave(&sc);
    return e == cudaSuccess ? KILN_OK : cuda_fail(err, e, "copying a range header");
}

static kiln_status ipc_copy_in(uint8_t *dst, const void *src, size_t n, int device, kiln_err *err)
{
    return ipc_copy(dst, src, n, cudaMemcpyHostToDevice, device, err);
}

static kiln_status ipc_copy_out(void *dst, const uint8_t *src, size_t n, int device, kiln_err *err)
{
    return ipc_copy(dst, src, n, cudaMemcpyDeviceToHost, device, err);
}

static const kiln_slab_kind ipc_kind = {
    .ref_kind = KILN_REF_CUDA_IPC,
    .slab_round = MIB, /* labels state sizes in MiB */
    .default_max = (size_t)16 << 30,
    .max_idle_maps = 16,
    .handle_keyed = 1,
    .make = ipc_make, .unmake = ipc_unmake, .map = ipc_map, .unmap = ipc_unmap,
    .local = local_slab, .ref_size = ref_size, .copy_in = ipc_copy_in, .copy_out = ipc_copy_out,
};

kiln_transport *kiln_transport_cuda_ipc_create(const char *owner, uint64_t epoch,
                                               const char *stage, int device, size_t slab_bytes,
                                               size_t max_bytes, kiln_err *err)
{
    if (device < 0 || device > 1023) {
        kiln_err_set(err, KILN_ERR_INVALID, "cuda_ipc transport: bad device %d", device);
        return NULL;
    }
    kiln_transport *t = kiln_slab_table_create(&ipc_kind, owner, epoch, stage, device, slab_bytes,
                                               max_bytes, err);
    if (!t)
        return NULL;
    /* Asked after the names are checked, so that a bad name is reported as
     * one on any host. */
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || device >= count) {
        cudaGetLastError();
        kiln_err_set(err, KILN_ERR_UNAVAILABLE, "cuda_ipc transport: no CUDA device %d (%s)",
                     device, e != cudaSuccess ? cudaGetErrorString(e) : "out of range");
        kiln_transport_destroy(t);
        return NULL;
    }
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

kiln_transport *kiln_transport_cuda_ipc_create(const char *owner, uint64_t epoch,
                                               const char *stage, int device, size_t slab_bytes,
                                               size_t max_bytes, kiln_err *err)
{
    (void)owner, (void)epoch, (void)stage, (void)device, (void)slab_bytes, (void)max_bytes;
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
