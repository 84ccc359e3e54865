/* Start-up, signals, the periodic tick and shutdown of kiln-gateway. */
#include "gateway.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/bus.h"
#include "common/checkpoint.h"
#include "common/log.h"

#define TICK_MS 250
/* Traces kept for GET /v1/traces/<id>: about 4 KiB each. */
#define KILN_GW_TRACES_KEPT 1024

enum { H_TICK = 1, H_SIGINT = 2, H_SIGTERM = 4 };

static void on_bus_msg(void *ud, const char *peer, kiln_msg *m)
{
    kiln_gateway *gw = ud;
    kiln_sched_on_msg(gw->sched, peer, m, kiln_now_ms());
    /* The model's traits come with the first replica's hello: the gateway
     * never opens the checkpoint (it links no model code). */
    if (!gw->have_traits && kiln_sched_traits(gw->sched, &gw->api.traits))
        gw->have_traits = 1;
}

static void on_bus_lost(void *ud, const char *peer)
{
    kiln_gateway *gw = ud;
    kiln_sched_on_unreachable(gw->sched, peer, kiln_now_ms());
}

/* Closes whatever has started; the loop then runs out. */
static void close_all(kiln_gateway *gw)
{
    if (gw->closing)
        return;
    gw->closing = 1;
    /* Connections first: aborting their requests sends cancels on the bus. */
    if (gw->http)
        kiln_http_server_stop(gw->http);
    if (gw->admin)
        kiln_http_server_stop(gw->admin);
    if (gw->bus)
        kiln_gw_bus_stop(gw->bus);
    if (gw->handles & H_TICK)
        uv_close((uv_handle_t *)&gw->tick, NULL);
    if (gw->handles & H_SIGINT)
        uv_close((uv_handle_t *)&gw->sigint, NULL);
    if (gw->handles & H_SIGTERM)
        uv_close((uv_handle_t *)&gw->sigterm, NULL);
}

static void shutdown_now(kiln_gateway *gw)
{
    KILN_LOG_INFO("gateway: shutting down");
    close_all(gw);
}

/* One line when the service becomes ready (every stage has a live
 * replica: /readyz answers 200) and one when it stops being ready, so that
 * an operator (and `kiln serve`'s user) sees when requests can be sent:
 * the gateway listens at once, but its stages load for seconds to minutes. */
static void log_readiness(kiln_gateway *gw)
{
    int ready = !gw->draining && kiln_sched_ready(gw->sched);
    if (ready == gw->ready)
        return;
    gw->ready = ready;
    kiln_metrics_gauges g;
    kiln_sched_gauges(gw->sched, &g);
    if (ready)
        KILN_LOG_INFO("gateway: ready: http://%s:%d serves model '%s' (%d encoder, %d denoiser, "
                      "%d decoder replicas)", gw->opt.host, kiln_http_server_port(gw->http),
                      gw->served_name, g.replicas[0], g.replicas[1], g.replicas[2]);
    else if (!gw->draining)
        KILN_LOG_WARN("gateway: not ready: a stage has no live replica (%d encoder, %d denoiser, "
                      "%d decoder replicas)", g.replicas[0], g.replicas[1], g.replicas[2]);
}

static void on_tick(uv_timer_t *t)
{
    kiln_gateway *gw = t->data;
    /* Liveness is judged on what the replicas said, so everything that
     * arrived is read first (after a stall of the gateway the timer may
     * fire before the async handle that delivers their messages). */
    kiln_gw_bus_drain(gw->bus);
    double now = kiln_now_ms();
    kiln_sched_tick(gw->sched, now);
    log_readiness(gw);
    if (gw->draining) {
        kiln_metrics_gauges g;
        kiln_sched_gauges(gw->sched, &g);
        if (g.jobs == 0 || now >= gw->drain_deadline)
            shutdown_now(gw);
    }
}

static void on_signal(uv_signal_t *h, int sig)
{
    kiln_gateway *gw = h->data;
    if (gw->draining) { /* a second signal: stop waiting */
        shutdown_now(gw);
        return;
    }
    gw->draining = 1;
    gw->drain_deadline = kiln_now_ms() + gw->opt.drain_s * 1000.0;
    KILN_LOG_INFO("gateway: signal %d: finishing accepted requests (up to %.0f s)", sig,
                  gw->opt.drain_s);
}

