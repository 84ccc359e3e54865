/* The HTTP routes: health, readiness, metrics, models, and the two image
 * routes, whose requests are parsed on the worker pool and then handed to
 * the scheduler. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "api_response.h"
#include "common/log.h"
#include "gateway.h"

#define R_GENERATIONS "/v1/images/generations"
#define R_EDITS "/v1/images/edits"
#define R_MODELS "/v1/models"
#define R_HEALTH "/healthz"
#define R_READY "/readyz"
#define R_METRICS "/metrics"
#define R_OTHER "other"
#define R_PLAYGROUND "/"
#define R_TRACES "/v1/traces"

/* playground.html, embedded at build time (embed.py). */
extern const char kiln_gw_playground_html[];
extern const unsigned long kiln_gw_playground_html_len;

typedef enum pending_state { P_PARSING, P_QUEUED } pending_state;

/* An image request between its arrival and its answer. */
typedef struct gw_pending {
    kiln_gateway *gw;
    kiln_http_conn *conn; /* NULL once the client went away */
    const char *route;
    char id[KILN_REQUEST_ID_MAX]; /* the request id (X-Request-Id) */
    pending_state state;
    uv_work_t work;
    kiln_api_kind kind;
    char content_type[KILN_HTTP_CTYPE_MAX + 1];
    kiln_buf body;
    kiln_api_request req;
    kiln_api_error e;
    kiln_status st;
    uint64_t job;
    uint64_t client; /* the HTTP request's (clients.h) */
    int steps;       /* its resolved steps, for the access log (the scheduler takes req) */
    int64_t created; /* stream: created_at of its events (its first one's time) */
    double t_first, t_parse0, t_parse1; /* its first byte, parse queued, parsed (trace) */
} gw_pending;

static void reply(kiln_gateway *gw, kiln_http_conn *c, const char *route, int status,
                  const char *ctype, const char *extra, kiln_buf *body)
{
    kiln_metrics_request(gw->metrics, route, status);
    if (!strcmp(route, R_GENERATIONS) || !strcmp(route, R_EDITS))
        kiln_metrics_duration(gw->metrics, route, status, kiln_http_conn_age_ms(c) / 1000.0);
    kiln_http_respond(c, status, ctype, extra, body);
    kiln_buf_free(body);
}

static void reply_error(kiln_gateway *gw, kiln_http_conn *c, const char *route, int status,
                        const char *msg, const char *param, const char *code, const char *extra)
{
    kiln_buf body = {0};
    if (kiln_api_error_json(&body, status, msg, param, code, NULL))
        kiln_buf_clear(&body); /* out of memory: the status alone must do */
    reply(gw, c, route, status, "application/json", extra, &body);
}

static void reply_text(kiln_gateway *gw, kiln_http_conn *c, const char *route, int status,
                       const char *ctype, const char *text)
{
    kiln_buf body = {0};
    if (kiln_buf_append(&body, text, strlen(text), NULL)) {
        reply_error(gw, c, route, 500, "out of memory", NULL, "server_error", NULL);
        return;
    }
    reply(gw, c, route, status, ctype, NULL, &body);
}


/* An error answer to image request p on connection c, naming the request
 * (5xx: "internal error" and its id, the detail in the log). */
static void pending_error(gw_pending *p, kiln_http_conn *c, int status, const char *msg,
                          const char *param, const char *code, const char *more)
{
    char text[KILN_ERR_MSG_MAX + 64];
    if (status == 500)
        snprintf(text, sizeof text, "internal error (request %s)", p->id);
    else
        snprintf(text, sizeof text, "%s", msg);
    reply_error(p->gw, c, p->route, status, text, param, code, more);
}

