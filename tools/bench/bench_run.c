#include "bench_run.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "bench_http.h"
#include "services/gateway/base64.h"

#define GEN_PATH "/v1/images/generations"

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* --- prompts --------------------------------------------------------------- */

void kiln_bench_prompts_free(kiln_bench_prompts *p)
{
    free(p->v);
    free(p->text);
    memset(p, 0, sizeof *p);
}

kiln_status kiln_bench_prompts_load(const char *path, kiln_bench_prompts *p, kiln_err *err)
{
    memset(p, 0, sizeof *p);
    FILE *f = fopen(path, "rb");
    if (!f)
        return kiln_err_set(err, KILN_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    kiln_buf b = {0};
    char chunk[65536];
    size_t k;
    kiln_status st = KILN_OK;
    while (!st && (k = fread(chunk, 1, sizeof chunk, f)) > 0)
        st = kiln_buf_append(&b, chunk, k, err);
    if (!st && ferror(f))
        st = kiln_err_set(err, KILN_ERR_IO, "cannot read %s", path);
    fclose(f);
    if (!st)
        st = kiln_buf_append(&b, "", 1, err);
    size_t lines = 1;
    for (size_t i = 0; !st && i < b.len; i++)
        lines += b.data[i] == '\n';
    if (!st && !(p->v = malloc(lines * sizeof *p->v)))
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    if (st) {
        kiln_buf_free(&b);
        return st;
    }
    p->text = (char *)b.data;
    for (char *line = p->text, *nl; line; line = nl) {
        nl = strchr(line, '\n');
        if (nl)
            *nl++ = '\0';
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r')
            line[--l] = '\0';
        if (l)
            p->v[p->n++] = line;
    }
    if (!p->n) {
        kiln_bench_prompts_free(p);
        return kiln_err_set(err, KILN_ERR_INVALID, "%s holds no prompts", path);
    }
    return KILN_OK;
}

/* --- one request ------------------------------------------------------------- */

kiln_status kiln_bench_request_body(const kiln_bench_opts *o, const char *prompt, uint64_t seed,
                                    kiln_buf *out, kiln_err *err)
{
    char size[32];
    snprintf(size, sizeof size, "%dx%d", o->width, o->height);
    cJSON *j = cJSON_CreateObject();
    int ok = j && (!o->model || cJSON_AddStringToObject(j, "model", o->model)) &&
             cJSON_AddStringToObject(j, "prompt", prompt) && cJSON_AddNumberToObject(j, "n", 1) &&
             cJSON_AddStringToObject(j, "size", size) &&
             cJSON_AddNumberToObject(j, "seed", (double)seed) &&
             (!o->steps || cJSON_AddNumberToObject(j, "num_inference_steps", o->steps)) &&
             cJSON_AddStringToObject(j, "response_format", "b64_json") &&
             cJSON_AddStringToObject(j, "output_format", o->format);
    char *text = ok ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    if (!text)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_buf_clear(out);
    kiln_status st = kiln_buf_append(out, text, strlen(text), err);
    cJSON_free(text);
    return st;
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The file's first bytes against the requested format (and PNG size). */
static kiln_status check_image(const kiln_bench_opts *o, const char *b64, kiln_err *err)
{
    size_t n = strlen(b64);
    if (n < 32)
        return kiln_err_set(err, KILN_ERR_INVALID, "image of %zu base64 characters", n);
    kiln_buf head = {0};
    kiln_status st = kiln_base64_decode(b64, 32, &head, err); /* the first 24 bytes */
    if (st) {
        kiln_buf_free(&head);
        return kiln_err_wrap(err, "b64_json");
    }
    const uint8_t *h = head.data;
    if (!strcmp(o->format, "png")) {
        if (memcmp(h, "\x89PNG\r\n\x1a\n", 8) || memcmp(h + 12, "IHDR", 4))
            st = kiln_err_set(err, KILN_ERR_INVALID, "not a PNG");
        else if (be32(h + 16) != (uint32_t)o->width || be32(h + 20) != (uint32_t)o->height)
            st = kiln_err_set(err, KILN_ERR_INVALID, "PNG is %ux%u, asked for %dx%d",
                              be32(h + 16), be32(h + 20), o->width, o->height);
    } else if (!strcmp(o->format, "jpeg")) {
        if (memcmp(h, "\xff\xd8\xff", 3))
            st = kiln_err_set(err, KILN_ERR_INVALID, "not a JPEG");
    } else if (memcmp(h, "RIFF", 4) || memcmp(h + 8, "WEBP", 4)) {
        st = kiln_err_set(err, KILN_ERR_INVALID, "not a WebP");
    }
    kiln_buf_free(&head);
    return st;
}

kiln_status kiln_bench_check_response(const kiln_bench_opts *o, int status, const kiln_buf *body,
                                      uint64_t seed, kiln_err *err)
{
    cJSON *j = cJSON_ParseWithLength((const char *)body->data, body->len);
    if (status != 200) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(e, "message");
        kiln_err_set(err, KILN_ERR_INVALID, "HTTP %d: %s", status,
                     cJSON_IsString(m) ? m->valuestring : "(no OpenAI error body)");
        cJSON_Delete(j);
        return KILN_ERR_INVALID;
    }
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(j, "data");
    const cJSON *img = cJSON_GetArrayItem(data, 0);
    const cJSON *b64 = cJSON_GetObjectItemCaseSensitive(img, "b64_json");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(img, "seed");
    kiln_status st = KILN_OK;
    if (!j)
        st = kiln_err_set(err, KILN_ERR_INVALID, "the body is not JSON");
    else if (!cJSON_IsArray(data) || cJSON_GetArraySize(data) != 1 || !cJSON_IsString(b64))
        st = kiln_err_set(err, KILN_ERR_INVALID, "no data[0].b64_json, or not exactly one image");
    else if (!cJSON_IsNumber(s) || s->valuedouble != (double)seed)
        st = kiln_err_set(err, KILN_ERR_INVALID, "data[0].seed is not %llu",
                          (unsigned long long)seed);
    else
        st = check_image(o, b64->valuestring, err);
    cJSON_Delete(j);
    return st;
}

/* --- /metrics and /readyz ---------------------------------------------------- */

/* NULL with a note when the gateway has no readable /metrics. */
static kiln_prom *scrape(const kiln_bench_opts *o, char *note, size_t note_len)
{
    kiln_err err = {0};
    kiln_http_client *c = kiln_http_client_create(o->url, 30, &err);
    kiln_buf body = {0};
    int status = 0;
    kiln_prom *p = NULL;
    if (c && !kiln_http_request(c, "GET", "/metrics", NULL, NULL, 0, &status, &body, &err)) {
        if (status == 200)
            p = kiln_prom_parse((const char *)body.data, body.len, &err);
        else
            kiln_err_set(&err, KILN_ERR_INVALID, "GET /metrics answered %d", status);
    }
    if (!p)
        snprintf(note, note_len, "%s", err.msg);
    kiln_buf_free(&body);
    kiln_http_client_destroy(c);
    return p;
}

kiln_status kiln_bench_wait_ready(const kiln_bench_opts *o, kiln_err *err)
{
    kiln_http_client *c = kiln_http_client_create(o->url, 5, err);
    if (!c)
        return err->code;
    kiln_buf body = {0};
    double deadline = now_s() + o->wait_ready_s;
    kiln_err last = {0};
    int status = 0;
    for (;;) {
        kiln_err_clear(&last);
        if (!kiln_http_request(c, "GET", "/readyz", NULL, NULL, 0, &status, &body, &last) &&
            status == 200)
            break;
        if (now_s() >= deadline) {
            kiln_buf_free(&body);
            kiln_http_client_destroy(c);
            return kiln_err_set(err, KILN_ERR_UNAVAILABLE, "%s not ready after %.0f s (%s)",
                                o->url, o->wait_ready_s,
                                last.code ? last.msg : "GET /readyz did not answer 200");
        }
        nanosleep(&(struct timespec){0, 500000000}, NULL);
    }
    kiln_buf_free(&body);
    kiln_http_client_destroy(c);
    return KILN_OK;
}

/* --- phases ------------------------------------------------------------------ */

void kiln_bench_phase_free(kiln_bench_phase *ph)
{
    free(ph->lat);
    free(ph->stages);
    memset(ph, 0, sizeof *ph);
}

/* State shared by the threads of one phase; `mu` guards the counters. */
typedef struct shared {
    const kiln_bench_opts *o;
    const kiln_bench_prompts *p;
    uint64_t base;  /* request number of the first request */
    int total;      /* requests to send */
    int next;       /* next request to take */
    pthread_mutex_t mu;
    kiln_bench_phase *ph;
    double t_end;   /* when the last response arrived */
} shared;

static void record(shared *s, double seconds, const kiln_err *e)
{
    pthread_mutex_lock(&s->mu);
    if (e->code) {
        if (!s->ph->errors++)
            snprintf(s->ph->first_error, sizeof s->ph->first_error, "%s", e->msg);
    } else {
        s->ph->lat[s->ph->n_lat++] = seconds;
    }
    double t = now_s();
    if (t > s->t_end)
        s->t_end = t;
    pthread_mutex_unlock(&s->mu);
}

/* Sends requests until `total` were taken; one connection per caller. */
static void *worker(void *arg)
{
    shared *s = arg;
    kiln_err err = {0};
    kiln_buf req = {0}, resp = {0};
    kiln_http_client *c = kiln_http_client_create(s->o->url, s->o->timeout_s, &err);
    for (;;) {
        pthread_mutex_lock(&s->mu);
        int k = s->next < s->total ? s->next++ : -1;
        pthread_mutex_unlock(&s->mu);
        if (k < 0)
            break;
        uint64_t idx = (s->base + (uint64_t)k) % s->p->n;
        int status = 0;
        kiln_err e = err; /* a client that could not be made fails every request */
        double t0 = now_s();
        if (c && !kiln_bench_request_body(s->o, s->p->v[idx], idx, &req, &e) &&
            !kiln_http_request(c, "POST", GEN_PATH, "application/json", req.data, req.len,
                               &status, &resp, &e)) {
            double dt = now_s() - t0;
            kiln_bench_check_response(s->o, status, &resp, idx, &e);
            record(s, dt, &e);
        } else {
            record(s, 0, &e);
        }
    }
    kiln_buf_free(&req);
    kiln_buf_free(&resp);
    kiln_http_client_destroy(c);
    return NULL;
}

/* Runs `total` requests from `conc` threads; returns the wall time. */
static kiln_status run_requests(const kiln_bench_opts *o, const kiln_bench_prompts *p,
                                uint64_t *next, int total, int conc, kiln_bench_phase *ph,
                                double *wall, kiln_err *err)
{
    shared s = {o, p, *next, total, 0, PTHREAD_MUTEX_INITIALIZER, ph, 0};
    pthread_t th[1024];
    int started = 0;
    double t0 = now_s();
    s.t_end = t0;
    kiln_status st = KILN_OK;
    if (conc == 1) {
        worker(&s);
    } else {
        for (; started < conc; started++) {
            int rc = pthread_create(&th[started], NULL, worker, &s);
            if (rc) {
                st = kiln_err_set(err, KILN_ERR_NOMEM, "pthread_create: %s", strerror(rc));
                break;
            }
        }
        for (int i = 0; i < started; i++)
            pthread_join(th[i], NULL);
    }
    *next += (uint64_t)total;
    *wall = s.t_end - t0;
    return st;
}

static kiln_status phase_begin(kiln_bench_phase *ph, int conc, size_t max_requests, kiln_err *err)
{
    memset(ph, 0, sizeof *ph);
    ph->concurrency = conc;
    if (!(ph->lat = malloc((max_requests ? max_requests : 1) * sizeof *ph->lat)))
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    return KILN_OK;
}

/* Discards warm-up results from the phase's counters. */
static void phase_reset(kiln_bench_phase *ph)
{
    ph->n_lat = 0;
    ph->errors = 0;
    ph->first_error[0] = '\0';
}

static kiln_status phase_metrics(const kiln_bench_opts *o, kiln_bench_phase *ph, kiln_prom *before,
                                 kiln_err *err)
{
    kiln_status st = KILN_OK;
    kiln_prom *after = before ? scrape(o, ph->metrics_note, sizeof ph->metrics_note) : NULL;
    if (after) {
        st = kiln_bench_stage_deltas(before, after, &ph->stages, &ph->n_stages, err);
        ph->metrics_ok = !st;
    }
    kiln_prom_free(after);
    kiln_prom_free(before);
    return st;
}

kiln_status kiln_bench_run_latency(const kiln_bench_opts *o, const kiln_bench_prompts *p,
                                   uint64_t *next, kiln_bench_phase *ph, kiln_err *err)
{
    size_t most = (size_t)(o->warmup > o->n_latency ? o->warmup : o->n_latency);
    kiln_status st = phase_begin(ph, 1, most, err);
    double wall;
    if (!st && o->warmup)
        st = run_requests(o, p, next, o->warmup, 1, ph, &wall, err);
    phase_reset(ph);
    kiln_prom *before = st ? NULL : scrape(o, ph->metrics_note, sizeof ph->metrics_note);
    if (!st)
        st = run_requests(o, p, next, o->n_latency, 1, ph, &ph->wall_s, err);
    ph->requests = o->n_latency;
    kiln_status mst = phase_metrics(o, ph, st ? NULL : before, err);
    if (st)
        kiln_prom_free(before);
    return st ? st : mst;
}

kiln_status kiln_bench_run_throughput(const kiln_bench_opts *o, const kiln_bench_prompts *p,
                                      int conc, uint64_t *next, kiln_bench_phase *ph,
                                      kiln_err *err)
{
    kiln_status st = phase_begin(ph, conc, (size_t)o->images * (size_t)o->repeats, err);
    if (st)
        return st;
    kiln_prom *before = scrape(o, ph->metrics_note, sizeof ph->metrics_note);
    for (int r = 0; !st && r < o->repeats; r++) {
        size_t ok0 = ph->n_lat;
        double wall;
        st = run_requests(o, p, next, o->images, conc, ph, &wall, err);
        ph->wall_s += wall;
        ph->ips[ph->n_rep++] = wall > 0 ? (double)(ph->n_lat - ok0) / wall : 0;
        ph->requests += o->images;
    }
    kiln_status mst = phase_metrics(o, ph, st ? NULL : before, err);
    if (st)
        kiln_prom_free(before);
    return st ? st : mst;
}