static int check_options(const kiln_gw_options *o)
{
    if (o->min_size % 16 || o->max_size % 16 || o->min_size < 64 || o->max_size > 4096 ||
        o->min_size > o->max_size) {
        KILN_LOG_ERROR("gateway: --min-size/--max-size must be multiples of 16 with "
                       "64 <= min <= max <= 4096");
        return -1;
    }
    if (o->served_model_name) {
        size_t n = strlen(o->served_model_name);
        int ok = n > 0 && n < KILN_PROTO_MODEL_ID_MAX;
        for (size_t i = 0; ok && i < n; i++)
            ok = !!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/@-",
                          o->served_model_name[i]);
        if (!ok) {
            KILN_LOG_ERROR("gateway: --served-model-name takes 1..%d of A-Z a-z 0-9 . _ : / @ -",
                           KILN_PROTO_MODEL_ID_MAX - 1);
            return -1;
        }
    }
    /* Else a body the route allows could never be admitted. */
    if (o->client_body_budget_bytes < o->max_body_bytes ||
        o->body_budget_bytes < o->client_body_budget_bytes) {
        KILN_LOG_ERROR("gateway: need --max-body-mb <= --client-body-budget-mb <= "
                       "--body-budget-mb");
        return -1;
    }
    return 0;
}

/* The largest frame a replica may legally send the gateway (its bus
 * refuses larger ones, ZMQ_MAXMSGSIZE): the biggest of a decoder's done
 * (every image of a request at TurboJPEG's worst case, 6 bytes a pixel,
 * which PNG and WebP stay below), a denoiser's with inline f32 latents,
 * and an encoder's with inline f32 embeddings (a prompt and a negative of
 * 512 tokens) and references (1 MP each at most: 4096 tokens, plus their
 * int32 ids); plus 1 MiB of fields.  The bus starts before any replica
 * said which model it serves, so the widths are the widest supported
 * model's (common/traits.h). */
static size_t max_frame_in(const kiln_limits *lim)
{
    const size_t text = KILN_TRAITS_WIDEST_TEXT, channels = KILN_TRAITS_WIDEST_LATENT;
    size_t px = (size_t)lim->max_side * (size_t)lim->max_side, rows = (size_t)lim->max_n;
    size_t decode = rows * (px * 6 + (64u << 10));
    size_t latents = rows * (px / 256) * channels * 4;
    size_t encode = 2 * 512 * text * 4 + (size_t)lim->max_refs * 4096 * (channels * 4 + 16);
    size_t m = decode > latents ? decode : latents;
    m = (m > encode ? m : encode) + (1u << 20);
    return m < KILN_PROTO_MAX_FRAME ? m : KILN_PROTO_MAX_FRAME;
}

static void add_limit(kiln_gateway *gw, const char *name, double value)
{
    if (gw->n_limits < (int)(sizeof gw->limits / sizeof gw->limits[0]))
        gw->limits[gw->n_limits++] = (kiln_metrics_limit){name, value};
}

/* Every limit the gateway enforces, as /metrics reports them. */
static void list_limits(kiln_gateway *gw)
{
    const kiln_gw_options *o = &gw->opt;
    add_limit(gw, "max_connections", o->max_connections);
    add_limit(gw, "max_client_connections", o->max_client_connections);
    add_limit(gw, "max_header_bytes", (double)o->max_header_bytes);
    add_limit(gw, "max_body_bytes", (double)o->max_body_bytes);
    add_limit(gw, "generation_body_bytes",
              (double)kiln_api_body_limit(&gw->api, KILN_API_GENERATE));
    add_limit(gw, "json_max_values", KILN_API_JSON_MAX_NODES);
    add_limit(gw, "json_max_depth", KILN_API_JSON_MAX_DEPTH);
    add_limit(gw, "body_budget_bytes", (double)o->body_budget_bytes);
    add_limit(gw, "client_body_budget_bytes", (double)o->client_body_budget_bytes);
    add_limit(gw, "body_wait_seconds", o->body_wait_ms / 1000.0);
    add_limit(gw, "bus_max_frame_bytes", (double)gw->max_frame);
    add_limit(gw, "max_request_cost_mtok", o->max_cost);
    add_limit(gw, "max_reference_pixels", (double)o->max_ref_pixels);
    add_limit(gw, "queue_max", o->queue_max);
    add_limit(gw, "client_queue_share", o->client_queue_share);
    add_limit(gw, "request_timeout_seconds", o->request_timeout_s);
    add_limit(gw, "cancel_timeout_seconds", o->cancel_timeout_s);
    add_limit(gw, "header_timeout_seconds", o->header_timeout_ms / 1000.0);
    add_limit(gw, "read_timeout_seconds", o->read_timeout_ms / 1000.0);
    add_limit(gw, "idle_timeout_seconds", o->idle_timeout_ms / 1000.0);
    add_limit(gw, "write_timeout_seconds", o->write_timeout_ms / 1000.0);
}