static void route_ready(kiln_gateway *gw, kiln_http_conn *c)
{
    kiln_metrics_gauges g;
    kiln_sched_gauges(gw->sched, &g);
    char text[400];
    int ok = !gw->draining && kiln_sched_ready(gw->sched);
    snprintf(text, sizeof text,
             "{\"status\":\"%s\",\"replicas\":{\"encode\":%d,\"denoise\":%d,\"decode\":%d},"
             "\"shm_full\":{\"encode\":%d,\"denoise\":%d,\"decode\":%d},"
             "\"handoff_failures\":{\"total\":%d,\"in_a_row\":{\"denoise\":%d,\"decode\":%d}}}",
             ok ? "ready" : gw->draining ? "draining" : "not_ready", g.replicas[0], g.replicas[1],
             g.replicas[2], g.shm_short[0], g.shm_short[1], g.shm_short[2], g.handoff_failures,
             g.handoff_streak[KILN_STAGE_DENOISE], g.handoff_streak[KILN_STAGE_DECODE]);
    reply_text(gw, c, R_READY, ok ? 200 : 503, "application/json", text);
}

/* The gauges of /metrics: the scheduler's, the HTTP side's and the limits. */
static void gauges(kiln_gateway *gw, kiln_metrics_gauges *g)
{
    kiln_sched_gauges(gw->sched, g);
    kiln_http_server_stats hs;
    kiln_http_server_stats_get(gw->http, &hs);
    kiln_gw_clients_stats cs;
    kiln_gw_clients_stats_get(gw->clients, &cs);
    g->connections = hs.connections;
    g->refused_global = (double)hs.refused;
    g->refused_client = (double)cs.conn_refused;
    g->clients = cs.clients;
    g->body_bytes = (double)cs.body_bytes;
    g->body_waiting = cs.body_waiting;
    g->body_waits = (double)cs.body_waits;
    g->limits = gw->limits;
    g->n_limits = gw->n_limits;
}

static void route_metrics(kiln_gateway *gw, kiln_http_conn *c)
{
    kiln_metrics_gauges g;
    gauges(gw, &g);
    kiln_buf body = {0};
    /* Counted before rendering, so a scrape sees itself. */
    kiln_metrics_request(gw->metrics, R_METRICS, 200);
    if (kiln_metrics_render(gw->metrics, &g, &body, NULL)) {
        kiln_buf_free(&body);
        reply_error(gw, c, R_METRICS, 500, "out of memory", NULL, "server_error", NULL);
        return;
    }
    kiln_http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, &body);
    kiln_buf_free(&body);
}

static void route_models(kiln_gateway *gw, kiln_http_conn *c, const char *path)
{
    char text[512];
    char model[256];
    snprintf(model, sizeof model,
             "{\"id\":\"%s\",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"kiln\"}",
             gw->served_name, (long long)gw->started);
    if (strcmp(path, R_MODELS) == 0) {
        snprintf(text, sizeof text, "{\"object\":\"list\",\"data\":[%s]}", model);
        reply_text(gw, c, R_MODELS, 200, "application/json", text);
    } else if (strcmp(path + sizeof R_MODELS, gw->served_name) == 0) {
        reply_text(gw, c, R_MODELS, 200, "application/json", model);
    } else {
        reply_error(gw, c, R_MODELS, 404, "The model does not exist", "model", "model_not_found",
                    NULL);
    }
}

static void parse_work(uv_work_t *w)
{
    gw_pending *p = w->data;
    p->st = kiln_api_parse(p->kind, p->content_type, p->body.data, p->body.len, &p->gw->api,
                           &p->req, &p->e);
    p->req.client = p->client;
    kiln_buf_free(&p->body);
}

static void pending_free(gw_pending *p)
{
    kiln_api_request_free(&p->req);
    kiln_buf_free(&p->body);
    free(p);
}

/* A fresh seed per request without one: never a fixed default.  Kept
 * below 2^53 so JSON clients that read numbers as doubles see it exactly. */
static int random_seed(uint64_t *seed)
{
    uint64_t v;
    if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
        return -1;
    *seed = v & ((1ull << 53) - 1);
    return 0;
}

/* OpenAI's `user` names the client's end user so that abuse can be
 * traced: kiln writes it into its log beside the request id (bytes that
 * could forge a log line shown as '?'). */
