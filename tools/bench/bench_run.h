/* kiln-bench: the prompt list, request bodies, response checks and the two
 * load phases (latency: one request at a time; throughput: a fixed number
 * of requests from several connections at once).
 *
 *   kiln_bench_prompts p;
 *   kiln_bench_prompts_load("tools/bench/prompts.txt", &p, &err);
 *   uint64_t next = 0;                      // request counter across phases
 *   kiln_bench_phase lat;
 *   kiln_bench_run_latency(&opts, &p, &next, &lat, &err);
 *   ... kiln_bench_phase_free(&lat); kiln_bench_prompts_free(&p);
 *
 * Request k of a run uses prompt k mod P and seed k mod P (the prompt's
 * index), so every run of the benchmark sends the same requests in the same
 * order.  A failed request (transport error, non-200, malformed body, wrong
 * seed, wrong image header) is counted in the phase and its first error
 * kept; it never stops the run.  The run functions fail only for their own
 * resources (KILN_ERR_NOMEM, thread creation).  Not thread-safe themselves:
 * call them from one thread.
 */
#ifndef KILN_BENCH_RUN_H
#define KILN_BENCH_RUN_H

#include <stddef.h>
#include <stdint.h>

#include "bench_args.h"
#include "bench_metrics.h"
#include "common/buf.h"
#include "common/error.h"

typedef struct kiln_bench_prompts {
    char **v;
    size_t n;
    char *text; /* the file; v points into it */
} kiln_bench_prompts;

/* One prompt per line; blank lines are skipped; lines stay as written
 * (UTF-8).  KILN_ERR_IO, _NOMEM, or _INVALID for a file without prompts. */
kiln_status kiln_bench_prompts_load(const char *path, kiln_bench_prompts *p, kiln_err *err);
void kiln_bench_prompts_free(kiln_bench_prompts *p);

/* The JSON body of one generation request (n = 1, b64_json).  _NOMEM. */
kiln_status kiln_bench_request_body(const kiln_bench_opts *o, const char *prompt, uint64_t seed,
                                    kiln_buf *out, kiln_err *err);

/* KILN_OK when the response is a 200 OpenAI images body holding exactly one
 * image of the requested format (and, for PNG, size) reporting `seed`;
 * otherwise KILN_ERR_INVALID with the reason (an error body's message when
 * the status is not 200). */
kiln_status kiln_bench_check_response(const kiln_bench_opts *o, int status, const kiln_buf *body,
                                      uint64_t seed, kiln_err *err);

typedef struct kiln_bench_phase {
    int concurrency;         /* 1 for the latency phase */
    int requests;            /* sent (measured ones, warm-ups excluded) */
    int errors;              /* of those, failed */
    char first_error[KILN_ERR_MSG_MAX];
    double *lat;             /* seconds of each successful request */
    size_t n_lat;
    double ips[64];          /* throughput: images/s of each repeat */
    int n_rep;
    double wall_s;           /* the phase's measured wall time */
    int metrics_ok;          /* /metrics was read before and after */
    char metrics_note[KILN_ERR_MSG_MAX]; /* why not, when not */
    kiln_bench_stage *stages;
    size_t n_stages;
} kiln_bench_phase;

/* Waits until GET /readyz answers 200 (polling twice a second), for at most
 * o->wait_ready_s.  KILN_ERR_UNAVAILABLE when it never did. */
kiln_status kiln_bench_wait_ready(const kiln_bench_opts *o, kiln_err *err);

kiln_status kiln_bench_run_latency(const kiln_bench_opts *o, const kiln_bench_prompts *p,
                                   uint64_t *next, kiln_bench_phase *out, kiln_err *err);
kiln_status kiln_bench_run_throughput(const kiln_bench_opts *o, const kiln_bench_prompts *p,
                                      int concurrency, uint64_t *next, kiln_bench_phase *out,
                                      kiln_err *err);
/* Accepts a zeroed phase. */
void kiln_bench_phase_free(kiln_bench_phase *ph);

#endif
