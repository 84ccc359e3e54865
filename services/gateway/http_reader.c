#include "http_reader.h"

#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "http_strict.h"

typedef enum header_kind {
    H_OTHER, H_CTYPE, H_LENGTH, H_EXPECT, H_HOST, H_TE, H_AUTH, H_RID
} header_kind;

/* Host values kept for checking; a longer one is refused (no DNS name is
 * longer than 253 bytes, plus a port). */
#define HOST_MAX 300

struct kiln_http_reader {
    http_parser p;
    kiln_http_limits lim;
    kiln_http_request req;
    size_t target_len, ctype_len, expect_len, auth_len;
    int in_request, headers_done, complete, continue_pending;
    int n_auth, bad_auth; /* Authorization headers; one unusable (cut short, repeated) */
    size_t rid_len;
    int n_rid, bad_rid;   /* X-Request-Id headers; one unusable (too long, repeated) */
    int error_status;
    const char *error_msg;
    kiln_http_strict strict; /* the raw bytes, checked before http-parser sees them */
    /* Faults the field callbacks find are noted and reported once the
     * header section is complete: callbacks run when a value piece ends,
     * which depends on how the bytes arrive, and the answer must not. */
    int noted_status;
    const char *noted_msg;
    int n_ctype, n_host, n_te, n_length, chunked;
    int bad_method; /* the parser refused the method: is it a token (501) or garbage (400)? */
    size_t body_max; /* this request's body limit */
    char msg[128];   /* an error message made for this request */
    uint64_t body_length;
    /* The header being read: its name may arrive in pieces, and a value
     * piece after a name piece starts the value. */
    char field[24];
    size_t field_len;
    int in_value;
    header_kind kind;
    char expect[32];
    char host[HOST_MAX + 1];
    size_t host_len;
    char te[32];
    size_t te_len;
};

static int fail(kiln_http_reader *r, int status, const char *msg)
{
    r->error_status = status;
    r->error_msg = msg;
    return -1;
}

static void note(kiln_http_reader *r, int status, const char *msg)
{
    if (!r->noted_status) {
        r->noted_status = status;
        r->noted_msg = msg;
    }
}

static int too_large(kiln_http_reader *r)
{
    snprintf(r->msg, sizeof r->msg, "request body is too large: at most %zu bytes on %.48s",
             r->body_max, r->req.path);
    return fail(r, 413, r->msg);
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
    /* The strict scan refused longer targets (414) before the parser. */
    if (r->target_len + n > KILN_HTTP_TARGET_MAX)
        return fail(r, 414, "request target is too long");
    memcpy(r->req.path + r->target_len, at, n);
    r->target_len += n;
    r->req.path[r->target_len] = '\0';
    return 0;
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
    return 0;
}

/* Appends a piece of a header value to a short buffer; 1 when it does
 * not fit. */