static void log_user(const gw_pending *p)
{
    char user[KILN_API_USER_MAX + 1];
    size_t k = 0;
    for (const unsigned char *u = (const unsigned char *)p->req.user; *u && k < KILN_API_USER_MAX;
         u++)
        user[k++] = *u >= 0x20 && *u < 0x7f && *u != '\'' ? (char)*u : '?';
    user[k] = '\0';
    KILN_LOG_INFO("gateway: request %s: user '%s'", p->id, user);
}

static void parse_done(uv_work_t *w, int status)
{
    gw_pending *p = w->data;
    kiln_gateway *gw = p->gw;
    kiln_http_conn *c = p->conn;
    p->t_parse1 = kiln_now_ms();
    if (!c || status) { /* the client left while we parsed */
        if (c) {
            KILN_LOG_ERROR("gateway: request %s: the worker pool failed (%d)", p->id, status);
            pending_error(p, c, 500, NULL, NULL, "server_error", NULL);
        }
        pending_free(p);
        return;
    }
    if (p->st) {
        if (p->e.status >= 500)
            KILN_LOG_ERROR("gateway: request %s: parsing: %s", p->id, p->e.err.msg);
        pending_error(p, c, p->e.status, p->e.err.msg, p->e.param, p->e.code, NULL);
        pending_free(p);
        return;
    }
    if (!p->req.seed_given && random_seed(&p->req.plan.req.seed)) {
        KILN_LOG_ERROR("gateway: request %s: getrandom failed", p->id);
        pending_error(p, c, 500, NULL, NULL, "server_error", NULL);
        pending_free(p);
        return;
    }
    if (gw->draining) {
        pending_error(p, c, 503, "the server is shutting down", NULL, "shutting_down", NULL);
        pending_free(p);
        return;
    }
    kiln_err err = {0};
    double now = kiln_now_ms();
    snprintf(p->req.request_id, sizeof p->req.request_id, "%s", p->id);
    p->steps = p->req.plan.req.steps;
    kiln_http_set_steps(c, p->steps);
    if (kiln_sched_submit(gw->sched, &p->req, p, now, &p->job, &err)) {
        int st = err.code == KILN_ERR_BUSY ? 429 : err.code == KILN_ERR_UNAVAILABLE ? 503
                 : err.code == KILN_ERR_INVALID ? 400 : 500;
        const char *code = st == 429 ? "queue_full" : st == 503 ? "stage_unavailable"
                           : st == 400 ? "invalid_value" : "server_error";
        if (st == 500)
            KILN_LOG_ERROR("gateway: request %s: admission: %s", p->id, err.msg);
        pending_error(p, c, st, err.msg, NULL, code,
                      st == 429 || st == 503 ? "Retry-After: 1\r\n" : NULL);
        pending_free(p);
        return;
    }
    p->state = P_QUEUED;
    if (p->req.user)
        log_user(p);
    kiln_sched_kick(gw->sched, now);
}

static void route_images(kiln_gateway *gw, kiln_http_conn *c, kiln_http_request *req,
                         const char *route, kiln_api_kind kind)
{
    if (gw->draining) {
        reply_error(gw, c, route, 503, "the server is shutting down", NULL, "shutting_down", NULL);
        return;
    }
    if (!gw->have_traits) { /* no replica has said what the model takes yet */
        reply_error(gw, c, route, 503, "the model is still loading: no stage replica has "
                    "registered yet", NULL, "stage_unavailable", "Retry-After: 1\r\n");
        return;
    }
    gw_pending *p = calloc(1, sizeof *p);
    if (!p) {
        reply_error(gw, c, route, 500, "internal error", NULL, "server_error", NULL);
        return;
    }
    p->gw = gw;
    p->conn = c;
    p->route = route;
    snprintf(p->id, sizeof p->id, "%s", req->request_id); /* the server's X-Request-Id */
    p->kind = kind;
    p->client = req->client;
    p->state = P_PARSING;
    memcpy(p->content_type, req->content_type, sizeof p->content_type);
    p->body = req->body;
    req->body = (kiln_buf){0};
    p->work.data = p;
    p->t_parse0 = kiln_now_ms();
    p->t_first = p->t_parse0 - kiln_http_conn_age_ms(c);
    int rc = uv_queue_work(gw->loop, &p->work, parse_work, parse_done);
    if (rc) {
        KILN_LOG_ERROR("gateway: request %s: uv_queue_work: %s", p->id, uv_strerror(rc));
        pending_error(p, c, 500, NULL, NULL, "server_error", NULL);
        pending_free(p);
        return;
    }
    kiln_http_set_pending(c, p);
}

