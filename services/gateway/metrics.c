#include "metrics.h"

#include "proc_metrics.h"

#ifndef KILN_VERSION
#define KILN_VERSION "unknown"
#endif
#if defined(__clang__)
#define COMPILER "clang " __clang_version__
#elif defined(__GNUC__)
#define COMPILER "gcc " __VERSION__
#else
#define COMPILER "unknown"
#endif

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROUTE_STATUS 128
#define MAX_DURATIONS 32 /* (route, status) pairs with a duration histogram */
#define N_CODES 16       /* kiln_status values counted by kiln_job_failures_total */

/* Seconds: 10 ms steps where CPU work and hand-offs fall, then dense from
 * 50 ms to 60 s where GPU stages and whole requests do (a 314 ms median
 * sits between 0.3 and 0.4), up to the default request timeout. */
static const double latency_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                        0.4,   0.5,  0.75,  1,    1.5,   2,   3,    5,   7.5,
                                        10,    15,   20,    30,   60,    120, 300};
#define N_LAT ((int)(sizeof latency_bounds / sizeof latency_bounds[0]))
static const double batch_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
#define N_BATCH ((int)(sizeof batch_bounds / sizeof batch_bounds[0]))

typedef struct hist {
    uint64_t buckets[32]; /* per bound (not cumulative); the last counts +Inf only */
    uint64_t count;
    double sum;
} hist;

struct kiln_metrics {
    struct {
        const char *route;
        int status;
        uint64_t count;
    } requests[MAX_ROUTE_STATUS];
    int n_requests;
    struct {
        const char *route;
        int status;
        hist h;
    } duration[MAX_DURATIONS];
    int n_durations;
    hist queue[KILN_STAGE_COUNT][KILN_QUEUE_COUNT];
    hist stage[KILN_STAGE_COUNT];
    hist part[KILN_PART_COUNT];
    uint64_t failures[KILN_STAGE_COUNT][N_CODES];
    double cache_hits, cache_misses, cache_evictions;
    hist batch[KILN_STAGE_COUNT];
    uint64_t images;
    uint64_t events[KILN_EVENT_COUNT];
    uint64_t rejected[KILN_REJECT_COUNT];
    uint64_t image_handoffs[KILN_IMAGE_VIA_COUNT];
};

static const char *queue_names[KILN_QUEUE_COUNT] = {"gateway", "replica"};
static const char *part_names[KILN_PART_COUNT] = {
    "encode_run",   "denoise_setup",  "denoise_step",    "decode_vae",
    "image_encode", "encode_handoff", "denoise_handoff", "decode_handoff"};
static const char *event_names[KILN_EVENT_COUNT] = {"replica_lost", "redispatch", "timeout",
                                                    "cancel", "handoff_failure",
                                                    "cancel_timeout", "replica_left"};
static const char *reject_names[KILN_REJECT_COUNT] = {"fenced", "unregistered", "not_handed",
                                                      "foreign_ref"};
static const char *via_names[KILN_IMAGE_VIA_COUNT] = {"shm", "inline", "failed"};

kiln_metrics *kiln_metrics_create(kiln_err *err)
{
    kiln_metrics *m = calloc(1, sizeof *m);
    if (!m)
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    return m;
}

void kiln_metrics_destroy(kiln_metrics *m)
{
    free(m);
}

void kiln_metrics_request(kiln_metrics *m, const char *route, int status)
{
    for (int i = 0; i < m->n_requests; i++)
        if (m->requests[i].status == status && strcmp(m->requests[i].route, route) == 0) {
            m->requests[i].count++;
            return;
        }
    if (m->n_requests == MAX_ROUTE_STATUS)
        return;
    m->requests[m->n_requests].route = route;
    m->requests[m->n_requests].status = status;
    m->requests[m->n_requests].count = 1;
    m->n_requests++;
}

static void observe(hist *h, const double *bounds, int n, double v)
{
    int i = 0;
    while (i < n && v > bounds[i])
        i++;
    h->buckets[i]++;
    h->count++;
    h->sum += v;
}

void kiln_metrics_duration(kiln_metrics *m, const char *route, int status, double seconds)
{
    int i = 0;
    while (i < m->n_durations &&
           (m->duration[i].status != status || strcmp(m->duration[i].route, route)))
        i++;
    if (i == m->n_durations) {
        if (i == MAX_DURATIONS)
            return;
        m->duration[i].route = route, m->duration[i].status = status;
        m->n_durations++;
    }
    observe(&m->duration[i].h, latency_bounds, N_LAT, seconds < 0 ? 0 : seconds);
}

