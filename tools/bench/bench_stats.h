/* kiln-bench statistics over a sample of measurements (seconds, images/s).
 *
 *   double lat[20] = {...};
 *   kiln_bench_summary s;
 *   kiln_bench_summarize(lat, 20, &s);   // s.median, s.p95, s.min, s.max, s.mean
 *
 * Definitions (stated because benchmark tables differ on them): the median
 * of an even-sized sample is the mean of its two middle values; p95 is the
 * nearest-rank percentile, the ceil(0.95 n)-th smallest value, so it is
 * always a measured value (with n = 20, the second largest).  The functions
 * sort v in place (callers keep their own copy when order matters) and
 * allocate nothing; thread-safe on distinct arrays.
 */
#ifndef KILN_BENCH_STATS_H
#define KILN_BENCH_STATS_H

#include <stddef.h>

typedef struct kiln_bench_summary {
    size_t n;
    double min, max, mean, median, p95;
} kiln_bench_summary;

/* Nearest-rank percentile (0 < pct <= 100) of v[0..n); 0 for n == 0. */
double kiln_bench_percentile(double *v, size_t n, double pct);

/* Median of v[0..n); 0 for n == 0. */
double kiln_bench_median(double *v, size_t n);

/* All of the above; an empty sample gives all zeros. */
void kiln_bench_summarize(double *v, size_t n, kiln_bench_summary *s);

#endif