/* The playground page: static, self-contained (its script and style are
 * inline, and the policy lets it load nothing from elsewhere). */
static void route_playground(kiln_gateway *gw, kiln_http_conn *c)
{
    kiln_buf body = {0};
    if (kiln_buf_append(&body, kiln_gw_playground_html, kiln_gw_playground_html_len, NULL)) {
        reply_error(gw, c, R_PLAYGROUND, 500, "out of memory", NULL, "server_error", NULL);
        return;
    }
    reply(gw, c, R_PLAYGROUND, 200, "text/html; charset=utf-8",
          "Content-Security-Policy: default-src 'self'; img-src 'self' data:; "
          "style-src 'unsafe-inline'; script-src 'unsafe-inline'; connect-src 'self'\r\n"
          "Cache-Control: no-cache\r\n",
          &body);
}

/* GET /v1/traces/<request id>: the request's stage trace (traces.h). */
static void route_trace(kiln_gateway *gw, kiln_http_conn *c, const char *path)
{
    const char *id = path + sizeof R_TRACES; /* past "/v1/traces/" */
    kiln_buf body = {0};
    int rc = strlen(path) > sizeof R_TRACES ? kiln_traces_json(gw->traces, id, &body, NULL) : 1;
    if (rc == 1) {
        reply_error(gw, c, R_TRACES, 404, "No trace is kept for that request id (the last 1024 "
                    "requests the scheduler answered are)", NULL, "not_found", NULL);
        return;
    }
    if (rc) {
        kiln_buf_free(&body);
        reply_error(gw, c, R_TRACES, 500, "out of memory", NULL, "server_error", NULL);
        return;
    }
    reply(gw, c, R_TRACES, 200, "application/json", NULL, &body);
}

typedef enum route_id {
    RT_GENERATIONS, RT_EDITS, RT_MODELS, RT_HEALTH, RT_READY, RT_METRICS, RT_PLAYGROUND, RT_TRACES
} route_id;

static const struct {
    const char *path;
    route_id id;
    int post;
} routes[] = {
    {R_GENERATIONS, RT_GENERATIONS, 1}, {R_EDITS, RT_EDITS, 1}, {R_MODELS, RT_MODELS, 0},
    {R_HEALTH, RT_HEALTH, 0},           {R_READY, RT_READY, 0}, {R_METRICS, RT_METRICS, 0},
    {R_PLAYGROUND, RT_PLAYGROUND, 0}, {R_TRACES, RT_TRACES, 0},
};
#define N_ROUTES ((int)(sizeof routes / sizeof routes[0]))

/* The routes' index for a path, or -1. */
static int find_route(const char *path)
{
    for (int k = 0; k < N_ROUTES; k++)
        /* /v1/models/<id> is the models route too. */
        if (!strcmp(path, routes[k].path) ||
            (routes[k].id == RT_MODELS && !strncmp(path, R_MODELS "/", sizeof R_MODELS)) ||
            (routes[k].id == RT_TRACES && !strncmp(path, R_TRACES "/", sizeof R_TRACES)))
            return k;
    return -1;
}

/* The routes the admin port serves, open on the main port as well unless
 * an admin port takes /metrics away from it. */
static int is_admin_route(int k)
{
    return k >= 0 && (routes[k].id == RT_HEALTH || routes[k].id == RT_READY ||
                      routes[k].id == RT_METRICS);
}

static int needs_key(const kiln_gateway *gw, int k)
{
    if (!gw->api_keys)
        return 0;
    if (k < 0)
        return 1; /* an unknown route says nothing before the key is right */
    switch (routes[k].id) {
    case RT_HEALTH:
    case RT_READY: return 0;           /* probes: they tell only replica counts */
    case RT_PLAYGROUND: return 0;      /* a static page; its requests carry the key */
    case RT_METRICS: return gw->admin != NULL; /* open here unless the admin port has it */
    default: return 1;
    }
}

