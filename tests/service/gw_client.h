/* A small blocking HTTP/1.1 client over plain sockets and poll, for the
 * gateway's end-to-end test: requests, pipelined or not, and incremental
 * response parsing (Content-Length, or chunked for streamed answers).
 *
 *   gwc_response r = {0};
 *   if (gwc_request(port, "POST", "/v1/images/generations", "application/json",
 *                   json, strlen(json), &r, 30000) == 0) ... r.status, r.body ...
 *   gwc_response_free(&r);
 *
 * Not thread-safe across shared buffers; each connection has its own. */
#ifndef KILN_TEST_GW_CLIENT_H
#define KILN_TEST_GW_CLIENT_H

#include <stddef.h>

#include "common/buf.h"

typedef struct gwc_response {
    int status;
    char headers[4096]; /* the raw header block */
    kiln_buf body;
} gwc_response;

void gwc_response_free(gwc_response *r);

/* A connected TCP socket to 127.0.0.1:port, or -1. */
int gwc_connect(int port);
/* The same from a given local address (e.g. "127.0.0.2": another client
 * as far as the gateway can tell), or -1. */
int gwc_connect_from(int port, const char *local);

/* Writes all of data within timeout_ms; 0 or -1. */
int gwc_send(int fd, const void *data, size_t len, int timeout_ms);

/* Appends a request (headers + body) to `out`. */
void gwc_format(kiln_buf *out, const char *method, const char *path, const char *ctype,
                const void *body, size_t len, int close);
/* The same with extra header lines ("Name: value\r\n"..., or NULL). */
void gwc_format_h(kiln_buf *out, const char *method, const char *path, const char *ctype,
                  const char *extra, const void *body, size_t len, int close);

/* 1 when `in` starts with a complete response (moved into r and removed
 * from `in`), 0 when more bytes are needed, -1 when malformed. */
int gwc_parse(kiln_buf *in, gwc_response *r);

/* Reads until one whole response is in `in` (keeping later bytes there).
 * 0, or -1 on timeout, EOF or a malformed response. */
int gwc_read_response(int fd, kiln_buf *in, gwc_response *r, int timeout_ms);

/* 1 when the peer has closed (EOF within timeout_ms, no more data). */
int gwc_wait_closed(int fd, int timeout_ms);

/* One request on a new connection (Connection: close). 0 or -1. */
int gwc_request(int port, const char *method, const char *path, const char *ctype,
                const void *body, size_t len, gwc_response *r, int timeout_ms);
/* The same with extra header lines (or NULL). */
int gwc_request_h(int port, const char *method, const char *path, const char *ctype,
                  const char *extra, const void *body, size_t len, gwc_response *r,
                  int timeout_ms);

/* Copies the value of header `name` (case-insensitive) into out; 0 when
 * present, -1 when not. */
int gwc_header(const gwc_response *r, const char *name, char *out, size_t cap);

#endif