/* The bus keys, and the refusal of an open bus other hosts can reach. */
static kiln_status load_bus_keys(const kiln_gw_options *o, const char *bus, kiln_bus_keys *keys,
                                 kiln_err *err)
{
    if (!o->bus_key != !o->bus_allow)
        return kiln_err_set(err, KILN_ERR_INVALID, "--bus-key and --bus-allow go together (the "
                            "gateway's secret key and the replicas' public keys)");
    if (o->bus_key) {
        if (kiln_bus_keys_load_secret(keys, o->bus_key, err) ||
            kiln_bus_keys_load_allow(keys, o->bus_allow, err))
            return err->code;
        KILN_LOG_INFO("gateway: bus secured with CURVE: %d replica key(s) allowed, server key %s",
                      keys->n_allow, keys->public_key);
        return KILN_OK;
    }
    if (!kiln_bus_endpoint_local(bus) && !o->bus_insecure)
        return kiln_err_set(err, KILN_ERR_INVALID, "the bus %s can be reached from other machines "
                            "and has no keys, so anyone reaching it could register as a replica: "
                            "give --bus-key and --bus-allow (docs/OPERATIONS.md), or "
                            "--bus-insecure to accept that", bus);
    KILN_LOG_WARN("gateway: the bus %s is not authenticated: any process that reaches it can "
                  "register as a replica (--bus-key, --bus-allow)", bus);
    return KILN_OK;
}

/* Images by reference (docs/ARCHITECTURE.md): the gateway's transport
 * domain and a shm transport to read the decoders' image files with,
 * unless KILN_IMAGE_REFS=0 wants every image inline.  Where they cannot be
 * made the images come inline: the service goes on.  KILN_ERR_INVALID for
 * another value of KILN_IMAGE_REFS, or a bad KILN_DOMAIN_HOST. */
static kiln_status setup_image_refs(kiln_gateway *gw, kiln_err *err)
{
    const char *env = getenv("KILN_IMAGE_REFS");
    if (env && strcmp(env, "0") && strcmp(env, "1"))
        return kiln_err_set(err, KILN_ERR_INVALID, "KILN_IMAGE_REFS must be 0 (every image "
                            "inline) or 1 (the default), not '%.32s'", env);
    if (env && !strcmp(env, "0")) {
        KILN_LOG_INFO("gateway: KILN_IMAGE_REFS=0: the decoders send every image inline");
        return KILN_OK;
    }
    kiln_err why = {0};
    if (kiln_domain_probe(&gw->domain, &why)) {
        if (why.code == KILN_ERR_INVALID)
            return kiln_err_set(err, why.code, "%s", why.msg);
        KILN_LOG_WARN("gateway: the decoders send every image inline: %s", why.msg);
        return KILN_OK;
    }
    /* A reader only: it never allocates, so it makes no slab, and its
     * owner name and epoch appear nowhere. */
    gw->images = kiln_transport_shm_create("gateway", gw->request_base | 1, "gateway", 0, 0, &why);
    if (!gw->images)
        KILN_LOG_WARN("gateway: the decoders send every image inline: %s", why.msg);
    else
        KILN_LOG_INFO("gateway: decoders on host %s with /dev/shm %s hand their images by "
                      "reference", gw->domain.host, gw->domain.shm[0] ? gw->domain.shm : "none");
    return KILN_OK;
}

