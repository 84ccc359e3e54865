/* kiln tensor transports: how a stage hands a tensor to the next stage
 * without sending its bytes through the gateway (docs/ARCHITECTURE.md,
 * "Tensor references").
 *
 *   // producer (owner of the memory)
 *   kiln_transport *tx = kiln_transport_shm_create("encode-box-42", epoch, "encode", 0, 0, &err);
 *   kiln_tensor_ref ref; void *p;
 *   kiln_transport_alloc(tx, KILN_F32, 3, shape, &ref, &p, &err);
 *   memcpy(p, bytes, ref.len);          // then send ref in a message
 *   ... on `free` from the gateway: kiln_transport_free(tx, &ref, &err);
 *
 *   // consumer (any process on the host)
 *   const void *data;
 *   kiln_transport_open(rx, &ref, &data, &err);   // maps the slab once, cached
 *   ... use data (read-only) ...
 *   if (kiln_transport_verify(rx, &ref, &err)) ...the range changed under us: discard...
 *   kiln_transport_close(rx, &ref);                // then send `release`
 *
 * One interface (kiln_transport_ops) with three implementations: `shm`
 * (POSIX shared-memory slabs), `inline` (bytes carried in the message) and
 * `cuda_ipc` (device slabs, in builds with the CUDA backend).  shm and
 * cuda_ipc share their slab bookkeeping (common/slab_table.h).
 *
 * shm: a producer creates slabs named /kiln-<stage>-<epoch>-<pid>-<n> on
 * demand (unique per process instance: the epoch is its random
 * incarnation), holds an flock on each for its life, reserves them with
 * posix_fallocate (a full /dev/shm is an error here, not a SIGBUS later)
 * and hands out 64-byte-aligned ranges first-fit from each slab's free
 * list, merging neighbours on free; a range returns to the pool only when
 * the owner frees it, naming its generation (slab_table.h), and a slab
 * whose name disappears from /dev/shm is retired for a new one.  Its
 * slabs are unlinked when it is destroyed; kiln_transport_shm_clean_stale
 * removes those of dead processes.  A consumer maps each slab read-only
 * once and keeps the mapping (at most 64 idle mappings; one in use is
 * never unmapped).
 *
 * Thread-safety: every function may be called from any thread (a mutex
 * guards each transport); the memory behind an open reference may be read
 * concurrently.
 */
#ifndef KILN_TRANSPORT_H
#define KILN_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "proto.h"
#include "tensor.h"

typedef struct kiln_transport kiln_transport;

typedef struct kiln_transport_stats {
    int slabs;         /* producer: slabs created */
    size_t slab_bytes; /* producer: their total size */
    size_t used_bytes; /* producer: bytes in live ranges */
    int live;          /* producer: live ranges */
    int mapped;        /* consumer: slabs mapped */
    int open;          /* consumer: references opened and not closed */
    int refused;       /* producer: frees refused (not a live range of ours) */
    int lost;          /* producer: slabs retired because consumers could no longer open them */
    /* producer: the size of the last slab it could not make for want of
     * memory (shm: no room left in /dev/shm; cuda_ipc: device memory), 0
     * once it made one since */
    size_t short_bytes;
} kiln_transport_stats;

typedef struct kiln_transport_ops {
    /* Reserves `bytes` (> 0) and fills the ref's kind, owner, slab, off and
     * len; *ptr is where the producer writes them (host memory for shm and
     * inline, device memory for cuda_ipc).  KILN_ERR_NOMEM / _BUSY when the
     * pool is exhausted. */
    kiln_status (*alloc)(kiln_transport *t, size_t bytes, kiln_tensor_ref *ref, void **ptr,
                         kiln_err *err);
    /* Returns a range this transport allocated to its pool.
     * KILN_ERR_INVALID for a ref it does not own, a stale generation or a
     * double free (nothing changes). */
    kiln_status (*free)(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err);
    /* Consumer: the address of the ref's bytes, valid until close. */
    kiln_status (*open)(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                        kiln_err *err);
    void (*close)(kiln_transport *t, const kiln_tensor_ref *ref);
    /* Consumer, on an open ref: KILN_OK while its range still holds the
     * allocation it named, KILN_ERR_NOT_FOUND once it was freed (and
     * perhaps handed out again). */
    kiln_status (*verify)(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err);
    /* Consumer: owner incarnation `epoch` is gone; its idle mappings are
     * dropped now, those in use when their last reference closes.  NULL
     * where nothing is mapped (inline). */
    void (*forget)(kiln_transport *t, uint64_t epoch);
    void (*stats)(kiln_transport *t, kiln_transport_stats *st);
    void (*destroy)(kiln_transport *t);
} kiln_transport_ops;

struct kiln_transport {
    const kiln_transport_ops *ops;
    kiln_ref_kind kind;
    void *impl;
};

/* A shm transport for incarnation `epoch` (!= 0, kiln_msg.epoch) of
 * replica `owner` of `stage` ("encode", ...), creating slabs of at least
 * slab_bytes (0 = 64 MiB; bigger tensors get a slab of their own size) up
 * to max_bytes in total (0 = 4 GiB).  NULL with err set.  The caller owns
 * it. */