static int keep(char *buf, size_t cap, size_t *len, const char *at, size_t n)
{
    if (n > cap - *len)
        return 1;
    memcpy(buf + *len, at, n);
    *len += n;
    buf[*len] = '\0';
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t n)
{
    kiln_http_reader *r = p->data;
    if (r->headers_done) /* a trailer field (http_strict.h vetted it): discarded */
        return 0;
    if (!r->in_value) {
        r->in_value = 1;
        r->kind = strcasecmp(r->field, "content-type") == 0        ? H_CTYPE
                  : strcasecmp(r->field, "content-length") == 0    ? H_LENGTH
                  : strcasecmp(r->field, "expect") == 0            ? H_EXPECT
                  : strcasecmp(r->field, "host") == 0              ? H_HOST
                  : strcasecmp(r->field, "transfer-encoding") == 0 ? H_TE
                  : strcasecmp(r->field, "authorization") == 0     ? H_AUTH
                  : strcasecmp(r->field, "x-request-id") == 0      ? H_RID
                                                                   : H_OTHER;
        if (r->kind == H_CTYPE && r->n_ctype++)
            note(r, 400, "more than one Content-Type header");
        /* RFC 9112 sections 3.2 and 6.1: either twice makes the request's
         * target or framing ambiguous. */
        if (r->kind == H_HOST && r->n_host++)
            note(r, 400, "more than one Host header");
        if (r->kind == H_TE && r->n_te++)
            note(r, 400, "Transfer-Encoding is given more than once");
        if (r->kind == H_LENGTH && r->n_length++)
            note(r, 400, "Content-Length is given more than once");
        if ((r->kind == H_TE || r->kind == H_LENGTH) && r->n_te && r->n_length)
            note(r, 400, "Transfer-Encoding and Content-Length are both given");
        if (r->kind == H_AUTH && r->n_auth++)
            r->bad_auth = 1;
        if (r->kind == H_RID && r->n_rid++)
            r->bad_rid = 1;
    }
    switch (r->kind) {
    case H_HOST:
        if (keep(r->host, HOST_MAX, &r->host_len, at, n))
            note(r, 400, "the Host header is too long");
        break;
    case H_TE:
        if (keep(r->te, sizeof r->te - 1, &r->te_len, at, n))
            note(r, 400, "Transfer-Encoding other than chunked is not supported");
        break;
    case H_CTYPE:
        if (keep(r->req.content_type, KILN_HTTP_CTYPE_MAX, &r->ctype_len, at, n))
            note(r, 431, "Content-Type header is too long");
        break;
    case H_EXPECT:
    case H_AUTH: {
        /* Cut short: only the start matters. */
        char *buf = r->kind == H_EXPECT ? r->expect : r->req.authorization;
        size_t cap = r->kind == H_EXPECT ? sizeof r->expect - 1 : KILN_HTTP_AUTH_MAX;
        size_t *len = r->kind == H_EXPECT ? &r->expect_len : &r->auth_len;
        size_t room = cap - *len, k = n < room ? n : room;
        if (r->kind == H_AUTH && k < n)
            r->bad_auth = 1;
        keep(buf, cap, len, at, k);
        break;
    }
    case H_RID:
        if (keep(r->req.request_id, KILN_HTTP_RID_MAX, &r->rid_len, at, n))
            r->bad_rid = 1;
        break;
    default: break;
    }
    return 0;
}

/* A client's request id is kept when it is 1..KILN_HTTP_RID_MAX
 * characters of [A-Za-z0-9] and -_.:/+=@ (it goes into headers and log
 * lines as it is). */
static int rid_valid(const char *s, size_t len)
{
    if (!len)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z') ||
              (s[i] >= 'A' && s[i] <= 'Z') || strchr("-_.:/+=@", s[i])))
            return 0;
    return 1;
}

static kiln_http_method method_of(unsigned m)
{
    switch (m) {
    case HTTP_GET: return KILN_HTTP_GET;
    case HTTP_HEAD: return KILN_HTTP_HEAD;
    case HTTP_POST: return KILN_HTTP_POST;
    /* The other methods of RFC 9110 (and PATCH): known, not allowed on
     * kiln's routes (405).  CONNECT and the rest are not implemented. */
    case HTTP_PUT:
    case HTTP_DELETE:
    case HTTP_OPTIONS:
    case HTTP_TRACE:
    case HTTP_PATCH: return KILN_HTTP_OTHER;
    default: return KILN_HTTP_UNIMPLEMENTED;
    }
}

/* A Host value: uri-host [":" port] (RFC 3986 reg-name, IPv4 or an IP
 * literal in brackets), possibly empty. */
static int host_valid(const char *h, size_t len)
{
    while (len && (h[len - 1] == ' ' || h[len - 1] == '\t'))
        len--;
    for (const char *end = h + len; h < end; h++)
        if (!((*h >= '0' && *h <= '9') || (*h >= 'a' && *h <= 'z') || (*h >= 'A' && *h <= 'Z') ||
              strchr("-._~!$&'()*+,;=:%[]", *h)))
            return 0;
    return 1;
}

/* The framing rules of RFC 9112 the parser's callbacks can check: one
 * Host in HTTP/1.1, and Transfer-Encoding exactly "chunked", never with
 * Content-Length nor in HTTP/1.0 (sections 3.2, 6.1 and 6.3). */
