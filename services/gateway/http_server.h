/* kiln HTTP/1.1 server on libuv: connections, keep-alive, pipelining,
 * limits and timeouts.  What to answer is the handler's business.
 *
 *   kiln_http_handlers h = {.on_request = route, .on_abort = forget, .on_own_response = count};
 *   kiln_http_server *s = kiln_http_server_start(loop, &opts, &h, ud, &err);
 *   // in route(ud, conn, req): answer now ...
 *   kiln_http_respond(conn, 200, "application/json", NULL, &body);
 *   // ... or later: kiln_http_set_pending(conn, state) and respond when ready;
 *   // if the client goes first, on_abort(ud, conn, state) runs instead and
 *   // conn must not be used again.
 *   kiln_http_server_stop(s);
 *
 * Every response carries an X-Request-Id header: the client's own when its
 * request gave a usable one (http_reader.h), else one the server makes;
 * the handler finds it in req->request_id.
 *
 * Each connection owns its TCP handle, timer, request reader and buffers;
 * its memory is freed in the handles' close callbacks.  One request per
 * connection is handled at a time: bytes of pipelined requests are
 * buffered (reading pauses past 1 MiB) and parsed once the previous
 * response has been written, so responses keep request order.  Reading
 * continues while a request is being handled, so a client that disconnects
 * (EOF or error, including a half-close) is noticed at once and its
 * request aborted.
 *
 * Limits: header and body sizes (kiln_http_limits: 431/414, 413 with an
 * OpenAI error body); a request's headers must arrive within
 * header_timeout_ms of its first byte and the whole request within
 * request_timeout_ms (else 408 and close: slowloris); an idle keep-alive
 * connection closes after idle_timeout_ms; a response not drained by the
 * client within write_timeout_ms closes the connection; past
 * max_connections a new connection gets 503 and is closed, and so does one
 * past its address's share (clients.h).  A request's body is charged to
 * the body budget (clients.h) once its head is in and before more of it is
 * read: when it does not fit, reading pauses (TCP pushes back on the
 * client) until it does, or body_wait_ms pass (503 and close); the charge
 * is given back when the response has been written or the connection
 * closes.  After an error response, such a 503 (up to 64 refused
 * connections at a time) or `Connection: close` the server shuts its side
 * down and reads what the client still sends for up to 2 s before
 * closing, so the client sees the response rather than a reset.
 *
 * Not thread-safe: everything runs on the loop's thread.
 */
#ifndef KILN_GW_HTTP_SERVER_H
#define KILN_GW_HTTP_SERVER_H

#include <uv.h>

#include "clients.h"
#include "common/buf.h"
#include "common/error.h"
#include "http_reader.h"

typedef struct kiln_http_server_opts {
    const char *host; /* IPv4 or IPv6 literal */
    int port;         /* 0: any free port (see kiln_http_server_port) */
    kiln_http_limits limits;
    int max_connections;
    int header_timeout_ms;
    int request_timeout_ms;
    int idle_timeout_ms;
    int write_timeout_ms;
    kiln_gw_clients *clients; /* connections per address and the body budget; NULL: none */
    int body_wait_ms;         /* how long a body may wait for budget */
    /* Request ids the server makes: "req_" + 16 hex digits of
     * request_base + ++*request_seq (a counter servers on one loop may
     * share, so their ids never collide; NULL: the server's own). */
    uint64_t request_base;
    uint64_t *request_seq;
} kiln_http_server_opts;

typedef struct kiln_http_server kiln_http_server;
typedef struct kiln_http_conn kiln_http_conn;

typedef struct kiln_http_handlers {
    /* Optional: a request's headers are in, its body may still be on its
     * way.  Return 0 to go on (on_request follows once it is complete),
     * or answer now with kiln_http_respond and return 1 to refuse it
     * unread (an unauthenticated upload costs no memory): the connection
     * closes after that response. */
    int (*on_headers)(void *ud, kiln_http_conn *c, const kiln_http_request *req);
    /* A complete request: answer with kiln_http_respond, now or later.
     * The handler may move req->body out. */
    void (*on_request)(void *ud, kiln_http_conn *c, kiln_http_request *req);
    /* The connection closes before the pending request was answered. */
    void (*on_abort)(void *ud, kiln_http_conn *c, void *pending);
    /* A response the server made itself (400/408/413/414/431/503), for
     * metrics. */
    void (*on_own_response)(void *ud, int status);
} kiln_http_handlers;

/* Binds, listens and starts accepting.  NULL with err set (KILN_ERR_IO
 * naming the address when it cannot bind). */
kiln_http_server *kiln_http_server_start(uv_loop_t *loop, const kiln_http_server_opts *opts,
                                         const kiln_http_handlers *h, void *ud, kiln_err *err);

/* The bound port. */
int kiln_http_server_port(const kiln_http_server *s);

typedef struct kiln_http_server_stats {
    int connections;  /* open now (refused ones still lingering excluded) */
    uint64_t refused; /* connections refused past max_connections, ever */
} kiln_http_server_stats;

void kiln_http_server_stats_get(const kiln_http_server *s, kiln_http_server_stats *st);

/* Stops accepting and closes every connection (pending requests are
 * aborted through on_abort).  The memory goes once the handles have
 * closed, so the loop must run on. */
void kiln_http_server_stop(kiln_http_server *s);

/* Remembers the handler's state for the request being handled (given back
 * by on_abort). */
void kiln_http_set_pending(kiln_http_conn *c, void *pending);

/* The denoising steps of the request being handled, for its access log
 * line ("N steps"; without a call, or with 0, it reads "- steps").  Call
 * before kiln_http_respond. */
void kiln_http_set_steps(kiln_http_conn *c, int steps);

/* Milliseconds since the first byte of the request being handled. */
double kiln_http_conn_age_ms(const kiln_http_conn *c);

/* Answers the request being handled.  Takes body's memory (it may be
 * empty); extra_headers is NULL or complete "Name: value\r\n" lines.
 * The connection stays open when the client allows it. */
void kiln_http_respond(kiln_http_conn *c, int status, const char *content_type,
                       const char *extra_headers, kiln_buf *body);

/* A streamed answer (server-sent events) to the request being handled:
 * kiln_http_stream_start writes the head at once (Transfer-Encoding:
 * chunked, no Content-Length; for an HTTP/1.0 client the body as it is,
 * ended by closing the connection), each kiln_http_stream_write sends one
 * chunk at once (taking body's memory), and kiln_http_stream_end sends
 * its body as the last chunk and the terminating one, after which the
 * connection goes on as after kiln_http_respond.  Until the end the
 * request stays pending: a client that goes away still aborts it
 * (on_abort), and so does one that leaves more than
 * KILN_HTTP_STREAM_BACKLOG bytes unread (the connection closes). */
#define KILN_HTTP_STREAM_BACKLOG (256u << 20)
void kiln_http_stream_start(kiln_http_conn *c, int status, const char *content_type,
                            const char *extra_headers);
void kiln_http_stream_write(kiln_http_conn *c, kiln_buf *body);
void kiln_http_stream_end(kiln_http_conn *c, kiln_buf *body);
/* 1 once kiln_http_stream_start ran for the request being handled. */
int kiln_http_streaming(const kiln_http_conn *c);

#endif