/* The API key check, before the body is read (http_server.h on_headers). */
static int on_headers(void *ud, kiln_http_conn *c, const kiln_http_request *req)
{
    kiln_gateway *gw = ud;
    int k = find_route(req->path);
    if (!needs_key(gw, k) || kiln_api_keys_check(gw->api_keys, req->authorization))
        return 0;
    reply_error(gw, c, k < 0 ? R_OTHER : routes[k].path, 401,
                req->authorization[0]
                    ? "Incorrect API key provided."
                    : "You didn't provide an API key. Provide it in an Authorization header "
                      "using Bearer auth (Authorization: Bearer YOUR_KEY).",
                NULL, "invalid_api_key", "WWW-Authenticate: Bearer realm=\"kiln\"\r\n");
    return 1;
}

static void serve(kiln_gateway *gw, kiln_http_conn *c, kiln_http_request *req, int admin)
{
    const char *path = req->path;
    if (req->method == KILN_HTTP_UNIMPLEMENTED) {
        char msg[96];
        snprintf(msg, sizeof msg, "the %s method is not implemented", req->method_name);
        reply_error(gw, c, R_OTHER, 501, msg, NULL, "not_implemented", NULL);
        return;
    }
    int k = find_route(path);
    if (k < 0 || (admin && !is_admin_route(k))) {
        reply_error(gw, c, R_OTHER, 404, "Unknown route", NULL, "not_found", NULL);
        return;
    }
    const char *route = routes[k].path;
    int ok = routes[k].post ? req->method == KILN_HTTP_POST
                            : req->method == KILN_HTTP_GET || req->method == KILN_HTTP_HEAD;
    if (!ok) {
        char msg[96];
        snprintf(msg, sizeof msg, "%s is not allowed on %s", req->method_name, route);
        reply_error(gw, c, route, 405, msg, NULL, "method_not_allowed",
                    routes[k].post ? "Allow: POST\r\n" : "Allow: GET, HEAD\r\n");
        return;
    }
    switch (routes[k].id) {
    case RT_GENERATIONS: route_images(gw, c, req, route, KILN_API_GENERATE); break;
    case RT_EDITS: route_images(gw, c, req, route, KILN_API_EDIT); break;
    case RT_MODELS: route_models(gw, c, path); break;
    case RT_HEALTH: reply_text(gw, c, R_HEALTH, 200, "application/json", "{\"status\":\"ok\"}"); break;
    case RT_READY: route_ready(gw, c); break;
    case RT_METRICS: route_metrics(gw, c); break;
    case RT_PLAYGROUND: route_playground(gw, c); break;
    case RT_TRACES: route_trace(gw, c, path); break;
    }
}

/* Bodies on routes that read none. */
#define SMALL_BODY (64u << 10)

size_t kiln_gw_body_limit(void *ud, const kiln_http_request *head)
{
    kiln_gateway *gw = ud;
    /* Without the key the request is refused (401, on_headers) before any
     * body byte is read: a route's limit says nothing to such a client. */
    if (needs_key(gw, find_route(head->path)) &&
        !kiln_api_keys_check(gw->api_keys, head->authorization))
        return SIZE_MAX;
    if (head->method != KILN_HTTP_POST)
        return SMALL_BODY;
    if (strcmp(head->path, R_EDITS) == 0)
        return kiln_api_body_limit(&gw->api, KILN_API_EDIT);
    if (strcmp(head->path, R_GENERATIONS) == 0)
        return kiln_api_body_limit(&gw->api, KILN_API_GENERATE);
    return SMALL_BODY;
}

static void on_request(void *ud, kiln_http_conn *c, kiln_http_request *req)
{
    serve(ud, c, req, 0);
}

static void on_admin_request(void *ud, kiln_http_conn *c, kiln_http_request *req)
{
    serve(ud, c, req, 1);
}

