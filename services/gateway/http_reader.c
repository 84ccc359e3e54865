#include "http_reader.h"

#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

typedef enum header_kind { H_OTHER, H_CTYPE, H_EXPECT } header_kind;

struct kiln_http_reader {
    http_parser p;
    kiln_http_limits lim;
    kiln_http_request req;
    size_t header_bytes, target_len, ctype_len, expect_len;
    int in_request, headers_done, complete, continue_pending, seen_ctype;
    int error_status;
    const char *error_msg;
    /* The header being read: its name may arrive in pieces, and a value
     * piece after a name piece starts the value. */
    char field[24];
    size_t field_len;
    int in_value;
    header_kind kind;
    char expect[32];
};

static int fail(kiln_http_reader *r, int status, const char *msg)
{
    r->error_status = status;
    r->error_msg = msg;
    return -1;
}

static int count_header_bytes(kiln_http_reader *r, size_t n)
{
    r->header_bytes += n;
    if (r->header_bytes > r->lim.max_header_bytes)
        return fail(r, 431, "request headers are too large");
    return 0;
}

static int on_message_begin(http_parser *p)
{
    kiln_http_reader *r = p->data;
    r->in_request = 1;
    return 0;
}

static int on_url(http_parser *p, const char *at, size_t n)
{
    kiln_http_reader *r = p->data;
    if (r->target_len + n > KILN_HTTP_TARGET_MAX)
        return fail(r, 414, "request target is too long");
    memcpy(r->req.path + r->target_len, at, n);
    r->target_len += n;
    r->req.path[r->target_len] = '\0';
    return count_header_bytes(r, n);
}

static int on_header_field(http_parser *p, const char *at, size_t n)
{
    kiln_http_reader *r = p->data;
    if (r->in_value) {
        r->in_value = 0;
        r->field_len = 0;
    }
    /* Only short names interest us; a longer one is kept truncated and
     * never matches. */
    size_t room = sizeof r->field - 1 - r->field_len;
    size_t k = n < room ? n : room;
    memcpy(r->field + r->field_len, at, k);
    r->field_len += k;
    r->field[r->field_len] = '\0';
    if (k < n)
        r->field_len = sizeof r->field - 1;
    return count_header_bytes(r, n);
}

static int on_header_value(http_parser *p, const char *at, size_t n)
{
    kiln_http_reader *r = p->data;
    if (!r->in_value) {
        r->in_value = 1;
        r->kind = strcasecmp(r->field, "content-type") == 0 ? H_CTYPE
                  : strcasecmp(r->field, "expect") == 0     ? H_EXPECT
                                                            : H_OTHER;
        if (r->kind == H_CTYPE && r->seen_ctype++)
            return fail(r, 400, "more than one Content-Type header");
    }
    if (r->kind == H_CTYPE) {
        if (r->ctype_len + n > KILN_HTTP_CTYPE_MAX)
            return fail(r, 431, "Content-Type header is too long");
        memcpy(r->req.content_type + r->ctype_len, at, n);
        r->ctype_len += n;
        r->req.content_type[r->ctype_len] = '\0';
    } else if (r->kind == H_EXPECT) {
        size_t room = sizeof r->expect - 1 - r->expect_len, k = n < room ? n : room;
        memcpy(r->expect + r->expect_len, at, k);
        r->expect_len += k;
        r->expect[r->expect_len] = '\0';
    }
    return count_header_bytes(r, n);
}

static kiln_http_method method_of(unsigned m)
{
    switch (m) {
    case HTTP_GET: return KILN_HTTP_GET;
    case HTTP_HEAD: return KILN_HTTP_HEAD;
    case HTTP_POST: return KILN_HTTP_POST;
    default: return KILN_HTTP_OTHER;
    }
}

static int on_headers_complete(http_parser *p)
{
    kiln_http_reader *r = p->data;
    kiln_http_request *q = &r->req;
    if (p->http_major != 1)
        return fail(r, 505, "only HTTP/1.x is supported");
    q->method = method_of(p->method);
    snprintf(q->method_name, sizeof q->method_name, "%s", http_method_str(p->method));
    char *query = strchr(q->path, '?');
    if (query)
        *query = '\0';
    q->keep_alive = http_should_keep_alive(p);
    r->headers_done = 1;
    int has_length = (p->flags & F_CONTENTLENGTH) != 0;
    if (has_length && p->content_length > r->lim.max_body_bytes)
        return fail(r, 413, "request body is too large");
    /* Reserve what a declared length needs, but not more than 1 MiB ahead
     * of the bytes that actually arrive: a client declaring a large body
     * and sending nothing must not cost that memory. */
    size_t ahead = has_length && p->content_length < (1u << 20) ? (size_t)p->content_length : 1u << 20;
    if (has_length && kiln_buf_reserve(&q->body, ahead + 1, NULL))
        return fail(r, 413, "request body is too large");
    int has_body = has_length ? p->content_length > 0 : (p->flags & F_CHUNKED) != 0;
    r->continue_pending = has_body && p->http_minor >= 1 && strcasecmp(r->expect, "100-continue") == 0;
    return 0;
}