static kiln_http_server *start_http(kiln_gateway *gw, const char *host, int port,
                                    const kiln_http_handlers *h, kiln_err *err)
{
    const kiln_gw_options *o = &gw->opt;
    kiln_http_server_opts ho = {
        .host = host, .port = port,
        .limits = {.max_header_bytes = o->max_header_bytes, .max_body_bytes = o->max_body_bytes,
                   .body_limit = kiln_gw_body_limit, .ud = gw},
        .max_connections = o->max_connections, .header_timeout_ms = o->header_timeout_ms,
        .request_timeout_ms = o->read_timeout_ms, .idle_timeout_ms = o->idle_timeout_ms,
        .write_timeout_ms = o->write_timeout_ms, .clients = gw->clients,
        .body_wait_ms = o->body_wait_ms,
        .request_base = gw->request_base, .request_seq = &gw->n_requests,
    };
    return kiln_http_server_start(gw->loop, &ho, h, gw, err);
}

static int start(kiln_gateway *gw, kiln_err *err)
{
    const kiln_gw_options *o = &gw->opt;
    /* The folder's name only: the model's traits come from the replicas. */
    kiln_proto_model_id(o->model_dir, gw->model_id, sizeof gw->model_id);
    if (o->served_model_name)
        snprintf(gw->served_name, sizeof gw->served_name, "%s", o->served_model_name);
    else
        kiln_checkpoint_model_name(o->model_dir, gw->served_name, sizeof gw->served_name);
    gw->api.model_id = gw->served_name;
    gw->api.limits = KILN_LIMITS_SERVICE;
    gw->api.limits.min_side = o->min_size;
    gw->api.limits.max_side = o->max_size;
    gw->api.image_limits = KILN_IMAGE_LIMITS_DEFAULT;
    gw->api.max_body_bytes = o->max_body_bytes;
    gw->api.max_cost = o->max_cost;
    gw->api.ignore_unknown = o->ignore_unknown_fields;
    gw->api.max_ref_pixels = o->max_ref_pixels;
    gw->max_frame = max_frame_in(&gw->api.limits);
    list_limits(gw);
    gw->started = (int64_t)time(NULL);
    if (getrandom(&gw->request_base, sizeof gw->request_base, 0) != (ssize_t)sizeof gw->request_base)
        gw->request_base = (uint64_t)gw->started << 20; /* still unique enough for logs */

    if (!(gw->metrics = kiln_metrics_create(err)) ||
        !(gw->traces = kiln_traces_create(KILN_GW_TRACES_KEPT, err)))
        return -1;
    if (o->trace_file && !(gw->trace_out = fopen(o->trace_file, "a"))) {
        kiln_err_set(err, KILN_ERR_INVALID, "--trace-file %s: %s", o->trace_file, strerror(errno));
        return -1;
    }
    if (setup_image_refs(gw, err))
        return -1;
    kiln_sched_opts so = {.model_id = gw->model_id, .queue_max = o->queue_max,
                          .client_share = o->client_queue_share,
                          .cancel_timeout_ms = o->cancel_timeout_s * 1000.0,
                          .heartbeat_timeout_ms = o->heartbeat_timeout_ms,
                          .progress_timeout_ms = o->progress_timeout_s * 1000.0,
                          .job_timeout_ms = o->request_timeout_s * 1000.0,
                          .images = gw->images, .domain = gw->images ? &gw->domain : NULL};
    kiln_sched_ops ops = {.send = kiln_gw_send, .finish = kiln_gw_finish,
                          .partial = kiln_gw_partial};
    if (!(gw->sched = kiln_sched_create(&so, &ops, gw, gw->metrics, err)))
        return -1;
    char bus[128];
    if (o->bus)
        snprintf(bus, sizeof bus, "%s", o->bus);
    else
        snprintf(bus, sizeof bus, "tcp://127.0.0.1:%d", o->port + 1);
    if (o->api_key_file && !(gw->api_keys = kiln_api_keys_load(o->api_key_file, err)))
        return -1;
    kiln_bus_keys keys = {0};
    if (load_bus_keys(o, bus, &keys, err)) {
        kiln_bus_keys_free(&keys);
        return -1;
    }
    gw->bus = kiln_gw_bus_start(gw->loop, bus, gw->max_frame, &keys, on_bus_msg, on_bus_lost, gw,
                                err);
    kiln_bus_keys_free(&keys);
    if (!gw->bus)
        return -1;
    kiln_gw_clients_limits cl = {.max_connections = o->max_client_connections,
                                 .body_budget = o->body_budget_bytes,
                                 .client_body_budget = o->client_body_budget_bytes};
    if (!(gw->clients = kiln_gw_clients_create(&cl, err)))
        return -1;
    if (!(gw->http = start_http(gw, o->host, o->port, &kiln_gw_http_handlers, err)))
        return -1;
    if (o->admin_port >= 0 &&
        !(gw->admin = start_http(gw, o->admin_host ? o->admin_host : o->host, o->admin_port,
                                 &kiln_gw_admin_handlers, err)))
        return -1;
    int rc;
    if ((rc = uv_timer_init(gw->loop, &gw->tick)) == 0) {
        gw->handles |= H_TICK;
        rc = uv_timer_start(&gw->tick, on_tick, TICK_MS, TICK_MS);
    }
    if (!rc && (rc = uv_signal_init(gw->loop, &gw->sigint)) == 0) {
        gw->handles |= H_SIGINT;
        rc = uv_signal_start(&gw->sigint, on_signal, SIGINT);
    }
    if (!rc && (rc = uv_signal_init(gw->loop, &gw->sigterm)) == 0) {
        gw->handles |= H_SIGTERM;
        rc = uv_signal_start(&gw->sigterm, on_signal, SIGTERM);
    }
    if (rc) {
        kiln_err_set(err, KILN_ERR_IO, "libuv: %s", uv_strerror(rc));
        return -1;
    }
    gw->tick.data = gw->sigint.data = gw->sigterm.data = gw;
    KILN_LOG_INFO("gateway: listening on http://%s:%d for model '%s', bus %s; ready once "
                  "every stage has a replica", o->host, kiln_http_server_port(gw->http),
                  gw->served_name, bus);
    if (gw->admin)
        KILN_LOG_INFO("gateway: health, readiness and metrics on admin http://%s:%d",
                      o->admin_host ? o->admin_host : o->host, kiln_http_server_port(gw->admin));
    KILN_LOG_INFO("gateway: the HTTP API %s", gw->api_keys ? "needs an API key (Bearer)"
                                                           : "is open (no --api-key-file)");
    return 0;
}

