/* The bookkeeping the two slab transports of common/transport.h (shm and
 * cuda_ipc) share: the producer's slabs with their first-fit ranges
 * (common/slab_ranges) under a pool limit, the consumer's cache of mapped
 * slabs with LRU closing of idle ones, the checks on references, stats and
 * teardown.  A transport describes only what is its own in a kiln_slab_kind:
 * how a slab is made and freed, how a peer's slab is mapped and unmapped.
 *
 *   static const kiln_slab_kind shm_kind = {
 *       .ref_kind = KILN_REF_SHM, .slab_round = KILN_PROTO_ALIGN,
 *       .default_max = (size_t)4 << 30, .max_idle_maps = 64,
 *       .make = shm_make, .unmake = shm_unmake, .map = shm_map, .unmap = shm_unmap,
 *   };
 *   kiln_transport *t = kiln_slab_table_create(&shm_kind, "encode-box-42", epoch, "encode", 0,
 *                                              slab_bytes, max_bytes, &err);
 *   ... kiln_transport_alloc / free / open / close / stats_get on t ...
 *   kiln_transport_destroy(t);
 *
 * Producer: a range is 64-byte aligned and comes first-fit from the slabs
 * in creation order; when none fits a new slab of slab_bytes is made, or
 * one of the tensor's own size rounded up to a MiB when it is bigger, as
 * long as the slabs stay within max_bytes.  Every allocation gets a new
 * generation (1, 2, ...) and a 64-byte header in the slab just before its
 * bytes naming it (epoch, generation, length); a free must name the
 * owner, epoch, slab, offset, length and generation of a live range, and
 * clears the header.  Before a slab hands out a range, `alive` says
 * whether consumers can still open it; a slab that lost its name is
 * retired and a new one made.  Consumer: each slab is mapped once
 * (keyed by name and owner epoch) and the mapping kept while references
 * to it are open; beyond max_idle_maps idle mappings the least recently
 * used one is unmapped, and kiln_transport_forget drops the mappings of an
 * owner incarnation that is gone.  Opening a reference and
 * kiln_transport_verify read the header and refuse a reference whose range
 * is not that allocation any more (KILN_ERR_NOT_FOUND).
 *
 * Thread-safety: the kiln_transport calls may come from any thread; a
 * mutex per table guards producer and consumer state alike.  make, map and
 * unmap run under it (unmake and the last unmaps in destroy), so a kind
 * needs no lock of its own for its slabs and mappings; `local` and
 * `ref_size` run outside it, concurrently (`local` may take a lock of its
 * own).
 */
#ifndef KILN_SLAB_TABLE_H
#define KILN_SLAB_TABLE_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"
#include "proto.h"
#include "transport.h"

/* A producer slab, as its kind's hooks see it.  The table allocates it
 * and keeps its address until unmake, so a kind may keep pointers to it. */
typedef struct kiln_slab {
    /* Set by make, unique per process instance: the kinds put the owner's
     * epoch in it, so no other process (another PID namespace, a
     * restart) ever makes a slab of the same name. */
    char name[KILN_PROTO_SLAB_MAX];
    uint8_t *base;                  /* set by make: where the producer writes */
    size_t size;                    /* set by the table before make */
    int fd;                         /* the kind's own (shm: the owner lock), -1 if none */
    /* Set by make where a consumer needs more than the name to map the
     * slab (cuda_ipc's IPC handle); copied into every reference. */
    uint8_t handle[KILN_PROTO_IPC_HANDLE];
} kiln_slab;

/* A consumer's mapping of a peer's slab. */
typedef struct kiln_slab_map {
    char name[KILN_PROTO_SLAB_MAX];        /* the reference's slab */
    uint64_t epoch;                        /* the reference's owner incarnation */
    uint8_t handle[KILN_PROTO_IPC_HANDLE]; /* the reference's handle */
    const uint8_t *base;                   /* set by map */
    size_t size;                           /* set by map: the slab's bytes */
} kiln_slab_map;

/* What makes a slab transport what it is.  `device` in the hooks is the
 * table's (the GPU of cuda_ipc); host-memory kinds ignore it. */
typedef struct kiln_slab_kind {
    kiln_ref_kind ref_kind; /* of its references; its name starts error messages */
    size_t slab_round;      /* the asked slab_bytes round up to a multiple of this */
    size_t default_max;     /* max_bytes when 0 is asked */
    int max_idle_maps;      /* idle mappings kept before the LRU one is unmapped */
    /* 1: a mapping is found by the reference's handle as well as its slab
     * name, because the handle is what gets mapped (cuda_ipc). */
    int handle_keyed;

    /* Makes slab s of s->size bytes for incarnation `epoch`: sets its name
     * (with `stage` and the epoch in it), base, fd and, where needed,
     * handle.  On failure it undoes its own work and sets err
     * (KILN_ERR_NOMEM when memory ran out). */
    kiln_status (*make)(kiln_slab *s, const char *stage, uint64_t epoch, int device,
                        kiln_err *err);
    /* Frees what make made; reports its own failures in the log. */
    void (*unmake)(kiln_slab *s, int device);
    /* Maps slab m->name (with m->handle) for reading: sets m->base and
     * m->size.  Sets err on failure (KILN_ERR_NOT_FOUND: no such slab). */
    kiln_status (*map)(kiln_slab_map *m, int device, kiln_err *err);
    void (*unmap)(const kiln_slab_map *m, int device);
    /* Optional: the base of a slab of this process that must be used as
     * it is rather than mapped (CUDA cannot IPC-open its own memory), or
     * NULL.  Such opens are counted in `open` but not in `mapped`. */
    const uint8_t *(*local)(const kiln_tensor_ref *ref);
    /* Optional: the slab size a reference states itself (cuda_ipc's label),
     * 0 when it states none or a bad one; the range is then checked before
     * anything is looked up or mapped. */
    size_t (*ref_size)(const kiln_tensor_ref *ref);
    /* Optional: 0 once slab s can no longer be opened by consumers (shm:
     * its name was unlinked by someone else, or now names another file).
     * The table then retires it: no new ranges come from it, and it is
     * unmade once its live ranges came back. */
    int (*alive)(const kiln_slab *s);
    /* Optional, for slabs outside host memory (NULL: memcpy): copy n
     * bytes from the host into a slab at `dst` (a producer's range
     * header), and out of a slab (the producer's or a mapping) at `src`
     * to the host.  Set err on failure. */
    kiln_status (*copy_in)(uint8_t *dst, const void *src, size_t n, int device, kiln_err *err);
    kiln_status (*copy_out)(void *dst, const uint8_t *src, size_t n, int device, kiln_err *err);
} kiln_slab_kind;

/* A transport of `kind` for incarnation `epoch` (!= 0) of replica `owner`
 * of `stage` ([a-z0-9], under 16 characters) on `device`, making slabs of
 * slab_bytes (0 = 64 MiB, rounded up to kind->slab_round) up to max_bytes
 * in all (0 = kind->default_max).  `kind` must outlive it.  NULL with err
 * set: KILN_ERR_INVALID for a bad owner, epoch or stage, KILN_ERR_NOMEM.
 * The caller owns the transport and destroys it with
 * kiln_transport_destroy, which unmaps the mappings and unmakes the
 * slabs. */
kiln_transport *kiln_slab_table_create(const kiln_slab_kind *kind, const char *owner,
                                       uint64_t epoch, const char *stage, int device,
                                       size_t slab_bytes, size_t max_bytes, kiln_err *err);

#endif
