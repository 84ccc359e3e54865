/* kiln-soak's results: a text summary, summary.json, samples.csv,
 * requests.csv and memory.png (RssAnon, and GPU memory where sampled, per
 * process over time, the faults and the warm-up's end marked).
 *
 *   kiln_soak_verdict vd;
 *   kiln_soak_judge(&run, &opts, &vd);           // after kiln_soak_run_classify
 *   kiln_soak_report_text(stdout, &run, &opts, &vd);
 *   kiln_soak_report_files(opts.out_dir, &run, &opts, &vd, &err);
 *   free(vd.growth);
 *
 * summary.json holds the options that shaped the traffic, the counts
 * (requests, statuses by code, images, verified, wrong), latency
 * percentiles of the 200s (nearest rank, bench_stats.h), the faults and
 * their healing, each process's memory growth, and "pass".  Thread-safe
 * on distinct arguments.
 */
#ifndef KILN_SOAK_REPORT_H
#define KILN_SOAK_REPORT_H

#include <stdio.h>

#include "soak_run.h"

typedef struct kiln_soak_verdict {
    kiln_soak_growth *growth; /* per process (malloc'd) */
    size_t n_growth;
    int mem_over;             /* processes whose memory grew past a bound */
    int faults_unhealed;      /* faults that found no replica or did not heal */
    int first_failed;
    double p50, p95, p99, max; /* latency of the 200s, seconds */
    int pass;
} kiln_soak_verdict;

void kiln_soak_judge(const kiln_soak_run *run, const kiln_soak_opts *o, kiln_soak_verdict *vd);
void kiln_soak_report_text(FILE *f, const kiln_soak_run *run, const kiln_soak_opts *o,
                           const kiln_soak_verdict *vd);
/* Writes the four files into dir (made when missing).  _IO, _NOMEM. */
kiln_status kiln_soak_report_files(const char *dir, const kiln_soak_run *run,
                                   const kiln_soak_opts *o, const kiln_soak_verdict *vd,
                                   kiln_err *err);

#endif
