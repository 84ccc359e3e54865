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
 * fails and the stage answers its jobs with the device error).
 * `once=path`: only the process that creates `path` (O_EXCL) injects, so
 * one replica of several, and not its restarts, is faulty. */
#include <errno.h>
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
    if (got < 3 || kiln_stage_parse(stage, &st) || (!stall && !lost) || !n) {
        fprintf(stderr, "%s: KILN_FAULT_INJECT='%s': expected <stage>:stall_after_steps=<n> or "
                "<stage>:device_lost_after_steps=<n>, then optionally ,once=<path>\n",
                w->ops->binary, spec);
        return -1;
    }
    if (st != w->ops->stage)
        return 0;
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
    else
        w->fault.lost_at = n;
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: %s after step %llu (a test aid)", w->ops->binary,
                  stall ? "the backend thread stalls" : "the device is lost", n);
    return 0;
}

void worker_progress(kiln_worker *w) { atomic_fetch_add(&w->progress, 1); }

void kiln_worker_step(kiln_worker *w)
{
    w->steps++;
    worker_progress(w);
    if (w->steps == w->fault.lost_at)
        kiln_be_lose(w->be, "KILN_FAULT_INJECT at step %llu", (unsigned long long)w->steps);
    if (w->steps != w->fault.stall_at)
        return;
    KILN_LOG_WARN("%s: KILN_FAULT_INJECT: backend thread stalled at step %llu", w->ops->binary,
                  (unsigned long long)w->steps);
    for (;;) {
        struct timespec ts = {1, 0};
        nanosleep(&ts, NULL);
    }
}
