/* kiln transport domains: where a replica's tensor references can be
 * opened (docs/ARCHITECTURE.md, "Transport domains").
 *
 *   kiln_domain d;
 *   kiln_domain_probe(&d, &err);               // this process's kernel, namespaces, /dev/shm
 *   ... announce d in `hello`; the gateway then asks
 *   if (kiln_domain_can_open(KILN_REF_SHM, &producer, &consumer, consumer_transports)) ...
 *
 * A shm reference names a POSIX shared-memory object, which glibc keeps in
 * /dev/shm: another process opens it only on the same kernel and with the
 * same /dev/shm mounted (containers of one pod share an emptyDir there;
 * `ipc: host` containers share the host's).  A cuda_ipc reference holds a
 * CUDA IPC handle: it opens only on the same kernel, in the same IPC and
 * PID namespaces, in a process that sees the producer's GPU.  Everything
 * else moves by value (docs/ARCHITECTURE.md).
 *
 * The kernel is told apart by its boot id (/proc/sys/kernel/random/boot_id:
 * one per boot of one machine, shared by its containers), namespaces by
 * the inode numbers of /proc/self/ns/{ipc,mnt,pid} (unique within one
 * kernel), /dev/shm by its device and inode numbers.  KILN_DOMAIN_HOST, when
 * set, replaces the boot id: a test (or an operator who wants by-value
 * hand-offs) makes a replica look like another machine's.
 *
 * Pure data and functions; thread-safe.
 */
#ifndef KILN_DOMAIN_H
#define KILN_DOMAIN_H

#include <stdint.h>

#include "error.h"

#define KILN_DOMAIN_ID_MAX 64   /* host and shm identities, with the NUL */
#define KILN_DOMAIN_MAX_GPUS 16
#define KILN_DOMAIN_GPU_MAX 48  /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", with the NUL */

typedef struct kiln_domain {
    char host[KILN_DOMAIN_ID_MAX]; /* the kernel instance (boot id), never empty */
    char shm[KILN_DOMAIN_ID_MAX];  /* "<dev>:<ino>" of /dev/shm; "" when there is none */
    uint64_t ipc_ns, mnt_ns, pid_ns;
    int n_gpus;                    /* GPUs this process sees (CUDA replicas) */
    char gpus[KILN_DOMAIN_MAX_GPUS][KILN_DOMAIN_GPU_MAX];
    int gpu;                       /* index in gpus of the one it computes on; -1: none */
} kiln_domain;

/* Fills d for this process (no GPUs: the caller adds them).  KILN_ERR_IO
 * when /proc cannot be read; KILN_ERR_INVALID for a KILN_DOMAIN_HOST that
 * is empty, too long or not of [A-Za-z0-9._:-]. */
kiln_status kiln_domain_probe(kiln_domain *d, kiln_err *err);

/* Fills d's gpus with the UUIDs of the GPUs this process sees and d->gpu
 * with `device`'s place among them (common/domain_cuda.c).
 * KILN_ERR_DEVICE from the CUDA runtime, _UNSUPPORTED without CUDA. */
kiln_status kiln_domain_add_gpus(kiln_domain *d, int device, kiln_err *err);

/* 1 when a process in domain `consumer`, with hello transports bits
 * `consumer_transports` (KILN_TRANSPORT_BIT), can open a reference of
 * `kind` (a kiln_ref_kind, common/proto.h) made in domain `producer`
 * (inline: always). */
int kiln_domain_can_open(int kind, const kiln_domain *producer, const kiln_domain *consumer,
                         unsigned consumer_transports);

/* 1 when `s` may travel as a host, shm or GPU identity: 1..cap-1
 * characters of [A-Za-z0-9._:-]. */
int kiln_domain_id_valid(const char *s, int cap);

/* Free and total bytes of the file system at `dir` (statvfs); -1 with err
 * set when it cannot be read. */
int kiln_domain_fs_space(const char *dir, uint64_t *free_bytes, uint64_t *total_bytes,
                         kiln_err *err);

#endif
