/* Progress counting, and KILN_FAULT_INJECT: faults the product injects
 * into its own backend thread, so that the tests exercise the real paths
 * by which a stuck or broken device is noticed and healed (a test aid,
 * docs/OPERATIONS.md):
 *
 *   KILN_FAULT_INJECT=<stage>:<fault>=<n>[,once=<path>]
 *
 * `stage` is encode, denoise or decode (replicas of other stages ignore
 * it); after its n-th step (kiln_worker_step) the backend thread stops
 * for good, as a hung kernel would, while the bus thread goes on
 * (stall_after_steps), or the backend is lost, as after a sticky CUDA
 * error (device_lost_after_steps: kiln_be_lose, so that every later op
 * fails and the stage answers its jobs with the device error), or, on
 * the CUDA backend only, a real device fault is provoked
 * (illegal_address_after_steps: a backend op over a tensor at a device
 * address nothing maps, then a sync: the driver's sticky
 * cudaErrorIllegalAddress, found and handled by the backend's own error
 * plumbing exactly as a bug's would be).
 * decode:stale_image_refs_at=<n> counts dones instead of steps: the n-th
 * done that hands image files by reference frees their ranges just before
 * it goes out, so the gateway finds them gone (as when a decoder dies and
 * its slabs are removed between its done and the gateway's read) and must
 * neither answer with them nor fail for good.
 * `once=path`: only the process that creates `path` (O_EXCL) injects, so
 * one replica of several, and not its restarts, is faulty. */
#include <errno.h>
#include <stdint.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "worker_impl.h"

int worker_fault_setup(kiln_worker *w)
{
    const char *spec = getenv("KILN_FAULT_INJECT");
    if (!spec || !*spec)
        return 0;
    char stage[16] = "", kind[32] = "", once[256] = "";
    unsigned long long n = 0;
    int got = sscanf(spec, "%15[a-z]:%31[a-z_]=%llu,once=%255s", stage, kind, &n, once);
    kiln_stage st;
    int stall = !strcmp(kind, "stall_after_steps"), lost = !strcmp(kind, "device_lost_after_steps");
    int illegal = !strcmp(kind, "illegal_address_after_steps");
    int stale = !strcmp(kind, "stale_image_refs_at");
    if (got < 3 || kiln_stage_parse(stage, &st) || (!stall && !lost && !illegal && !stale) || !n ||
        (stale && st != KILN_STAGE_DECODE)) {
        fprintf(stderr, "%s: KILN_FAULT_INJECT='%s': expected <stage>:stall_after_steps=<n>, "
                "<stage>:device_lost_after_steps=<n>, <stage>:illegal_address_after_steps=<n> "
                "or decode:stale_image_refs_at=<n>, then optionally ,once=<path>\n",
                w->ops->binary, spec);
        return -1;
    }
    if (st != w->ops->stage)
        return 0;
    /* The CPU backend has no device whose memory a bad address can fault:
     * a CPU process would crash with SIGSEGV instead, which is not the
     * path this fault exists to prove. */
    if (illegal && (!w->opts.device || strcmp(w->opts.device, "cuda"))) {
        fprintf(stderr, "%s: KILN_FAULT_INJECT='%s': illegal_address_after_steps needs the CUDA "
                "backend (--device cuda); this replica runs on %s\n",
                w->ops->binary, spec, w->opts.device ? w->opts.device : "cpu");
        return -1;
    }
    if (got == 4) {
        int fd = open(once, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0) {
            KILN_LOG_INFO("%s: KILN_FAULT_INJECT: %s is taken (%s): no fault here",
                          w->ops->binary, once, strerror(errno));
            return 0;
        }
        close(fd);
    }
    if (stall)
        w->fault.stall_at = n;
    else if (lost)
        w->fault.lost_at = n;
    else if (illegal)
        w->fault.illegal_at = n;
    else
        w->fault.stale_images_at = n;
    if (stale)
        KILN_LOG_WARN("%s: KILN_FAULT_INJECT: done %llu with image references frees them before "
                      "it goes out (a test aid)", w->ops->binary, n);
    else
        KILN_LOG_WARN("%s: KILN_FAULT_INJECT: %s after step %llu (a test aid)", w->ops->binary,
                      stall  ? "the backend thread stalls"
                      : lost ? "the device is lost"
                             : "an op reads and writes an illegal device address",
                      n);
    return 0;
}

void worker_fault_images(kiln_worker *w, kiln_worker_job *j)
{
    if (!w->fault.stale_images_at)
        return;
    int refs = 0;
    const kiln_ref_map *out = &j->done->done.out;
    for (int i = 0; i < out->n; i++)
        refs += kiln_image_ref_row(out->items[i].name) >= 0;
    if (!refs || atomic_fetch_add(&w->fault.image_dones, 1) + 1 != w->fault.stale_images_at)
        return;
    for (int i = 0; i < j->n_out; i++) {
        kiln_err err = {0};
        if (j->out[i].tx == w->shm && kiln_transport_free(w->shm, &j->out[i].ref, &err))
            KILN_LOG_WARN("%s: KILN_FAULT_INJECT: %s", w->ops->binary, err.msg);
    }
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: job %llu: its %d image reference(s) freed before its "
                  "done goes out", w->ops->binary, (unsigned long long)j->msg->job.job, refs);
}

/* A real device fault: silu in place over 1 Mi activations at device
 * address 0x1000, which nothing maps (the first pages of the GPU's virtual
 * address space are never handed out), then a sync.  The kernel's first
 * load faults, the stream reports cudaErrorIllegalAddress and the backend
 * marks itself lost through its ordinary error path (cuda_ok), so what
 * follows (bye, exit 75, the jobs run again elsewhere) is what a real
 * out-of-bounds access in a kernel would cause. */
static void illegal_address(kiln_worker *w)
{
    kiln_tensor t = {0};
    kiln_tensor_set_shape(&t, w->be->act_dtype, 1, (int64_t[]){1 << 20});
    t.data = (void *)(uintptr_t)0x1000;
    t.on_device = 1;
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: silu over device address 0x1000 at step %llu",
                  w->ops->binary, (unsigned long long)w->steps);
    kiln_be_silu(w->be, &t, &t);
    kiln_be_sync(w->be);
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: after the illegal access the backend is %s: %s",
                  w->ops->binary, kiln_be_lost(w->be) ? "lost" : "NOT lost",
                  w->be->error.code ? w->be->error.msg : "no error");
}

void worker_progress(kiln_worker *w) { atomic_fetch_add(&w->progress, 1); }

void kiln_worker_step(kiln_worker *w)
{
    w->steps++;
    worker_progress(w);
    if (w->steps == w->fault.lost_at)
        kiln_be_lose(w->be, "KILN_FAULT_INJECT at step %llu", (unsigned long long)w->steps);
    if (w->steps == w->fault.illegal_at)
        illegal_address(w);
    if (w->steps != w->fault.stall_at)
        return;
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: backend thread stalled at step %llu", w->ops->binary,
                  (unsigned long long)w->steps);
    for (;;) {
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
}
