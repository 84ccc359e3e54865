/* kiln-bench: a small blocking HTTP/1.1 client (plain TCP, keep-alive) for
 * load-testing the gateway.  One client is one connection: each load thread
 * owns its own.
 *
 *   kiln_http_client *c = kiln_http_client_create("http://127.0.0.1:8000", 600, &err);
 *   int status; kiln_buf body = {0};
 *   if (kiln_http_request(c, "POST", "/v1/images/generations", "application/json",
 *                         json, strlen(json), &status, &body, &err)) ...
 *   kiln_buf_free(&body); kiln_http_client_destroy(c);
 *
 * Responses are parsed with http-parser (Content-Length, chunked, or up to
 * the close).  kiln-soak also uses it to leave requests mid-way
 * (kiln_http_send_and_drop).  Not thread-safe: one thread per client.
 */
#ifndef KILN_BENCH_HTTP_H
#define KILN_BENCH_HTTP_H

#include <stddef.h>

#include "common/buf.h"
#include "common/error.h"

/* Splits "http://host[:port][/]" (port 80 by default; IPv6 as [addr]).
 * KILN_ERR_INVALID for anything else (https, paths, bad ports). */
kiln_status kiln_http_parse_url(const char *url, char *host, size_t host_len, int *port,
                                kiln_err *err);

typedef struct kiln_http_client kiln_http_client;

/* Connects lazily, on the first request.  timeout_s bounds each connect,
 * send and receive wait.  NULL with err: KILN_ERR_INVALID (bad URL),
 * KILN_ERR_NOMEM. */
kiln_http_client *kiln_http_client_create(const char *url, double timeout_s, kiln_err *err);
/* Closes the connection; accepts NULL. */
void kiln_http_client_destroy(kiln_http_client *c);

/* Sends one request and reads the whole response: *status gets the HTTP
 * status and `resp` the body (cleared first).  ctype and body may be NULL.
 * When a kept-alive connection turns out closed before any byte of the
 * response arrived, it reconnects and sends once more.  Errors: KILN_ERR_IO
 * (connect, send, receive, timeout), KILN_ERR_FORMAT (not HTTP),
 * KILN_ERR_TOO_LARGE (a body over 512 MiB), KILN_ERR_NOMEM; the connection
 * is closed after any error. */
kiln_status kiln_http_request(kiln_http_client *c, const char *method, const char *path,
                              const char *ctype, const void *body, size_t len, int *status,
                              kiln_buf *resp, kiln_err *err);

/* Sends one request on a new connection, waits up to after_s seconds (or
 * until response bytes arrive) and closes the connection without reading,
 * as a client that gives up mid-request; with `reset` the close is an RST
 * (SO_LINGER 0) instead of a FIN.  *answered: bytes of a response had
 * arrived by then.  Errors as kiln_http_request (connect, send); the
 * client stays usable (its next request connects again). */
kiln_status kiln_http_send_and_drop(kiln_http_client *c, const char *method, const char *path,
                                    const char *ctype, const void *body, size_t len,
                                    double after_s, int reset, int *answered, kiln_err *err);

#endif
