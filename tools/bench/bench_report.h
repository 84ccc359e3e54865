/* kiln-bench output: a JSON document (for docs/PERFORMANCE.md and scripts)
 * and a plain-text table of the same numbers.
 *
 *   cJSON *doc = kiln_bench_report_json(&opts, &lat, tp, n_tp);   // lat may be NULL
 *   kiln_bench_report_table(stdout, &opts, &lat, tp, n_tp);
 *
 * Latency: median, p95, min, max, mean of the successful requests (stats
 * as bench_stats.h defines them).  Throughput, per concurrency level: the
 * median and range of the repeats' images/s, and the latency of the
 * requests within them.  Stages: every "_seconds" series of /metrics that
 * grew during the phase, as milliseconds per observation and per image;
 * when the gateway reports kiln_request_duration_seconds{status="200"}, the client's
 * mean latency minus that mean is shown as "http + transfer" (request and
 * response bytes, base64, JSON, the event loop).  Thread-safe.
 */
#ifndef KILN_BENCH_REPORT_H
#define KILN_BENCH_REPORT_H

#include <stdio.h>

#include <cjson/cJSON.h>

#include "bench_args.h"
#include "bench_run.h"

/* NULL when out of memory. */
cJSON *kiln_bench_report_json(const kiln_bench_opts *o, const kiln_bench_phase *lat,
                              const kiln_bench_phase *tp, int n_tp);
void kiln_bench_report_table(FILE *f, const kiln_bench_opts *o, const kiln_bench_phase *lat,
                             const kiln_bench_phase *tp, int n_tp);

#endif