static void on_abort(void *ud, kiln_http_conn *c, void *pending)
{
    kiln_gateway *gw = ud;
    gw_pending *p = pending;
    (void)c;
    if (!p)
        return;
    if (p->state == P_PARSING) {
        p->conn = NULL; /* parse_done frees it */
        return;
    }
    kiln_metrics_request(gw->metrics, p->route, 499); /* nginx's "client closed request" */
    kiln_sched_cancel(gw->sched, p->job, kiln_now_ms());
    pending_free(p);
}

static void on_own_response(void *ud, int status)
{
    kiln_gateway *gw = ud;
    kiln_metrics_request(gw->metrics, R_OTHER, status);
}

const kiln_http_handlers kiln_gw_http_handlers = {
    .on_headers = on_headers,
    .on_request = on_request,
    .on_abort = on_abort,
    .on_own_response = on_own_response,
};

const kiln_http_handlers kiln_gw_admin_handlers = {
    .on_request = on_admin_request,
    .on_abort = on_abort,
    .on_own_response = on_own_response,
};

kiln_status kiln_gw_send(void *ud, const char *peer, const kiln_msg *m, kiln_err *err)
{
    kiln_gateway *gw = ud;
    return kiln_gw_bus_send(gw->bus, peer, m, err);
}

/* Keeps the request's trace: the gateway's own spans around the
 * scheduler's (traces.h). */
static void keep_trace(kiln_gateway *gw, const gw_pending *p, int status, const kiln_trace *sched,
                       double t_respond)
{
    kiln_trace *t = calloc(1, sizeof *t);
    if (!t)
        return; /* a trace is worth no failure */
    double end = kiln_now_ms();
    kiln_trace_span_add(t, "gateway", "request", p->t_first, end);
    kiln_trace_span_add(t, "gateway", "receive", p->t_first, p->t_parse0);
    kiln_trace_span_add(t, "gateway", "parse", p->t_parse0, p->t_parse1);
    for (int i = 0; sched && i < sched->n && t->n < KILN_TRACE_MAX_SPANS - 1; i++)
        t->span[t->n++] = sched->span[i];
    kiln_trace_span_add(t, "gateway", "respond", t_respond, end);
    kiln_traces_put(gw->traces, p->id, status, t);
    free(t);
    if (gw->trace_out) {
        /* one line per request; a failed write costs the trace, not the
         * request */
        kiln_buf line = {0};
        if (!kiln_traces_json(gw->traces, p->id, &line, NULL) &&
            !kiln_buf_append(&line, "\n", 1, NULL) &&
            (fwrite(line.data, 1, line.len, gw->trace_out) != line.len || fflush(gw->trace_out)))
            KILN_LOG_WARN("gateway: --trace-file: write failed: %s", strerror(errno));
        kiln_buf_free(&line);
    }
}

#define SSE_HEADERS "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"

static kiln_api_images_meta images_meta(const gw_pending *p, const kiln_api_request *r)
{
    return (kiln_api_images_meta){.created = p->created ? p->created : (int64_t)time(NULL),
                                  .format = r->plan.req.format, .width = r->plan.req.width,
                                  .height = r->plan.req.height, .quality = r->quality,
                                  .background = "opaque", .usage = r->usage};
}

/* A preview of a streamed request: the stream's head with the first one,
 * then its events, written at once. */
void kiln_gw_partial(void *ud, void *client, const kiln_sched_partial *pr)
{
    (void)ud;
    gw_pending *p = client;
    kiln_http_conn *c = p->conn;
    if (!c)
        return;
    kiln_api_image imgs[KILN_PROTO_MAX_ROWS];
    for (int i = 0; i < pr->n_images; i++)
        imgs[i] = (kiln_api_image){pr->images[i].data, pr->images[i].len, pr->seeds[i]};
    kiln_api_images_meta meta = images_meta(p, pr->req);
    kiln_buf body = {0};
    if (kiln_api_partial_events(&body, &meta, imgs, pr->n_images, pr->index,
                                p->kind == KILN_API_EDIT, NULL)) {
        KILN_LOG_WARN("gateway: request %s: out of memory writing preview %d", p->id, pr->index);
        return; /* the preview is lost, not the request */
    }
    if (!kiln_http_streaming(c)) {
        p->created = meta.created;
        kiln_http_stream_start(c, 200, "text/event-stream", SSE_HEADERS);
    }
    kiln_http_stream_write(c, &body);
}

