#include "bench_report.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_stats.h"

/* Stats of a phase's latencies without reordering its samples.  A phase
 * holds at most a few thousand requests, so the copy is small. */
static void lat_summary(const kiln_bench_phase *ph, kiln_bench_summary *s)
{
    memset(s, 0, sizeof *s);
    double *tmp = ph->n_lat ? malloc(ph->n_lat * sizeof *tmp) : NULL;
    if (!tmp)
        return; /* empty, or no memory: reported as zero samples */
    memcpy(tmp, ph->lat, ph->n_lat * sizeof *tmp);
    kiln_bench_summarize(tmp, ph->n_lat, s);
    free(tmp);
}

static void ips_summary(const kiln_bench_phase *ph, kiln_bench_summary *s)
{
    double tmp[64];
    memcpy(tmp, ph->ips, (size_t)ph->n_rep * sizeof *tmp);
    kiln_bench_summarize(tmp, (size_t)ph->n_rep, s);
}

/* The server's mean time for the requests answered 200
 * (kiln_request_duration_seconds{route,status="200"}, every route); 0 when
 * absent. */
static double server_total_mean(const kiln_bench_phase *ph)
{
    double sum = 0, count = 0;
    for (size_t i = 0; i < ph->n_stages; i++) {
        const kiln_bench_stage *g = &ph->stages[i];
        if (!strcmp(g->family, "kiln_request_duration_seconds") &&
            strstr(g->labels, "status=\"200\""))
            sum += g->sum_s, count += g->count;
    }
    return count ? sum / count : 0;
}

static int add_num(cJSON *o, const char *k, double v)
{
    return cJSON_AddNumberToObject(o, k, v) != NULL;
}

static cJSON *summary_json(const kiln_bench_summary *s, int ms)
{
    double f = ms ? 1e3 : 1;
    cJSON *j = cJSON_CreateObject();
    if (j && add_num(j, "n", (double)s->n) && add_num(j, "median", s->median * f) &&
        add_num(j, "p95", s->p95 * f) && add_num(j, "min", s->min * f) &&
        add_num(j, "max", s->max * f) && add_num(j, "mean", s->mean * f))
        return j;
    cJSON_Delete(j);
    return NULL;
}

static cJSON *phase_json(const kiln_bench_phase *ph, int throughput)
{
    cJSON *j = cJSON_CreateObject();
    kiln_bench_summary lat;
    lat_summary(ph, &lat);
    int ok = j && add_num(j, "concurrency", ph->concurrency) &&
             add_num(j, "requests", ph->requests) && add_num(j, "errors", ph->errors) &&
             (!ph->errors || cJSON_AddStringToObject(j, "first_error", ph->first_error)) &&
             add_num(j, "wall_s", ph->wall_s) &&
             cJSON_AddItemToObject(j, "latency_ms", summary_json(&lat, 1));
    if (ok && throughput) {
        kiln_bench_summary ips;
        ips_summary(ph, &ips);
        ok = cJSON_AddItemToObject(j, "images_per_s_repeats",
                                   cJSON_CreateDoubleArray(ph->ips, ph->n_rep)) &&
             cJSON_AddItemToObject(j, "images_per_s", summary_json(&ips, 0));
    } else if (ok) {
        ok = cJSON_AddItemToObject(j, "latency_s_samples",
                                   cJSON_CreateDoubleArray(ph->lat, (int)ph->n_lat));
    }
    double total = server_total_mean(ph);
    if (ok && total > 0 && lat.n)
        ok = add_num(j, "http_transfer_ms", 1e3 * (lat.mean - total));
    if (ok && !ph->metrics_ok)
        ok = cJSON_AddStringToObject(j, "metrics_unavailable", ph->metrics_note) != NULL;
    cJSON *stages = ok && ph->metrics_ok ? cJSON_AddArrayToObject(j, "stages") : NULL;
    ok = ok && (stages || !ph->metrics_ok);
    for (size_t i = 0; ok && i < ph->n_stages; i++) {
        const kiln_bench_stage *g = &ph->stages[i];
        cJSON *s = cJSON_CreateObject();
        ok = cJSON_AddItemToArray(stages, s) && cJSON_AddStringToObject(s, "metric", g->family) &&
             cJSON_AddStringToObject(s, "labels", g->labels) && add_num(s, "count", g->count) &&
             add_num(s, "sum_s", g->sum_s) && add_num(s, "mean_ms", 1e3 * g->sum_s / g->count);
    }
    if (ok)
        return j;
    cJSON_Delete(j);
    return NULL;
}