static int check_framing(kiln_http_reader *r, const http_parser *p)
{
    if (p->http_minor >= 1 && !r->n_host)
        return fail(r, 400, "HTTP/1.1 requests must have a Host header");
    if (r->n_host && !host_valid(r->host, r->host_len))
        return fail(r, 400, "the Host header is not a valid host");
    if (!r->n_te)
        return 0;
    if (p->http_minor == 0)
        return fail(r, 400, "Transfer-Encoding is not allowed in HTTP/1.0");
    const char *v = r->te;
    size_t len = r->te_len;
    while (len && (v[len - 1] == ' ' || v[len - 1] == '\t'))
        len--;
    if (len != 7 || strncasecmp(v, "chunked", 7) != 0 || !(p->flags & F_CHUNKED))
        return fail(r, 400, "Transfer-Encoding other than chunked is not supported");
    return 0;
}

static int on_headers_complete(http_parser *p)
{
    kiln_http_reader *r = p->data;
    kiln_http_request *q = &r->req;
    if (p->http_major != 1)
        return fail(r, 505, "only HTTP/1.x is supported");
    if (r->noted_status)
        return fail(r, r->noted_status, r->noted_msg);
    if (check_framing(r, p))
        return -1;
    q->method = method_of(p->method);
    snprintf(q->method_name, sizeof q->method_name, "%s", http_method_str(p->method));
    char *query = strchr(q->path, '?');
    if (query)
        *query = '\0';
    q->keep_alive = http_should_keep_alive(p);
    q->http10 = p->http_major == 1 && p->http_minor == 0;
    if (r->bad_auth)
        q->authorization[0] = '\0';
    while (r->rid_len && (q->request_id[r->rid_len - 1] == ' ' || q->request_id[r->rid_len - 1] == '\t'))
        q->request_id[--r->rid_len] = '\0';
    if (r->bad_rid || !rid_valid(q->request_id, r->rid_len))
        q->request_id[0] = '\0';
    r->headers_done = 1;
    int has_length = (p->flags & F_CONTENTLENGTH) != 0;
    r->chunked = (p->flags & F_CHUNKED) != 0;
    r->body_length = has_length ? p->content_length : 0;
    r->body_max = r->lim.max_body_bytes;
    if (r->lim.body_limit) {
        size_t route = r->lim.body_limit(r->lim.ud, q);
        if (route < r->body_max)
            r->body_max = route;
    }
    if (has_length && p->content_length > r->body_max)
        return too_large(r);
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
    if (n > r->body_max - r->req.body.len)
        return too_large(r);
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
    r->target_len = r->ctype_len = r->expect_len = r->auth_len = r->field_len = 0;
    r->in_request = r->headers_done = r->complete = r->continue_pending = 0;
    r->in_value = r->n_ctype = r->noted_status = 0;
    r->n_auth = r->bad_auth = 0;
    r->rid_len = 0;
    r->n_rid = r->bad_rid = 0;
    r->noted_msg = NULL;
    r->expect[0] = r->field[0] = '\0';
    r->n_host = r->n_te = r->n_length = r->chunked = r->bad_method = 0;
    r->body_length = 0;
    r->host_len = r->te_len = 0;
    r->host[0] = r->te[0] = '\0';
    kiln_http_strict_reset(&r->strict, r->lim.max_header_bytes);
}