/* The end of a streamed answer whose head is out: the completed events,
 * or an error event (its status can no longer be sent). */
static void finish_stream(kiln_gateway *gw, gw_pending *p, const kiln_sched_result *res,
                          const kiln_api_image *imgs)
{
    kiln_http_conn *c = p->conn;
    kiln_buf body = {0};
    kiln_status st;
    if (res->status == 200) {
        kiln_api_images_meta meta = images_meta(p, res->req);
        st = kiln_api_stream_events(&body, &meta, imgs, res->n_images, p->kind == KILN_API_EDIT,
                                    NULL);
    } else {
        st = kiln_api_stream_error(&body, res->status, res->message, res->code, NULL);
    }
    if (st) {
        KILN_LOG_ERROR("gateway: request %s: out of memory ending its stream", p->id);
        kiln_buf_clear(&body);
        if (kiln_api_stream_error(&body, 500, "internal error", "server_error", NULL))
            kiln_buf_clear(&body);
    }
    kiln_metrics_request(gw->metrics, p->route, 200);
    kiln_metrics_duration(gw->metrics, p->route, 200, kiln_http_conn_age_ms(c) / 1000.0);
    kiln_http_stream_end(c, &body);
    kiln_buf_free(&body);
}

void kiln_gw_finish(void *ud, void *client, const kiln_sched_result *res)
{
    kiln_gateway *gw = ud;
    gw_pending *p = client;
    kiln_http_conn *c = p->conn;
    /* The trace is kept before this returns: the client's next request
     * (GET /v1/traces/<id>) comes after it. */
    double t_respond = kiln_now_ms();
    if (c)
        kiln_http_set_steps(c, p->steps);
    if (c && kiln_http_streaming(c)) {
        kiln_api_image imgs[KILN_PROTO_MAX_ROWS];
        for (int i = 0; res->status == 200 && i < res->n_images; i++)
            imgs[i] = (kiln_api_image){res->images[i].data, res->images[i].len, res->seeds[i]};
        finish_stream(gw, p, res, imgs);
        keep_trace(gw, p, res->status, res->trace, t_respond);
        pending_free(p);
        return;
    }
    if (res->status != 200) {
        /* The scheduler's messages are safe to show (its 500s already say
         * "internal error" and the id). */
        reply_error(gw, c, p->route, res->status, res->message, NULL, res->code,
                    res->status == 429 || res->status == 503 ? "Retry-After: 1\r\n" : NULL);
        keep_trace(gw, p, res->status, res->trace, t_respond);
        pending_free(p);
        return;
    }
    kiln_api_image imgs[KILN_PROTO_MAX_ROWS];
    for (int i = 0; i < res->n_images; i++)
        imgs[i] = (kiln_api_image){res->images[i].data, res->images[i].len, res->seeds[i]};
    kiln_buf body = {0};
    kiln_api_images_meta meta = images_meta(p, res->req);
    int stream = res->req->stream;
    kiln_status st = stream
                         ? kiln_api_stream_events(&body, &meta, imgs, res->n_images,
                                                  p->kind == KILN_API_EDIT, NULL)
                         : kiln_api_images_json(&body, &meta, imgs, res->n_images, NULL);
    if (st) {
        kiln_buf_free(&body);
        KILN_LOG_ERROR("gateway: request %s: out of memory writing the answer", p->id);
        pending_error(p, c, 500, NULL, NULL, "server_error", NULL);
    } else {
        reply(gw, c, p->route, 200, stream ? "text/event-stream" : "application/json",
              stream ? SSE_HEADERS : NULL,
              &body);
    }
    keep_trace(gw, p, 200, res->trace, t_respond);
    pending_free(p);
}
