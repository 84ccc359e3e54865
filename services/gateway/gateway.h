/* kiln-gateway: the pieces of the gateway process and how they meet.
 *
 *   kiln_gw_options o = KILN_GW_DEFAULTS;
 *   o.model_dir = "/models/klein-4b"; o.port = 8000;
 *   return kiln_gateway_run(&o);     // serves until SIGINT / SIGTERM
 *
 * One libuv loop thread runs the HTTP server (http_server.c), the routes
 * (routes.c), the scheduler (scheduler*.c) and the metrics; request bodies are
 * parsed and validated on libuv's worker pool (api_request.c); the bus
 * thread (gw_bus.c) owns the ZeroMQ socket.  On SIGINT/SIGTERM the gateway
 * stops admitting work (503, /readyz fails), lets accepted requests finish
 * for up to drain_s, then closes everything.
 */
#ifndef KILN_GW_GATEWAY_H
#define KILN_GW_GATEWAY_H

#include <stdint.h>
#include <stdio.h>
#include <uv.h>

#include "api_keys.h"
#include "api_request.h"
#include "gw_bus.h"
#include "http_server.h"
#include "metrics.h"
#include "scheduler.h"
#include "traces.h"

typedef struct kiln_gw_options {
    const char *host;
    int port;
    const char *bus;       /* NULL: tcp://127.0.0.1:<port + 1> */
    /* Bus security (common/bus_keys.h): the gateway's secret key file and
     * the allow-list of the replicas' public keys, both or neither.
     * Without them a bus reachable from other hosts is refused unless
     * bus_insecure says the operator accepts a bus anyone can join. */
    const char *bus_key, *bus_allow;
    int bus_insecure;
    const char *api_key_file; /* NULL: the HTTP API is open (api_keys.h) */
    /* -1: no admin port; else /healthz, /readyz and /metrics are served
     * there, open, and /metrics on the main port needs the API key. */
    int admin_port;
    const char *admin_host; /* NULL: host */
    const char *model_dir; /* the checkpoint the replicas serve */
    /* The model id clients see (GET /v1/models, a request's `model`); NULL:
     * kiln_checkpoint_model_name of model_dir ("org/name" for a Hugging
     * Face cache folder). */
    const char *served_model_name;
    /* Appends every kept trace (traces.h), one Chrome trace-event JSON
     * object per line; NULL: none. */
    const char *trace_file;
    int min_size, max_size;
    size_t max_body_bytes, max_header_bytes;
    int max_connections;
    int queue_max;
    int header_timeout_ms, read_timeout_ms, idle_timeout_ms, write_timeout_ms;
    double request_timeout_s;
    double heartbeat_timeout_ms;
    double progress_timeout_s;
    double drain_s;
    int max_client_connections; /* per address, 0: no limit */
    size_t body_budget_bytes, client_body_budget_bytes;
    int body_wait_ms;
    double max_cost; /* Mtok per request (kiln_request_cost), 0: no ceiling */
    int64_t max_ref_pixels; /* kiln_api_config.max_ref_pixels */
    double client_queue_share; /* kiln_sched_opts.client_share */
    double cancel_timeout_s;   /* kiln_sched_opts.cancel_timeout_ms / 1000 */
    int ignore_unknown_fields; /* kiln_api_config.ignore_unknown */
} kiln_gw_options;

#define KILN_GW_DEFAULTS                                                                        \
    ((kiln_gw_options){.host = "0.0.0.0", .port = 8000, .admin_port = -1, .min_size = 256,     \
                       .max_size = 2048,                                                       \
                       .max_body_bytes = 64u << 20, .max_header_bytes = 16u << 10,              \
                       .max_connections = 1024, .queue_max = 128, .header_timeout_ms = 10000,   \
                       .read_timeout_ms = 60000, .idle_timeout_ms = 60000,                     \
                       .write_timeout_ms = 60000, .request_timeout_s = 300,                    \
                       .heartbeat_timeout_ms = 2000, .progress_timeout_s = 60,                \
                       .drain_s = 30, .max_client_connections = 64,                            \
                       .body_budget_bytes = 1024u << 20,                                       \
                       .client_body_budget_bytes = 256u << 20, .body_wait_ms = 5000,           \
                       .max_cost = 40, .max_ref_pixels = 128ll << 20,                        \
                       .client_queue_share = 0.25, .cancel_timeout_s = 30})

typedef struct kiln_gateway {
    uv_loop_t *loop;
    kiln_gw_options opt;
    char model_id[KILN_PROTO_MODEL_ID_MAX]; /* kiln_proto_model_id, as the replicas say it */
    char served_name[KILN_PROTO_MODEL_ID_MAX]; /* what clients call it (served_model_name) */
    /* api.traits are the replicas' (kiln_sched_traits), copied on the loop
     * thread once the first one registered (have_traits); requests are
     * parsed only after that, so the parse threads read them unchanging. */
    kiln_api_config api;
    int have_traits;
    int64_t started; /* unix seconds, for /v1/models */
    kiln_http_server *http;
    kiln_gw_clients *clients;
    size_t max_frame; /* the largest bus frame a replica may send */
    kiln_metrics_limit limits[24]; /* for /metrics */
    int n_limits;
    kiln_http_server *admin; /* NULL without --admin-port */
    kiln_api_keys *api_keys; /* NULL: the API is open */
    kiln_gw_bus *bus;
    /* Images by reference (scheduler_images.c): the gateway's transport
     * domain and the shm transport it reads the decoders' files with;
     * NULL with KILN_IMAGE_REFS=0 or where it could not be made. */
    kiln_domain domain;
    kiln_transport *images;
    kiln_sched *sched;
    kiln_metrics *metrics;
    kiln_traces *traces; /* the last requests' stage traces (GET /v1/traces/<id>) */
    FILE *trace_out;     /* --trace-file, or NULL */
    uv_timer_t tick;
    uv_signal_t sigint, sigterm;
    unsigned handles; /* which of tick, sigint, sigterm are initialised */
    int draining, closing;
    int ready; /* every stage had a live replica at the last tick (the ready line) */
    double drain_deadline;
    /* Request ids the HTTP servers make (http_server.h): "req_" + 16 hex
     * digits of request_base + n, unique across this gateway's restarts
     * with a random base. */
    uint64_t request_base, n_requests;
} kiln_gateway;

/* Runs the gateway; returns the process exit status (0 after a clean
 * shutdown, 78 (EX_CONFIG) when its checkpoint, keys or options are
 * unusable, 1 when it cannot start otherwise). */
int kiln_gateway_run(const kiln_gw_options *o);

/* routes.c: the HTTP side (the API port, and the admin port's health,
 * readiness and metrics). */
extern const kiln_http_handlers kiln_gw_http_handlers;
/* routes.c: kiln_http_limits.body_limit (ud is the kiln_gateway). */
size_t kiln_gw_body_limit(void *ud, const kiln_http_request *head);
extern const kiln_http_handlers kiln_gw_admin_handlers;
/* routes.c: the scheduler's ops (ud is the kiln_gateway). */
kiln_status kiln_gw_send(void *ud, const char *peer, const kiln_msg *m, kiln_err *err);
void kiln_gw_finish(void *ud, void *client, const kiln_sched_result *res);
void kiln_gw_partial(void *ud, void *client, const kiln_sched_partial *p);

#endif
