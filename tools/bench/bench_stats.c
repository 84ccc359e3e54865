#include "bench_stats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double kiln_bench_percentile(double *v, size_t n, double pct)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cmp_double);
    size_t rank = (size_t)ceil(pct / 100.0 * (double)n);
    rank = rank < 1 ? 1 : rank > n ? n : rank;
    return v[rank - 1];
}

double kiln_bench_median(double *v, size_t n)
{
    if (!n)
        return 0;
    qsort(v, n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void kiln_bench_summarize(double *v, size_t n, kiln_bench_summary *s)
{
    memset(s, 0, sizeof *s);
    if (!n)
        return;
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    s->n = n;
    s->mean = sum / (double)n;
    s->median = kiln_bench_median(v, n);
    s->p95 = kiln_bench_percentile(v, n, 95.0);
    s->min = v[0];
    s->max = v[n - 1];
}