static int on_body(http_parser *p, const char *at, size_t n)
{
    kiln_http_reader *r = p->data;
    if (n > r->lim.max_body_bytes - r->req.body.len)
        return fail(r, 413, "request body is too large");
    if (kiln_buf_append(&r->req.body, at, n, NULL))
        return fail(r, 413, "request body is too large");
    return 0;
}

static int on_message_complete(http_parser *p)
{
    kiln_http_reader *r = p->data;
    kiln_buf *b = &r->req.body;
    if (kiln_buf_reserve(b, 1, NULL))
        return fail(r, 413, "request body is too large");
    b->data[b->len] = '\0';
    r->complete = 1;
    r->continue_pending = 0;
    http_parser_pause(p, 1);
    return 0;
}

static const http_parser_settings settings = {
    .on_message_begin = on_message_begin,
    .on_url = on_url,
    .on_header_field = on_header_field,
    .on_header_value = on_header_value,
    .on_headers_complete = on_headers_complete,
    .on_body = on_body,
    .on_message_complete = on_message_complete,
};

static void reset_request(kiln_http_reader *r)
{
    kiln_buf_free(&r->req.body);
    memset(&r->req, 0, sizeof r->req);
    r->header_bytes = r->target_len = r->ctype_len = r->expect_len = r->field_len = 0;
    r->in_request = r->headers_done = r->complete = r->continue_pending = 0;
    r->seen_ctype = r->in_value = 0;
    r->expect[0] = r->field[0] = '\0';
}

kiln_http_reader *kiln_http_reader_create(const kiln_http_limits *limits, kiln_err *err)
{
    kiln_http_reader *r = calloc(1, sizeof *r);
    if (!r) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    r->lim = *limits;
    http_parser_init(&r->p, HTTP_REQUEST);
    r->p.data = r;
    return r;
}

void kiln_http_reader_destroy(kiln_http_reader *r)
{
    if (!r)
        return;
    kiln_buf_free(&r->req.body);
    free(r);
}

size_t kiln_http_reader_feed(kiln_http_reader *r, const char *data, size_t len,
                             kiln_http_event *ev)
{
    if (r->error_status) {
        *ev = KILN_HTTP_ERROR;
        return 0;
    }
    size_t n = http_parser_execute(&r->p, &settings, data, len);
    if (r->complete) {
        /* An Upgrade / CONNECT request ends what http-parser will read on
         * this connection: answer it, then close. */
        if (r->p.upgrade)
            r->req.keep_alive = 0;
        *ev = KILN_HTTP_REQUEST;
        return n;
    }
    enum http_errno e = HTTP_PARSER_ERRNO(&r->p);
    if (e != HPE_OK || r->p.upgrade || n != len) {
        if (!r->error_status) {
            r->error_status = e == HPE_HEADER_OVERFLOW ? 431 : 400;
            r->error_msg = e == HPE_HEADER_OVERFLOW ? "request headers are too large"
                                                    : "malformed HTTP request";
        }
        *ev = KILN_HTTP_ERROR;
        return n;
    }
    *ev = KILN_HTTP_NEED_MORE;
    return n;
}

kiln_http_request *kiln_http_reader_request(kiln_http_reader *r)
{
    return &r->req;
}

void kiln_http_reader_next(kiln_http_reader *r)
{
    reset_request(r);
    if (HTTP_PARSER_ERRNO(&r->p) == HPE_PAUSED)
        http_parser_pause(&r->p, 0);
}

int kiln_http_reader_error(const kiln_http_reader *r, const char **message)
{
    *message = r->error_msg ? r->error_msg : "malformed HTTP request";
    return r->error_status ? r->error_status : 400;
}

int kiln_http_reader_in_request(const kiln_http_reader *r)
{
    return r->in_request && !r->complete;
}

int kiln_http_reader_headers_done(const kiln_http_reader *r)
{
    return r->headers_done;
}

int kiln_http_reader_take_continue(kiln_http_reader *r)
{
    int c = r->continue_pending;
    r->continue_pending = 0;
    return c;
}