int kiln_gateway_run(const kiln_gw_options *o)
{
    if (check_options(o))
        return 2;
    kiln_gateway *gw = calloc(1, sizeof *gw);
    uv_loop_t *loop = malloc(sizeof *loop);
    if (!gw || !loop || uv_loop_init(loop)) {
        KILN_LOG_ERROR("gateway: cannot create the event loop");
        free(gw);
        free(loop);
        return 1;
    }
    gw->loop = loop;
    gw->opt = *o;
    kiln_err err = {0};
    int status = 0;
    if (start(gw, &err)) {
        KILN_LOG_ERROR("gateway: %s", err.msg);
        /* A bad key or option stays bad: EX_CONFIG tells a
         * supervisor not to restart us in a loop (as the workers do). */
        status = err.code == KILN_ERR_INVALID || err.code == KILN_ERR_NOT_FOUND ||
                         err.code == KILN_ERR_FORMAT || err.code == KILN_ERR_UNSUPPORTED
                     ? 78
                     : 1;
        close_all(gw);
    }
    uv_run(loop, UV_RUN_DEFAULT);
    kiln_sched_destroy(gw->sched);
    kiln_transport_destroy(gw->images);
    kiln_metrics_destroy(gw->metrics);
    kiln_traces_destroy(gw->traces);
    if (gw->trace_out)
        fclose(gw->trace_out);
    kiln_gw_clients_destroy(gw->clients);
    kiln_api_keys_free(gw->api_keys);
    if (uv_loop_close(loop))
        KILN_LOG_WARN("gateway: event loop closed with handles still open");
    free(loop);
    free(gw);
    return status;
}