kiln_transport *kiln_transport_shm_create(const char *owner, uint64_t epoch, const char *stage,
                                          size_t slab_bytes, size_t max_bytes, kiln_err *err);

/* An inline transport: alloc mallocs the bytes the message will carry (the
 * producer frees them with kiln_transport_free once the message is sent);
 * open returns ref->data, which lives as long as the decoded message. */
kiln_transport *kiln_transport_inline_create(kiln_err *err);

/* A cuda_ipc transport for incarnation `epoch` of replica `owner` of
 * `stage` on GPU `device`:
 * device slabs of at least slab_bytes (0 = 64 MiB; rounded up to MiB; a
 * bigger tensor gets a slab of its own) up to max_bytes (0 = 16 GiB),
 * allocated with cudaMalloc and exported once with cudaIpcGetMemHandle
 * (the handle travels in every reference; the slab label
 * "/kiln-cuda-<stage>-<epoch>-<pid>-<n>-<MiB>" carries its size so
 * consumers can bound-check offsets).  alloc's *ptr is device memory.
 * Consumers map each slab once with cudaIpcOpenMemHandle on their own
 * `device` (peer access enabled lazily for a slab of another GPU) and keep
 * at most 16 idle mappings; a slab of the calling process itself is used
 * directly (CUDA cannot IPC-open its own memory).
 * Ordering is the callers' duty, as the transport sees no streams: the
 * producer's writes into *ptr must be complete (kiln_be_sync, or a stream
 * or event sync) before the reference is sent, and a consumer's reads
 * complete before it verifies and closes the reference and sends
 * `release`.  Range headers are written and read with synchronous
 * cudaMemcpy (64 bytes, a few microseconds each).
 * NULL with err set: KILN_ERR_UNSUPPORTED in a build without CUDA,
 * KILN_ERR_UNAVAILABLE without that device, KILN_ERR_INVALID for bad
 * names.  The caller owns it; destroying it frees the producer's slabs
 * (consumers must have closed theirs: their mappings end when their own
 * transport is destroyed or evicts them). */
kiln_transport *kiln_transport_cuda_ipc_create(const char *owner, uint64_t epoch,
                                               const char *stage, int device, size_t slab_bytes,
                                               size_t max_bytes, kiln_err *err);

/* 1 when a consumer on GPU consumer_device can map cuda_ipc slabs of
 * producer_device (the same device, or peer access between the two);
 * 0 otherwise and in a build without CUDA. */
int kiln_transport_cuda_ipc_reachable(int consumer_device, int producer_device);
/* 1 when every GPU this process sees can map every other's slabs (always
 * with one GPU), so a cuda_ipc reference opens in any CUDA process of the
 * host that sees the same GPUs; 0 otherwise and without CUDA. */
int kiln_transport_cuda_ipc_all_reachable(void);

/* Destroys a transport: unmaps consumer mappings and unlinks and unmaps
 * the producer's slabs (consumers' existing mappings stay valid).
 * Accepts NULL. */
void kiln_transport_destroy(kiln_transport *t);

/* Allocates a dense tensor of dtype/shape: ops->alloc plus the ref's dtype,
 * ndim and shape.  KILN_ERR_INVALID for a bad shape. */
kiln_status kiln_transport_alloc(kiln_transport *t, kiln_dtype dt, int ndim, const int64_t *shape,
                                 kiln_tensor_ref *ref, void **ptr, kiln_err *err);

/* Owner side: returns a range to the pool (a `free` message, or an inline
 * buffer once sent). */
kiln_status kiln_transport_free(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err);

/* Consumer side.  open validates the ref (kiln_tensor_ref_check, kind, the
 * range within its slab) before touching memory.  Every successful open
 * is paired with one close. */
kiln_status kiln_transport_open(kiln_transport *t, const kiln_tensor_ref *ref, const void **ptr,
                                kiln_err *err);
/* On an open reference, after the last read (see ops->verify).  A
 * consumer that gets KILN_ERR_NOT_FOUND here must discard what it
 * computed from the reference. */
kiln_status kiln_transport_verify(kiln_transport *t, const kiln_tensor_ref *ref, kiln_err *err);
void kiln_transport_close(kiln_transport *t, const kiln_tensor_ref *ref);
/* See ops->forget (gone incarnations of other replicas). */
void kiln_transport_forget(kiln_transport *t, uint64_t epoch);

void kiln_transport_stats_get(kiln_transport *t, kiln_transport_stats *st);

/* Removes the /dev/shm/kiln-<stage>-<epoch>-<pid>-<n> slabs no process
 * owns any more (a crashed replica's, in any PID namespace sharing
 * /dev/shm): those whose owner lock (flock) it can take.  It never removes
 * a slab whose owner lives, whatever its pid says, nor one it cannot open,
 * nor a name of another form (an older kiln's, whose owner it cannot
 * judge).  The supervisor calls it
 * when a child dies, and every replica at start.  Returns the number
 * removed, or -1 with err set when /dev/shm cannot be listed. */
int kiln_transport_shm_clean_stale(kiln_err *err);

#endif