kiln_http_reader *kiln_http_reader_create(const kiln_http_limits *limits, kiln_err *err)
{
    kiln_http_reader *r = calloc(1, sizeof *r);
    if (!r) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    r->lim = *limits;
    kiln_http_strict_reset(&r->strict, limits->max_header_bytes);
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

static kiln_http_event stream_error(kiln_http_reader *r, int status, const char *msg)
{
    if (!r->error_status) {
        r->error_status = status;
        r->error_msg = msg;
    }
    return KILN_HTTP_ERROR;
}

/* Why http-parser stopped, as a status and a message for the client.
 * A method it does not know is decided once the strict scan has seen the
 * whole method: a token is 501 (RFC 9110 section 9.1), anything else 400,
 * whatever pieces the bytes arrive in. */
static kiln_http_event parser_error(kiln_http_reader *r)
{
    enum http_errno e = HTTP_PARSER_ERRNO(&r->p);
    if (e == HPE_HEADER_OVERFLOW)
        return stream_error(r, 431, "request headers are too large");
    if (e == HPE_INVALID_METHOD) {
        r->bad_method = 1;
        return KILN_HTTP_NEED_MORE;
    }
    snprintf(r->msg, sizeof r->msg, "malformed HTTP request: %s", http_errno_description(e));
    return stream_error(r, 400, r->msg);
}

static kiln_http_event method_error(kiln_http_reader *r, const char *data, size_t len,
                                    size_t *used)
{
    /* The method decides, whatever follows it: the answer must not depend
     * on how much of the line arrived with it. */
    *used = kiln_http_strict_method_ok(&r->strict) ? 0 : kiln_http_strict_scan(&r->strict, data, len);
    if (kiln_http_strict_method_ok(&r->strict))
        return stream_error(r, 501, "the request method is not implemented");
    const char *why;
    int st = kiln_http_strict_failed(&r->strict, &why);
    if (st)
        return stream_error(r, st, why);
    return KILN_HTTP_NEED_MORE;
}

size_t kiln_http_reader_feed(kiln_http_reader *r, const char *data, size_t len,
                             kiln_http_event *ev)
{
    if (r->error_status) {
        *ev = KILN_HTTP_ERROR;
        return 0;
    }
    /* The strict scan goes first, so the parser (and its callbacks) only
     * ever see bytes that are valid HTTP/1.1; it stops at the end of the
     * header section, where the parser's reading of the framing fields
     * tells it what body follows. */
    size_t off = 0;
    const char *why;
    while (off < len) {
        if (r->bad_method) {
            size_t used;
            *ev = method_error(r, data + off, len - off, &used);
            return off + used;
        }
        size_t ok = kiln_http_strict_scan(&r->strict, data + off, len - off);
        size_t n = ok ? http_parser_execute(&r->p, &settings, data + off, ok) : 0;
        off += n;
        if (r->complete) {
            /* An Upgrade / CONNECT request ends what http-parser will read
             * on this connection: answer it, then close. */
            if (r->p.upgrade)
                r->req.keep_alive = 0;
            kiln_http_strict_body(&r->strict, r->chunked, r->body_length);
            if (!kiln_http_strict_done(&r->strict) && !r->p.upgrade) {
                *ev = stream_error(r, 400, "malformed HTTP request framing");
                return off;
            }
            *ev = KILN_HTTP_REQUEST;
            return off;
        }
        if (r->error_status || HTTP_PARSER_ERRNO(&r->p) != HPE_OK || n != ok || r->p.upgrade) {
            *ev = r->error_status ? KILN_HTTP_ERROR : parser_error(r);
            if (*ev != KILN_HTTP_NEED_MORE)
                return off;
            /* What the strict scan passed beyond the parser's stop is
             * consumed; the rest decides between 400 and 501. */
            off += ok - n;
            size_t used;
            *ev = method_error(r, data + off, len - off, &used);
            return off + used;
        }
        int st = kiln_http_strict_failed(&r->strict, &why);
        if (st) {
            *ev = stream_error(r, st, why);
            return off;
        }
        if (kiln_http_strict_at_body(&r->strict))
            kiln_http_strict_body(&r->strict, r->chunked, r->body_length);
        else if (kiln_http_strict_done(&r->strict)) {
            /* The bytes say the request ended; the parser does not agree. */
            *ev = stream_error(r, 400, "malformed HTTP request framing");
            return off;
        }
    }
    *ev = KILN_HTTP_NEED_MORE;
    return off;
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

size_t kiln_http_reader_body_need(const kiln_http_reader *r)
{
    if (!r->headers_done)
        return 0;
    return r->chunked ? r->body_max : (size_t)r->body_length;
}

int kiln_http_reader_take_continue(kiln_http_reader *r)
{
    int c = r->continue_pending;
    r->continue_pending = 0;
    return c;
}
