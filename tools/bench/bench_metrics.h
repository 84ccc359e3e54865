/* kiln-bench: reading the gateway's /metrics (Prometheus text format 0.0.4)
 * and turning two scrapes into "where the time went".
 *
 *   kiln_prom *before = kiln_prom_parse(text0, len0, &err);
 *   ... run requests ...
 *   kiln_prom *after = kiln_prom_parse(text1, len1, &err);
 *   kiln_bench_stage *st; size_t n;
 *   kiln_bench_stage_deltas(before, after, &st, &n, &err);
 *   // st[i]: family "kiln_stage_duration_seconds", labels "stage=\"denoise\"",
 *   //        count 20 (observations in between), sum_s 3.1
 *   free(st); kiln_prom_free(before); kiln_prom_free(after);
 *
 * The stages are read generically: every histogram or summary whose family
 * name ends in "_seconds" (a `<family>_sum` and `<family>_count` pair with
 * the same labels) that grew between the scrapes.  So kiln-bench reports
 * whatever timings the gateway exports (the kiln_stage_duration_seconds stages
 * today: queue, encode, denoise, decode, total) without a list of names to
 * keep in step.  Thread-safe on distinct objects.
 */
#ifndef KILN_BENCH_METRICS_H
#define KILN_BENCH_METRICS_H

#include <stddef.h>

#include "common/error.h"

typedef struct kiln_prom kiln_prom;

/* Parses an exposition text.  Comment and blank lines are skipped; a sample
 * line is `name[{labels}] value [timestamp]`.  Labels are kept as the text
 * between the braces.  NULL with err set: KILN_ERR_FORMAT for a malformed
 * line (the message names its number), KILN_ERR_NOMEM. */
kiln_prom *kiln_prom_parse(const char *text, size_t len, kiln_err *err);
/* Accepts NULL. */
void kiln_prom_free(kiln_prom *p);

size_t kiln_prom_size(const kiln_prom *p);
/* The value of the series `name{labels}` (labels "" for none); 1 when found. */
int kiln_prom_get(const kiln_prom *p, const char *name, const char *labels, double *value);

typedef struct kiln_bench_stage {
    char family[96];  /* e.g. kiln_stage_duration_seconds */
    char labels[160]; /* e.g. stage="encode" (may be empty) */
    double count;     /* observations between the scrapes */
    double sum_s;     /* seconds they add up to */
} kiln_bench_stage;

/* The "_seconds" series that grew from `before` to `after` (a series absent
 * before counts from zero), in the order of `after`.  *out is malloc'd
 * (NULL when *n == 0); the caller frees it.  KILN_ERR_NOMEM. */
kiln_status kiln_bench_stage_deltas(const kiln_prom *before, const kiln_prom *after,
                                    kiln_bench_stage **out, size_t *n, kiln_err *err);

#endif