void kiln_metrics_queue_wait(kiln_metrics *m, kiln_stage stage, kiln_queue q, double seconds)
{
    observe(&m->queue[stage][q], latency_bounds, N_LAT, seconds < 0 ? 0 : seconds);
}

void kiln_metrics_stage(kiln_metrics *m, kiln_stage stage, double seconds)
{
    observe(&m->stage[stage], latency_bounds, N_LAT, seconds < 0 ? 0 : seconds);
}

void kiln_metrics_failure(kiln_metrics *m, kiln_stage stage, kiln_status code)
{
    m->failures[stage][(unsigned)code < N_CODES ? (int)code : KILN_ERR_INTERNAL]++;
}

void kiln_metrics_prompt_cache(kiln_metrics *m, double hits, double misses, double evictions)
{
    m->cache_hits += hits > 0 ? hits : 0;
    m->cache_misses += misses > 0 ? misses : 0;
    m->cache_evictions += evictions > 0 ? evictions : 0;
}

void kiln_metrics_part(kiln_metrics *m, kiln_part part, double seconds)
{
    observe(&m->part[part], latency_bounds, N_LAT, seconds < 0 ? 0 : seconds);
}

void kiln_metrics_batch(kiln_metrics *m, kiln_stage stage, int rows)
{
    observe(&m->batch[stage], batch_bounds, N_BATCH, rows);
}

void kiln_metrics_images(kiln_metrics *m, int n)
{
    m->images += (uint64_t)n;
}

void kiln_metrics_event(kiln_metrics *m, kiln_event ev)
{
    m->events[ev]++;
}

void kiln_metrics_rejected(kiln_metrics *m, kiln_reject why, int n)
{
    m->rejected[why] += (uint64_t)n;
}

void kiln_metrics_image_handoffs(kiln_metrics *m, kiln_image_via via, int n)
{
    m->image_handoffs[via] += (uint64_t)n;
}

typedef struct writer {
    kiln_buf *out;
    kiln_status st;
    kiln_err *err;
} writer;

static void put(writer *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(writer *w, const char *fmt, ...)
{
    if (w->st)
        return;
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof line)
        n = (int)strlen(line);
    w->st = kiln_buf_append(w->out, line, (size_t)n, w->err);
}

/* One histogram series; `labels` is its label pairs without braces. */
static void put_hist(writer *w, const char *family, const char *labels, const hist *h,
                     const double *bounds, int n)
{
    uint64_t cum = 0;
    for (int i = 0; i < n; i++) {
        cum += h->buckets[i];
        put(w, "%s_bucket{%s,le=\"%g\"} %llu\n", family, labels, bounds[i],
            (unsigned long long)cum);
    }
    put(w, "%s_bucket{%s,le=\"+Inf\"} %llu\n", family, labels, (unsigned long long)h->count);
    put(w, "%s_sum{%s} %.6f\n", family, labels, h->sum);
    put(w, "%s_count{%s} %llu\n", family, labels, (unsigned long long)h->count);
}

static void put_hist1(writer *w, const char *family, const char *label, const char *value,
                      const hist *h, const double *bounds, int n)
{
    char l[128];
    snprintf(l, sizeof l, "%s=\"%s\"", label, value);
    put_hist(w, family, l, h, bounds, n);
}

