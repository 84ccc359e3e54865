#include "metrics.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROUTE_STATUS 128

static const double latency_bounds[] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                        2.5,   5,    10,    30,   60,  120,  300};
#define N_LAT ((int)(sizeof latency_bounds / sizeof latency_bounds[0]))
static const double batch_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
#define N_BATCH ((int)(sizeof batch_bounds / sizeof batch_bounds[0]))

typedef struct hist {
    uint64_t buckets[16]; /* per bound (not cumulative); the last counts +Inf only */
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
    hist latency[KILN_PHASE_COUNT];
    hist part[KILN_PART_COUNT];
    hist batch[KILN_STAGE_COUNT];
    uint64_t images;
    uint64_t events[KILN_EVENT_COUNT];
    uint64_t rejected[KILN_REJECT_COUNT];
};

static const char *phase_names[KILN_PHASE_COUNT] = {"queue", "encode", "denoise", "decode",
                                                    "total"};
static const char *part_names[KILN_PART_COUNT] = {"encode_run",    "denoise_setup",
                                                  "denoise_step",  "decode_vae",
                                                  "image_encode",  "handoff"};
static const char *event_names[KILN_EVENT_COUNT] = {"replica_lost", "redispatch", "timeout",
                                                    "cancel", "handoff_failure",
                                                    "cancel_timeout", "replica_left"};
static const char *reject_names[KILN_REJECT_COUNT] = {"fenced", "unregistered", "not_handed",
                                                      "foreign_ref"};

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

void kiln_metrics_latency(kiln_metrics *m, kiln_phase phase, double seconds)
{
    observe(&m->latency[phase], latency_bounds, N_LAT, seconds < 0 ? 0 : seconds);
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

static void put_hist(writer *w, const char *family, const char *label, const char *value,
                     const hist *h, const double *bounds, int n)
{
    uint64_t cum = 0;
    for (int i = 0; i < n; i++) {
        cum += h->buckets[i];
        put(w, "%s_bucket{%s=\"%s\",le=\"%g\"} %llu\n", family, label, value, bounds[i],
            (unsigned long long)cum);
    }
    put(w, "%s_bucket{%s=\"%s\",le=\"+Inf\"} %llu\n", family, label, value,
        (unsigned long long)h->count);
    put(w, "%s_sum{%s=\"%s\"} %.6f\n", family, label, value, h->sum);
    put(w, "%s_count{%s=\"%s\"} %llu\n", family, label, value, (unsigned long long)h->count);
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

    put(&w, "# HELP kiln_latency_seconds Request latency by phase.\n"
            "# TYPE kiln_latency_seconds histogram\n");
    for (int p = 0; p < KILN_PHASE_COUNT; p++)
        put_hist(&w, "kiln_latency_seconds", "phase", phase_names[p], &m->latency[p],
                 latency_bounds, N_LAT);
    put(&w, "# HELP kiln_stage_seconds Parts of the stages, from the replicas' timings.\n"
            "# TYPE kiln_stage_seconds histogram\n");
    for (int p = 0; p < KILN_PART_COUNT; p++)
        put_hist(&w, "kiln_stage_seconds", "part", part_names[p], &m->part[p], latency_bounds,
                 N_LAT);
    put(&w, "# HELP kiln_batch_rows Rows in the replica batch a job ran in.\n"
            "# TYPE kiln_batch_rows histogram\n");
    for (int s = 0; s < KILN_STAGE_COUNT; s++)
        put_hist(&w, "kiln_batch_rows", "stage", kiln_stage_name((kiln_stage)s), &m->batch[s],
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
    if (w.st)
        out->len = start;
    return w.st;
}