cJSON *kiln_bench_report_json(const kiln_bench_opts *o, const kiln_bench_phase *lat,
                              const kiln_bench_phase *tp, int n_tp)
{
    char size[32], when[32];
    snprintf(size, sizeof size, "%dx%d", o->width, o->height);
    time_t t = time(NULL);
    struct tm tm;
    strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&t, &tm));
    cJSON *j = cJSON_CreateObject();
    cJSON *cfg = j ? cJSON_AddObjectToObject(j, "config") : NULL;
    int ok = cfg && cJSON_AddStringToObject(j, "date", when) &&
             (!o->label || cJSON_AddStringToObject(j, "label", o->label)) &&
             cJSON_AddStringToObject(cfg, "url", o->url) &&
             (!o->model || cJSON_AddStringToObject(cfg, "model", o->model)) &&
             cJSON_AddStringToObject(cfg, "size", size) && add_num(cfg, "steps", o->steps) &&
             cJSON_AddStringToObject(cfg, "format", o->format) &&
             add_num(cfg, "warmup", o->warmup) && add_num(cfg, "images", o->images) &&
             add_num(cfg, "repeats", o->repeats);
    if (ok && lat)
        ok = cJSON_AddItemToObject(j, "latency", phase_json(lat, 0));
    cJSON *tps = ok ? cJSON_AddArrayToObject(j, "throughput") : NULL;
    ok = ok && tps;
    for (int i = 0; ok && i < n_tp; i++)
        ok = cJSON_AddItemToArray(tps, phase_json(&tp[i], 1));
    if (ok)
        return j;
    cJSON_Delete(j);
    return NULL;
}

static void stage_rows(FILE *f, const kiln_bench_phase *ph, const char *indent)
{
    if (!ph->metrics_ok) {
        fprintf(f, "%sstages: /metrics unavailable (%s)\n", indent, ph->metrics_note);
        return;
    }
    size_t images = ph->n_lat ? ph->n_lat : 1;
    fprintf(f, "%s%-48s %7s %10s %10s\n", indent, "where the time goes (/metrics)", "count",
            "ms/obs", "ms/image");
    for (size_t i = 0; i < ph->n_stages; i++) {
        const kiln_bench_stage *g = &ph->stages[i];
        char name[sizeof g->family + sizeof g->labels + 2];
        snprintf(name, sizeof name, "%s{%s}", g->family, g->labels);
        fprintf(f, "%s%-48s %7.0f %10.2f %10.2f\n", indent, name, g->count,
                1e3 * g->sum_s / g->count, 1e3 * g->sum_s / (double)images);
    }
    kiln_bench_summary lat;
    lat_summary(ph, &lat);
    double total = server_total_mean(ph);
    if (total > 0 && lat.n)
        fprintf(f, "%s%-48s %7s %10.2f\n", indent, "http + transfer (client mean - server total)",
                "", 1e3 * (lat.mean - total));
}

void kiln_bench_report_table(FILE *f, const kiln_bench_opts *o, const kiln_bench_phase *lat,
                             const kiln_bench_phase *tp, int n_tp)
{
    fprintf(f, "kiln-bench %s  %dx%d  steps %s%d  %s%s%s\n", o->url, o->width, o->height,
            o->steps ? "" : "(server default) ", o->steps, o->format, o->model ? "  model " : "",
            o->model ? o->model : "");
    if (lat) {
        kiln_bench_summary s;
        lat_summary(lat, &s);
        fprintf(f, "\nlatency (B=1, one at a time, %d warm-ups): n %zu  median %.1f ms  p95 %.1f ms"
                   "  min %.1f  max %.1f  errors %d\n",
                o->warmup, s.n, 1e3 * s.median, 1e3 * s.p95, 1e3 * s.min, 1e3 * s.max,
                lat->errors);
        if (lat->errors)
            fprintf(f, "  first error: %s\n", lat->first_error);
        stage_rows(f, lat, "  ");
    }
    if (n_tp) {
        fprintf(f, "\nthroughput (%d repeats x %d images)\n", o->repeats, o->images);
        fprintf(f, "  %5s %10s %16s %12s %12s %7s\n", "conc", "images/s", "range", "lat p50 ms",
                "lat p95 ms", "errors");
    }
    for (int i = 0; i < n_tp; i++) {
        kiln_bench_summary ips, l;
        ips_summary(&tp[i], &ips);
        lat_summary(&tp[i], &l);
        char range[40];
        snprintf(range, sizeof range, "%.2f-%.2f", ips.min, ips.max);
        fprintf(f, "  %5d %10.2f %16s %12.1f %12.1f %7d\n", tp[i].concurrency, ips.median, range,
                1e3 * l.median, 1e3 * l.p95, tp[i].errors);
    }
    for (int i = 0; i < n_tp; i++) {
        fprintf(f, "\n  concurrency %d:\n", tp[i].concurrency);
        if (tp[i].errors)
            fprintf(f, "    first error: %s\n", tp[i].first_error);
        stage_rows(f, &tp[i], "    ");
    }
}
