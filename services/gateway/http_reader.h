/* kiln HTTP/1.1 request reader: turns the bytes of one connection into
 * complete requests under size limits, with no I/O of its own (the server
 * feeds it what it reads; the fuzzer feeds it anything).
 *
 *   kiln_http_reader *r = kiln_http_reader_create(&limits, &err);
 *   size_t used = kiln_http_reader_feed(r, buf, len, &ev);
 *   switch (ev) {
 *   case KILN_HTTP_NEED_MORE: ... read more; used == len ...
 *   case KILN_HTTP_REQUEST: req = kiln_http_reader_request(r); ... respond ...;
 *       kiln_http_reader_next(r); feed buf + used next (pipelined requests)
 *   case KILN_HTTP_ERROR: respond kiln_http_reader_error(r, &msg) and close
 *   }
 *
 * It stops after each complete request so responses go out in request
 * order (pipelining): the caller feeds the remaining bytes only once it has
 * answered.  Limits: the request line plus headers (431, or 414 for the
 * target alone), and the body (413, refused from Content-Length before any
 * body byte arrives, or as chunks add up).  Framing is strict HTTP/1.1
 * (RFC 9112): the raw bytes pass http_strict.h's checks before http-parser
 * sees them, and the callbacks refuse a missing or repeated Host (HTTP/1.1),
 * Transfer-Encoding other than one "chunked", given twice, with
 * Content-Length or in HTTP/1.0; all of that, and anything http-parser
 * refuses, is 400, except a well-formed method the parser does not know
 * (501).  A request with `Expect: 100-continue` sets a flag the server reads
 * with kiln_http_reader_take_continue once its headers are in.  A major
 * version other than 1 is 505.  Method, path, Content-Type and
 * Authorization (and X-Request-Id) are there once kiln_http_reader_headers_done says so
 * (kiln_http_reader_request), before the body.
 *
 * Not thread-safe: one reader per connection, used by one thread.
 */
#ifndef KILN_GW_HTTP_READER_H
#define KILN_GW_HTTP_READER_H

#include <stddef.h>

#include "common/buf.h"
#include "common/error.h"

#define KILN_HTTP_TARGET_MAX 2048   /* request target bytes */
#define KILN_HTTP_CTYPE_MAX 1024    /* Content-Type value bytes */
#define KILN_HTTP_AUTH_MAX 512      /* Authorization bytes kept (longer values are cut) */
#define KILN_HTTP_RID_MAX 64        /* X-Request-Id bytes a client may give */

typedef struct kiln_http_request kiln_http_request;

typedef struct kiln_http_limits {
    size_t max_header_bytes; /* request line + headers */
    size_t max_body_bytes;
    /* When set, the body limit of one request, asked once its head is in
     * (method, path and Content-Type are filled); capped by
     * max_body_bytes.  Lets each route refuse what it can never need. */
    size_t (*body_limit)(void *ud, const kiln_http_request *head);
    void *ud;
} kiln_http_limits;

typedef enum kiln_http_event {
    KILN_HTTP_NEED_MORE = 0, /* every byte was consumed; no complete request yet */
    KILN_HTTP_REQUEST,       /* a complete request is ready */
    KILN_HTTP_ERROR,         /* the stream is unusable: answer and close */
} kiln_http_event;

typedef enum kiln_http_method {
    KILN_HTTP_OTHER = 0,     /* a standard method kiln's routes do not allow (405) */
    KILN_HTTP_GET,
    KILN_HTTP_HEAD,
    KILN_HTTP_POST,
    KILN_HTTP_UNIMPLEMENTED, /* a method kiln does not implement at all (501) */
} kiln_http_method;

struct kiln_http_request {
    kiln_http_method method;
    char method_name[16];
    char path[KILN_HTTP_TARGET_MAX + 1]; /* the target without its query */
    char content_type[KILN_HTTP_CTYPE_MAX + 1];
    int keep_alive; /* the client allows another request on this connection */
    int http10;     /* an HTTP/1.0 request (no chunked answers) */
    /* The Authorization header's value; empty when the request had none,
     * more than one, or one longer than KILN_HTTP_AUTH_MAX (none of which
     * can carry a valid key or name a client). */
    char authorization[KILN_HTTP_AUTH_MAX + 1];
    /* The request's id: the client's X-Request-Id when it gave one that
     * is 1..KILN_HTTP_RID_MAX characters of [A-Za-z0-9-_.:/+=@] (else
     * ignored), else one the server makes ("req_" + 16 hex digits); the
     * server sets it once the headers are in and answers with it. */
    char request_id[KILN_HTTP_RID_MAX + 1];
    uint64_t client; /* who sent it (the server sets it: clients.h), 0 when unknown */
    kiln_buf body;  /* NUL-terminated after body.len (not counted) */
};

typedef struct kiln_http_reader kiln_http_reader;

/* NULL with err set (KILN_ERR_NOMEM). */
kiln_http_reader *kiln_http_reader_create(const kiln_http_limits *limits, kiln_err *err);
/* Accepts NULL. */
void kiln_http_reader_destroy(kiln_http_reader *r);

/* Consumes bytes up to the end of the next complete request, an error, or
 * the end of data; returns how many it consumed.  After KILN_HTTP_REQUEST,
 * call kiln_http_reader_next before feeding again; after KILN_HTTP_ERROR
 * feeding is pointless. */
size_t kiln_http_reader_feed(kiln_http_reader *r, const char *data, size_t len,
                             kiln_http_event *ev);

/* The request of the last KILN_HTTP_REQUEST (owned by the reader, valid
 * until kiln_http_reader_next).  The caller may take the body by moving it
 * out (leaving a zeroed kiln_buf). */
kiln_http_request *kiln_http_reader_request(kiln_http_reader *r);

/* Readies the reader for the next request on the same connection. */
void kiln_http_reader_next(kiln_http_reader *r);

/* After KILN_HTTP_ERROR: the status to answer (400, 413, 414, 431, 501, 505) and a
 * message safe to show the client. */
int kiln_http_reader_error(const kiln_http_reader *r, const char **message);

/* 1 while a request has started but is not complete (for the server's
 * read timeouts). */
int kiln_http_reader_in_request(const kiln_http_reader *r);

/* 1 once the current request's headers are complete (its body may still
 * be arriving). */
int kiln_http_reader_headers_done(const kiln_http_reader *r);

/* 1 once per request whose headers asked for `Expect: 100-continue` and
 * were accepted (the body size is within limits). */
int kiln_http_reader_take_continue(kiln_http_reader *r);

/* Once the headers are done: the most bytes the body can hold (its
 * Content-Length, or the route's limit for a chunked body), 0 when it has
 * none. */
size_t kiln_http_reader_body_need(const kiln_http_reader *r);

#endif
