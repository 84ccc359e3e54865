/* kiln-soak: the memory of the service's processes over time, and whether
 * it grew after the warm-up.
 *
 *   kiln_soak_mem *m = kiln_soak_mem_start(serve_pid, 1.0, &err);  // a sampling thread
 *   ... traffic ...
 *   kiln_soak_mem_stop(m);
 *   size_t n; const kiln_soak_sample *s = kiln_soak_mem_samples(m, &n);
 *   kiln_soak_growth *g; size_t ng = kiln_soak_mem_growth(s, n, warmup_s, end_s, 256, 1024, &g);
 *   free(g); kiln_soak_mem_free(m);
 *
 * The processes are `kiln serve` (serve_pid) and its children whose
 * command name starts with "kiln" (the gateway and the stage replicas,
 * restarted ones included), listed from /proc at every sample.  Each
 * sample holds VmRSS and RssAnon (/proc/<pid>/status) and, where
 * nvidia-smi is on the PATH, the process's GPU memory
 * (--query-compute-apps=pid,process_name,used_memory; where its pids are
 * not ours, as in a container that sees the host's, kiln's executables
 * become GPU-only samples under nvidia-smi's pid, RSS -1).  Growth is
 * judged on RssAnon:
 * the private heap and stacks, which a leak grows, without the mapped
 * checkpoint and shared slabs (whose resident pages come and go with the
 * page cache).  Sample times are seconds since kiln_soak_mem_start.
 * The sampler's data is read only after kiln_soak_mem_stop; the other
 * functions are thread-safe.
 */
#ifndef KILN_SOAK_MEM_H
#define KILN_SOAK_MEM_H

#include <stddef.h>
#include <sys/types.h>

#include "common/error.h"

typedef struct kiln_soak_sample {
    double t;
    pid_t pid;
    char name[16];  /* the command name (comm) */
    long rss_kb, anon_kb; /* -1: not known (a GPU-only sample) */
    long gpu_mib;         /* -1: not known */
} kiln_soak_sample;

typedef struct kiln_soak_mem kiln_soak_mem;

/* Starts the sampling thread (a first sample at once).  NULL with err:
 * _NOMEM, or thread creation. */
kiln_soak_mem *kiln_soak_mem_start(pid_t serve, double period_s, kiln_err *err);
/* Stops and joins the thread; accepts NULL. */
void kiln_soak_mem_stop(kiln_soak_mem *m);
void kiln_soak_mem_free(kiln_soak_mem *m);
/* The samples, in time order (after stop). */
const kiln_soak_sample *kiln_soak_mem_samples(const kiln_soak_mem *m, size_t *n);
/* 1 when nvidia-smi answered at least once. */
int kiln_soak_mem_has_gpu(const kiln_soak_mem *m);

/* Children of `parent` whose command name is `comm`: up to max pids, in
 * ascending order; the count. */
int kiln_soak_children(pid_t parent, const char *comm, pid_t *out, int max);

typedef struct kiln_soak_growth {
    pid_t pid;
    char name[16];
    double first_t, last_t;      /* first and last sample */
    int judged;                  /* lived long enough after its warm-up to judge */
    double base_mb, end_mb, peak_mb; /* RssAnon: median after warm-up, median at the end, max;
                                        -1 / 0 without RSS samples */
    double gpu_base_mb, gpu_end_mb, gpu_peak_mb; /* -1 without GPU samples */
    double reach_mb, gpu_reach_mb; /* the highest peaks of its stage's processes born
                                      before it (same name); -1 when none */
    int over;                    /* judged, and grew past a bound */
    int refilled;                /* grew past a bound, but only back up to its stage's reach */
} kiln_soak_growth;

/* Per process (pid): its warm-up ends at max(warmup_s, first sample +
 * warmup_s) (a restarted replica warms up again); when it lived to end_s
 * and at least 10 s past that, the base is the median of its samples in
 * the first fifth of that span and the end the median of the last fifth;
 * growth (end - base) over max_rss_mb (RssAnon) or max_gpu_mb (GPU) sets
 * `over`, unless a process of its stage born before it had reached a
 * level at or above its end (a replacement filling its arenas again:
 * `refilled`).  *out is malloc'd (the caller frees); the count, or 0 when
 * out of memory. */
size_t kiln_soak_mem_growth(const kiln_soak_sample *s, size_t n, double warmup_s, double end_s,
                            double max_rss_mb, double max_gpu_mb, kiln_soak_growth **out);

#endif