kiln_status kiln_metrics_render(const kiln_metrics *m, const kiln_metrics_gauges *g, kiln_buf *out,
                                kiln_err *err)
{
    size_t start = out->len;
    writer w = {out, KILN_OK, err};
    put(&w, "# HELP kiln_http_requests_total HTTP requests answered, by route and status.\n"
            "# TYPE kiln_http_requests_total counter\n");
    for (int i = 0; i < m->n_requests; i++)
        put(&w, "kiln_http_requests_total{route=\"%s\",status=\"%d\"} %llu\n",
            m->requests[i].route, m->requests[i].status,
            (unsigned long long)m->requests[i].count);

    static const struct {
        const char *name, *help;
    } gauges[] = {
        {"kiln_queue_depth", "Jobs waiting in the gateway's queue of a stage."},
        {"kiln_inflight", "Jobs sent to a replica of a stage and not done."},
        {"kiln_replicas", "Live replicas of a stage."},
        {"kiln_replicas_busy", "Live replicas of a stage running jobs or still on cancelled ones."},
        {"kiln_cancelling", "Cancels sent to replicas running the job, not answered yet."},
        {"kiln_replicas_shm_full", "Live replicas of a stage without room in /dev/shm for their "
                                   "outputs (they take no work)."},
    };
    const int *values[] = {g->queued, g->inflight, g->replicas, g->busy, g->cancelling,
                           g->shm_short};
    for (int k = 0; k < 6; k++) {
        const int *v = values[k];
        put(&w, "# HELP %s %s\n# TYPE %s gauge\n", gauges[k].name, gauges[k].help, gauges[k].name);
        for (int s = 0; s < KILN_STAGE_COUNT; s++)
            put(&w, "%s{stage=\"%s\"} %d\n", gauges[k].name, kiln_stage_name((kiln_stage)s), v[s]);
    }
    const struct {
        const char *name, *type, *help;
        double v;
    } scalars[] = {
        {"kiln_jobs", "gauge", "Accepted requests not yet answered.", g->jobs},
        {"kiln_connections", "gauge", "Open HTTP connections.", g->connections},
        {"kiln_clients", "gauge",
         "Clients (bearer token, else address) holding a connection or a request body.",
         g->clients},
        {"kiln_body_bytes", "gauge", "Request body bytes held, charged to the body budget.",
         g->body_bytes},
        {"kiln_body_waiting", "gauge", "Request bodies waiting for the body budget.",
         g->body_waiting},
        {"kiln_body_waits_total", "counter", "Request bodies that had to wait for the body budget.",
         g->body_waits},
    };
    for (size_t k = 0; k < sizeof scalars / sizeof scalars[0]; k++)
        put(&w, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", scalars[k].name, scalars[k].help,
            scalars[k].name, scalars[k].type, scalars[k].name, scalars[k].v);
    put(&w, "# HELP kiln_connections_refused_total Connections refused (503), by the limit.\n"
            "# TYPE kiln_connections_refused_total counter\n"
            "kiln_connections_refused_total{reason=\"max_connections\"} %.0f\n"
            "kiln_connections_refused_total{reason=\"max_client_connections\"} %.0f\n",
        g->refused_global, g->refused_client);
    put(&w, "# HELP kiln_limit Configured limits (bytes, seconds, counts).\n"
            "# TYPE kiln_limit gauge\n");
    for (int i = 0; i < g->n_limits; i++)
        put(&w, "kiln_limit{name=\"%s\"} %.17g\n", g->limits[i].name, g->limits[i].value);

    put(&w, "# HELP kiln_request_duration_seconds Image requests from their first byte to "
            "their answer, by route and status.\n"
            "# TYPE kiln_request_duration_seconds histogram\n");
    for (int i = 0; i < m->n_durations; i++) {
        char l[160];
        snprintf(l, sizeof l, "route=\"%s\",status=\"%d\"", m->duration[i].route,
                 m->duration[i].status);
        put_hist(&w, "kiln_request_duration_seconds", l, &m->duration[i].h, latency_bounds, N_LAT);
    }
    put(&w, "# HELP kiln_queue_wait_seconds Time a job waited before a stage ran it: in the "
            "gateway's queue of the stage, or in the replica's own queue.\n"
            "# TYPE kiln_queue_wait_seconds histogram\n");
    for (int st = 0; st < KILN_STAGE_COUNT; st++)
        for (int q = 0; q < KILN_QUEUE_COUNT; q++) {
            char l[96];
            snprintf(l, sizeof l, "stage=\"%s\",queue=\"%s\"", kiln_stage_name((kiln_stage)st),
                     queue_names[q]);
            put_hist(&w, "kiln_queue_wait_seconds", l, &m->queue[st][q], latency_bounds, N_LAT);
        }
    put(&w, "# HELP kiln_stage_duration_seconds A stage's time for a job at the gateway: "
            "dispatch to done (the replica's queue and run, and the hand-offs).\n"
            "# TYPE kiln_stage_duration_seconds histogram\n");
    for (int st = 0; st < KILN_STAGE_COUNT; st++)
        put_hist1(&w, "kiln_stage_duration_seconds", "stage", kiln_stage_name((kiln_stage)st),
                  &m->stage[st], latency_bounds, N_LAT);
    put(&w, "# HELP kiln_stage_seconds Parts of the stages, from the replicas' timings.\n"
            "# TYPE kiln_stage_seconds histogram\n");
    for (int p = 0; p < KILN_PART_COUNT; p++)
        put_hist1(&w, "kiln_stage_seconds", "part", part_names[p], &m->part[p], latency_bounds,
                  N_LAT);
    put(&w, "# HELP kiln_job_failures_total Jobs a stage answered with an error, by status.\n"
            "# TYPE kiln_job_failures_total counter\n");
    for (int st = 0; st < KILN_STAGE_COUNT; st++)
        for (int c = 1; c < N_CODES; c++)
            if (m->failures[st][c])
                put(&w, "kiln_job_failures_total{stage=\"%s\",code=\"%s\"} %llu\n",
                    kiln_stage_name((kiln_stage)st), kiln_status_name((kiln_status)c),
                    (unsigned long long)m->failures[st][c]);
    put(&w, "# HELP kiln_prompt_cache_hits_total Prompts the encoders found in their prompt "
            "cache.\n# TYPE kiln_prompt_cache_hits_total counter\nkiln_prompt_cache_hits_total "
            "%.0f\n", m->cache_hits);
    put(&w, "# HELP kiln_prompt_cache_misses_total Prompts the encoders ran through the text "
            "encoder.\n# TYPE kiln_prompt_cache_misses_total counter\n"
            "kiln_prompt_cache_misses_total %.0f\n", m->cache_misses);
    put(&w, "# HELP kiln_prompt_cache_evictions_total Prompt cache entries dropped for room.\n"
            "# TYPE kiln_prompt_cache_evictions_total counter\n"
            "kiln_prompt_cache_evictions_total %.0f\n", m->cache_evictions);
    put(&w, "# HELP kiln_batch_rows Rows in the replica batch a job ran in.\n"
            "# TYPE kiln_batch_rows histogram\n");
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        put_hist1(&w, "kiln_batch_rows", "stage", kiln_stage_name((kiln_stage)s), &m->batch[s],
                  batch_bounds, N_BATCH);
    put(&w, "# HELP kiln_images_generated_total Images returned to clients.\n"
            "# TYPE kiln_images_generated_total counter\nkiln_images_generated_total %llu\n",
        (unsigned long long)m->images);
    put(&w, "# HELP kiln_events_total Scheduler events.\n# TYPE kiln_events_total counter\n");
    for (int e = 0; e < KILN_EVENT_COUNT; e++)
        put(&w, "kiln_events_total{event=\"%s\"} %llu\n", event_names[e],
            (unsigned long long)m->events[e]);
    put(&w, "# HELP kiln_bus_rejected_total Bus messages (or references in them) the gateway "
            "refused to act on.\n# TYPE kiln_bus_rejected_total counter\n");
    for (int r = 0; r < KILN_REJECT_COUNT; r++)
        put(&w, "kiln_bus_rejected_total{reason=\"%s\"} %llu\n", reject_names[r],
            (unsigned long long)m->rejected[r]);
    put(&w, "# HELP kiln_image_handoffs_total Decoded image files by how they reached the "
            "gateway: by reference in the decoder's shared memory, inline in its message, or "
            "by a reference it could not use.\n# TYPE kiln_image_handoffs_total counter\n");
    for (int v = 0; v < KILN_IMAGE_VIA_COUNT; v++)
        put(&w, "kiln_image_handoffs_total{via=\"%s\"} %llu\n", via_names[v],
            (unsigned long long)m->image_handoffs[v]);
    static const struct {
        const char *name, *type, *help;
    } per_replica[] = {
        {"kiln_replica_inflight", "gauge", "Jobs sent to the replica, not done."},
        {"kiln_replica_jobs_total", "counter", "Jobs the replica answered (this incarnation)."},
        {"kiln_replica_heartbeat_age_seconds", "gauge", "Seconds since the replica was last heard."},
        {"kiln_replica_resident_memory_bytes", "gauge",
         "The replica process's resident memory (VmRSS)."},
        {"kiln_replica_gpu_memory_used_bytes", "gauge",
         "Memory in use on the replica's GPU, by every process on it (cudaMemGetInfo)."},
        {"kiln_replica_gpu_memory_total_bytes", "gauge", "Memory of the replica's GPU."},
    };
    for (int k = 0; k < 6; k++) {
        put(&w, "# HELP %s %s\n# TYPE %s %s\n", per_replica[k].name, per_replica[k].help,
            per_replica[k].name, per_replica[k].type);
        for (int i = 0; i < g->n_replicas; i++) {
            const double v[] = {g->replica[i].inflight, g->replica[i].jobs,
                                g->replica[i].heartbeat_age, g->replica[i].rss,
                                g->replica[i].dev_used, g->replica[i].dev_total};
            if (k >= 3 && v[k] <= 0)
                continue; /* not reported (an older replica; no GPU) */
            put(&w, "%s{stage=\"%s\",replica=\"%s\"} %.17g\n", per_replica[k].name,
                kiln_stage_name(g->replica[i].stage), g->replica[i].id, v[k]);
        }
    }
    put(&w, "# HELP kiln_build_info The kiln build serving (value 1).\n"
            "# TYPE kiln_build_info gauge\n"
            "kiln_build_info{version=\"%s\",compiler=\"%s\"} 1\n", KILN_VERSION, COMPILER);
    if (!w.st)
        w.st = kiln_proc_metrics_render(out, err);
    if (w.st)
        out->len = start;
    return w.st;
}
