#include "http_server.h"

#include <assert.h>
#include <http_parser.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "api_response.h"
#include "common/log.h"

#define READ_CHUNK 65536
#define PIPELINE_MAX (1u << 20) /* buffered bytes beyond the request being handled */
#define LINGER_MS 2000

typedef enum conn_state {
    C_READING, /* reading a request (or idle between requests) */
    C_WAITING, /* the request's body waits for budget; reading paused */
    C_BUSY,    /* the handler has the request */
    C_WRITING, /* the response is being written */
    C_LINGER,  /* our side shut down; draining what the client sends */
} conn_state;

struct kiln_http_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wreq;
    uv_shutdown_t sreq;
    kiln_http_server *srv;
    struct kiln_http_conn *prev, *next;
    kiln_http_reader *reader;
    kiln_buf in; /* read bytes; [in_off, in.len) not parsed yet */
    size_t in_off;
    conn_state state;
    int reading, closing, n_closed, eof, close_after, head_only;
    int headers_seen; /* on_headers ran for the request being read */
    int streaming;    /* kiln_http_stream_start ran for it */
    int raw_stream;   /* ... for an HTTP/1.0 client: no chunks, the end closes */
    size_t streamed;  /* body bytes streamed so far (the access log) */
    void *pending;
    char rid[KILN_HTTP_RID_MAX + 1]; /* the id of the request being handled ("": none yet) */
    int steps; /* its denoising steps for the access log (kiln_http_set_steps; 0: none) */
    char head[640];
    kiln_buf body;
    uint64_t t_request; /* first byte of the request being read */
    uint64_t t_state;   /* entering the current state */
    /* Clients (clients.h): the peer address's id, counted while
     * `counted`; the request's client, what its body was charged, and
     * whether it was admitted (or is waiting, with `whole`: the request
     * was complete when it started to wait). */
    char addr[64];
    uint64_t addr_id, client;
    int counted, admitted, whole, refused;
    size_t charged;
    kiln_gw_body_waiter waiter;
};

struct kiln_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    kiln_http_server_opts opts;
    kiln_http_handlers h;
    void *ud;
    kiln_http_conn *conns;
    int n_conns;
    struct reject *rejects;
    int n_rejects;
    uint64_t refused;
    uint64_t own_seq; /* request ids made when opts.request_seq is NULL */
    int port;
    int stopping, listener_closed;
};

/* A connection past max_connections: told 503, then lingering like a
 * closing connection so that the client reads the answer, not a reset. */
typedef struct reject {
    uv_tcp_t tcp;
    uv_timer_t timer;
    uv_write_t wreq;
    uv_shutdown_t sreq;
    kiln_http_server *srv;
    struct reject *prev, *next;
    int closing, n_closed;
    char head[256];
    kiln_buf body;
    char drain[4096];
} reject;

/* Refused connections lingering at once; beyond, they are closed at once
 * (best-effort answer) so a flood cannot pin memory. */
#define MAX_REJECTS 64

static void close_conn(kiln_http_conn *c);
static void process(kiln_http_conn *c);
static void arm(kiln_http_conn *c);
static void set_reading(kiln_http_conn *c, int on);

/* Gives the request's body charge back (the response is out, or the
 * connection goes) and forgets a wait. */
static void release_body(kiln_http_conn *c)
{
    kiln_gw_clients *cl = c->srv->opts.clients;
    if (!cl)
        return;
    kiln_gw_clients_cancel_wait(cl, &c->waiter);
    size_t k = c->charged;
    c->charged = 0;
    c->admitted = 0;
    if (k)
        kiln_gw_clients_give_body(cl, c->client, k);
}

static void maybe_free_server(kiln_http_server *s)
{
    if (s->stopping && s->listener_closed && s->n_conns == 0 && s->n_rejects == 0)
        free(s);
}

static void on_conn_closed(uv_handle_t *h)
{
    kiln_http_conn *c = h->data;
    if (++c->n_closed < 2)
        return;
    kiln_http_server *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    if (!c->refused)
        s->n_conns--;
    else
        s->n_rejects--;
    kiln_http_reader_destroy(c->reader);
    kiln_buf_free(&c->in);
    kiln_buf_free(&c->body);
    free(c);
    maybe_free_server(s);
}

static void close_conn(kiln_http_conn *c)
{
    if (c->closing)
        return;
    c->closing = 1;
    if (c->pending || c->state == C_BUSY) {
        void *p = c->pending;
        c->pending = NULL;
        c->srv->h.on_abort(c->srv->ud, c, p);
    }
    release_body(c);
    if (c->counted)
        kiln_gw_clients_disconnect(c->srv->opts.clients, c->addr_id);
    c->counted = 0;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    kiln_http_conn *c = h->data;
    (void)suggested;
    if (c->in_off && c->in_off == c->in.len)
        c->in_off = c->in.len = 0;
    if (kiln_buf_reserve(&c->in, READ_CHUNK, NULL)) {
        *buf = uv_buf_init(NULL, 0); /* libuv reports UV_ENOBUFS: the connection closes */
        return;
    }
    *buf = uv_buf_init((char *)c->in.data + c->in.len, READ_CHUNK);
}

static void on_written(uv_write_t *w, int status)
{
    kiln_http_conn *c = w->data;
    kiln_buf_free(&c->body);
    if (c->closing)
        return;
    release_body(c);
    if (status < 0) {
        close_conn(c);
        return;
    }
    if (c->close_after || c->eof) {
        c->state = C_LINGER;
        c->t_state = uv_now(c->srv->loop);
        if (c->eof || uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, NULL)) {
            close_conn(c);
            return;
        }
        set_reading(c, 1); /* drained, so closing sends no reset (reading paused for a body) */
        arm(c);
        return;
    }
    kiln_http_reader_next(c->reader);
    c->headers_seen = 0;
    c->streaming = c->raw_stream = 0;
    c->streamed = 0;
    c->rid[0] = '\0';
    c->steps = 0;
    c->state = C_READING;
    c->t_state = uv_now(c->srv->loop);
    process(c);
}

/* A fresh request id: "req_" + 16 hex digits of the base plus a count. */
static void make_rid(kiln_http_server *s, char *out, size_t cap)
{
    uint64_t *seq = s->opts.request_seq ? s->opts.request_seq : &s->own_seq;
    snprintf(out, cap, "req_%016llx", (unsigned long long)(s->opts.request_base + ++*seq));
}

/* Gives the connection's current request its id once: the client's
 * X-Request-Id when its headers are in and it gave a usable one, else a
 * fresh one (also for errors before the headers are complete). */
static const char *conn_rid(kiln_http_conn *c)
{
    if (c->rid[0])
        return c->rid;
    kiln_http_request *req = kiln_http_reader_headers_done(c->reader)
                                 ? kiln_http_reader_request(c->reader) : NULL;
    if (req && req->request_id[0])
        snprintf(c->rid, sizeof c->rid, "%s", req->request_id);
    else
        make_rid(c->srv, c->rid, sizeof c->rid);
    if (req)
        snprintf(req->request_id, sizeof req->request_id, "%s", c->rid);
    return c->rid;
}

/* The access log: one line per response, as nginx's: the request id (its
 * X-Request-Id), method, path, status, body bytes, the denoising steps
 * ("-" when the request ran none), milliseconds since the request's first
 * byte, and the peer.  2xx answers to the probe and scrape
 * routes are left out (a kubelet asks every few seconds). */
static void access_log(kiln_http_conn *c, int status, size_t bytes)
{
    if (!kiln_log_enabled(KILN_LOG_INFO))
        return;
    const kiln_http_request *req = kiln_http_reader_request(c->reader);
    const char *path = req && req->path[0] ? req->path : "-";
    if (status < 300 && (!strcmp(path, "/healthz") || !strcmp(path, "/readyz") ||
                         !strcmp(path, "/metrics")))
        return;
    char steps[16] = "-";
    if (c->steps > 0)
        snprintf(steps, sizeof steps, "%d", c->steps);
    KILN_LOG_INFO("access: %s %s %s %d %zu bytes %s steps %llu ms %s", conn_rid(c),
                  req && req->method_name[0] ? req->method_name : "-", path, status, bytes, steps,
                  (unsigned long long)(uv_now(c->srv->loop) - c->t_request),
                  c->addr[0] ? c->addr : "-");
}

static void write_response(kiln_http_conn *c, int status, const char *ctype, const char *extra,
                           kiln_buf *body)
{
    access_log(c, status, body->len);
    if (c->srv->stopping)
        c->close_after = 1;
    const char *reason = http_status_str((enum http_status)status);
    snprintf(c->head, sizeof c->head,
             "HTTP/1.1 %d %s\r\nServer: kiln\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
             "X-Request-Id: %s\r\n%sConnection: %s\r\n\r\n",
             status, reason, ctype, body->len, conn_rid(c), extra ? extra : "",
             c->close_after ? "close" : "keep-alive");
    c->body = *body;
    *body = (kiln_buf){0};
    uv_buf_t bufs[2] = {uv_buf_init(c->head, (unsigned)strlen(c->head)),
                        uv_buf_init((char *)c->body.data, (unsigned)c->body.len)};
    c->state = C_WRITING;
    c->t_state = uv_now(c->srv->loop);
    c->wreq.data = c;
    int n = c->head_only || !c->body.len ? 1 : 2;
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, bufs, (unsigned)n, on_written)) {
        kiln_buf_free(&c->body);
        close_conn(c);
        return;
    }
    arm(c);
}

/* An error the server answers itself; the connection closes after it. */
static void own_error(kiln_http_conn *c, int status, const char *code, const char *msg)
{
    kiln_buf body = {0};
    if (kiln_api_error_json(&body, status, msg, NULL, code, NULL))
        kiln_buf_clear(&body);
    c->close_after = 1;
    c->head_only = 0;
    if (c->state == C_WAITING)
        kiln_gw_clients_cancel_wait(c->srv->opts.clients, &c->waiter);
    c->srv->h.on_own_response(c->srv->ud, status);
    write_response(c, status, "application/json", status == 503 ? "Retry-After: 1\r\n" : NULL,
                   &body);
    kiln_buf_free(&body);
}

static const char *own_code(int status)
{
    return status == 408 ? "timeout" : status == 413 ? "too_large"
           : status == 501 ? "not_implemented" : "invalid_request";
}

static void on_timer(uv_timer_t *t)
{
    kiln_http_conn *c = t->data;
    switch (c->state) {
    case C_READING:
        if (kiln_http_reader_in_request(c->reader))
            own_error(c, 408, "timeout", "the request did not arrive in time");
        else
            close_conn(c); /* idle keep-alive */
        break;
    case C_WAITING:
        own_error(c, 503, "server_busy",
                  "the server holds too many request bodies right now; retry later");
        break;
    case C_WRITING: /* the client does not read its response */
    case C_LINGER:
        close_conn(c);
        break;
    case C_BUSY:
        break;
    }
}

/* Sets the timer for the connection's state. */
static void arm(kiln_http_conn *c)
{
    if (c->closing)
        return;
    const kiln_http_server_opts *o = &c->srv->opts;
    uint64_t now = uv_now(c->srv->loop), deadline;
    switch (c->state) {
    case C_READING:
        if (kiln_http_reader_in_request(c->reader)) {
            deadline = c->t_request + (uint64_t)o->request_timeout_ms;
            if (!kiln_http_reader_headers_done(c->reader) &&
                c->t_request + (uint64_t)o->header_timeout_ms < deadline)
                deadline = c->t_request + (uint64_t)o->header_timeout_ms;
        } else {
            deadline = c->t_state + (uint64_t)o->idle_timeout_ms;
        }
        break;
    case C_WAITING: deadline = c->t_state + (uint64_t)o->body_wait_ms; break;
    case C_WRITING: deadline = c->t_state + (uint64_t)o->write_timeout_ms; break;
    case C_LINGER: deadline = c->t_state + LINGER_MS; break;
    default: uv_timer_stop(&c->timer); return;
    }
    uv_timer_start(&c->timer, on_timer, deadline > now ? deadline - now : 0, 0);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

static void set_reading(kiln_http_conn *c, int on)
{
    if (c->closing || c->eof || c->reading == on)
        return;
    if (on ? uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read)
           : uv_read_stop((uv_stream_t *)&c->tcp)) {
        close_conn(c);
        return;
    }
    c->reading = on;
}

/* Hands the complete request to the handler. */
static void dispatch(kiln_http_conn *c)
{
    kiln_http_request *req = kiln_http_reader_request(c->reader);
    /* A chunked body was charged the route's limit: what it did not use
     * goes back now. */
    if (c->charged > req->body.len + 1) {
        size_t extra = c->charged - req->body.len - 1;
        c->charged -= extra;
        kiln_gw_clients_give_body(c->srv->opts.clients, c->client, extra);
    }
    req->client = c->client;
    conn_rid(c);
    c->state = C_BUSY;
    c->close_after = !req->keep_alive;
    c->head_only = req->method == KILN_HTTP_HEAD;
    uv_timer_stop(&c->timer);
    c->srv->h.on_request(c->srv->ud, c, req);
}

/* The client of the request whose head is in: its bearer token, else its
 * address. */
static uint64_t client_of(const kiln_http_conn *c, const kiln_http_request *req)
{
    const kiln_gw_clients *cl = c->srv->opts.clients;
    const char *a = req->authorization;
    if (strncasecmp(a, "Bearer ", 7) == 0) {
        a += 7;
        while (*a == ' ')
            a++;
        size_t n = strlen(a);
        while (n && (a[n - 1] == ' ' || a[n - 1] == '\t'))
            n--;
        if (n)
            return kiln_gw_client_id(cl, KILN_GW_CLIENT_TOKEN, a, n);
    }
    return c->addr_id;
}

static void body_granted(void *ud)
{
    kiln_http_conn *c = ud;
    c->charged = c->waiter.bytes;
    c->state = C_READING;
    c->t_state = uv_now(c->srv->loop);
    set_reading(c, 1); /* the body, or (whole) a disconnect while it is handled */
    if (c->closing)
        return;
    if (c->whole)
        dispatch(c);
    else
        process(c);
}

/* Once a request's head is in: charges its body to the budget, or makes
 * it wait (reading paused).  1 to go on, 0 when it waits. */
static int admit_body(kiln_http_conn *c, int whole)
{
    kiln_gw_clients *cl = c->srv->opts.clients;
    if (c->admitted || !cl || !kiln_http_reader_headers_done(c->reader))
        return 1;
    c->admitted = 1;
    c->client = client_of(c, kiln_http_reader_request(c->reader));
    size_t need = kiln_http_reader_body_need(c->reader);
    if (!need)
        return 1;
    need++; /* the reader's terminating NUL */
    if (kiln_gw_clients_take_body(cl, c->client, need) == 0) {
        c->charged = need;
        return 1;
    }
    c->state = C_WAITING;
    c->whole = whole;
    c->t_state = uv_now(c->srv->loop);
    set_reading(c, 0);
    kiln_gw_clients_wait_body(cl, &c->waiter, c->client, need, body_granted, c);
    arm(c);
    return 0;
}

/* Gives the handler the request's headers once; 1 when it refused the
 * request (and answered it). */
static int check_headers(kiln_http_conn *c)
{
    if (c->headers_seen || !c->srv->h.on_headers || !kiln_http_reader_headers_done(c->reader))
        return 0;
    c->headers_seen = 1;
    conn_rid(c);
    kiln_http_request *req = kiln_http_reader_request(c->reader);
    /* As if handling it: a refusal is answered like any response, and
     * the rest of the request is never read. */
    c->state = C_BUSY;
    c->close_after = 1;
    c->head_only = req->method == KILN_HTTP_HEAD;
    if (c->srv->h.on_headers(c->srv->ud, c, req))
        return 1;
    c->state = C_READING;
    c->close_after = 0;
    return 0;
}

static void process(kiln_http_conn *c)
{
    while (c->state == C_READING && !c->closing && c->in_off < c->in.len) {
        int was_in_request = kiln_http_reader_in_request(c->reader);
        kiln_http_event ev;
        size_t n = kiln_http_reader_feed(c->reader, (const char *)c->in.data + c->in_off,
                                         c->in.len - c->in_off, &ev);
        c->in_off += n;
        if (!was_in_request && (kiln_http_reader_in_request(c->reader) || ev != KILN_HTTP_NEED_MORE))
            c->t_request = uv_now(c->srv->loop);
        if (ev != KILN_HTTP_ERROR && check_headers(c))
            return; /* answered; the connection closes after it */
        if (kiln_http_reader_take_continue(c->reader)) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            uv_buf_t b = uv_buf_init((char *)cont, sizeof cont - 1);
            /* Best effort: a client that misses it sends the body after
             * its own short wait. */
            if (uv_try_write((uv_stream_t *)&c->tcp, &b, 1) != (int)(sizeof cont - 1))
                KILN_LOG_DEBUG("http: 100 Continue not written in one go");
        }
        if (ev == KILN_HTTP_ERROR) {
            const char *msg;
            int status = kiln_http_reader_error(c->reader, &msg);
            own_error(c, status, own_code(status), msg);
            return;
        }
        if (!admit_body(c, ev == KILN_HTTP_REQUEST))
            return;
        if (ev == KILN_HTTP_REQUEST) {
            dispatch(c);
            return;
        }
    }
    if (c->closing)
        return;
    if (c->in_off == c->in.len)
        c->in_off = c->in.len = 0;
    if (c->state == C_READING && c->eof) {
        close_conn(c); /* the client sent all it will, and no request is whole */
        return;
    }
    set_reading(c, c->state == C_LINGER || c->in.len - c->in_off < PIPELINE_MAX);
    arm(c);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    kiln_http_conn *c = st->data;
    (void)buf;
    if (c->closing)
        return;
    if (nread < 0) {
        /* EOF or an error: a request being handled is abandoned; a
         * response being written finishes first. */
        c->eof = 1;
        c->reading = 0;
        uv_read_stop(st);
        if (c->state != C_WRITING)
            close_conn(c);
        return;
    }
    if (c->state == C_LINGER)
        return; /* discarded: the bytes stay past in.len */
    c->in.len += (size_t)nread;
    if (c->state == C_READING)
        process(c);
    else if (c->in.len - c->in_off >= PIPELINE_MAX)
        set_reading(c, 0);
}

static void reject_closed(uv_handle_t *h)
{
    reject *r = h->data;
    if (++r->n_closed < 2)
        return;
    kiln_http_server *s = r->srv;
    if (r->prev)
        r->prev->next = r->next;
    else
        s->rejects = r->next;
    if (r->next)
        r->next->prev = r->prev;
    s->n_rejects--;
    kiln_buf_free(&r->body);
    free(r);
    maybe_free_server(s);
}

static void reject_close(reject *r)
{
    if (r->closing)
        return;
    r->closing = 1;
    uv_close((uv_handle_t *)&r->tcp, reject_closed);
    uv_close((uv_handle_t *)&r->timer, reject_closed);
}

static void reject_timeout(uv_timer_t *t) { reject_close(t->data); }

static void reject_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    reject *r = h->data;
    (void)suggested;
    *buf = uv_buf_init(r->drain, sizeof r->drain);
}

/* What the client still sends (its request) is read and dropped until it
 * closes or the linger ends. */
static void reject_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    if (nread < 0)
        reject_close(st->data);
}

static void reject_written(uv_write_t *w, int status)
{
    reject *r = w->data;
    if (r->closing)
        return;
    if (status < 0 || uv_shutdown(&r->sreq, (uv_stream_t *)&r->tcp, NULL))
        reject_close(r);
}

static void refuse(kiln_http_server *s)
{
    s->refused++;
    reject *r = calloc(1, sizeof *r);
    if (!r || uv_tcp_init(s->loop, &r->tcp)) {
        free(r);
        return;
    }
    r->srv = s;
    r->tcp.data = r->timer.data = r->wreq.data = r;
    r->next = s->rejects;
    if (s->rejects)
        s->rejects->prev = r;
    s->rejects = r;
    s->n_rejects++;
    if (uv_timer_init(s->loop, &r->timer)) {
        r->closing = r->n_closed = 1;
        uv_close((uv_handle_t *)&r->tcp, reject_closed);
        return;
    }
    if (uv_accept((uv_stream_t *)&s->listener, (uv_stream_t *)&r->tcp)) {
        reject_close(r);
        return;
    }
    s->h.on_own_response(s->ud, 503);
    if (kiln_api_error_json(&r->body, 503, "too many connections", NULL, "too_many_connections",
                            NULL))
        kiln_buf_clear(&r->body);
    char rid[KILN_HTTP_RID_MAX + 1];
    make_rid(s, rid, sizeof rid);
    snprintf(r->head, sizeof r->head,
             "HTTP/1.1 503 Service Unavailable\r\nServer: kiln\r\n"
             "Content-Type: application/json\r\nContent-Length: %zu\r\nX-Request-Id: %s\r\n"
             "Retry-After: 1\r\nConnection: close\r\n\r\n", r->body.len, rid);
    uv_buf_t b[2] = {uv_buf_init(r->head, (unsigned)strlen(r->head)),
                     uv_buf_init((char *)r->body.data, (unsigned)r->body.len)};
    if (s->n_rejects > MAX_REJECTS) {
        if (uv_try_write((uv_stream_t *)&r->tcp, b, 2) < 0)
            KILN_LOG_DEBUG("http: could not tell a refused connection why");
        reject_close(r);
        return;
    }
    if (uv_write(&r->wreq, (uv_stream_t *)&r->tcp, b, r->body.len ? 2 : 1, reject_written) ||
        uv_read_start((uv_stream_t *)&r->tcp, reject_alloc, reject_read) ||
        uv_timer_start(&r->timer, reject_timeout, LINGER_MS, 0))
        reject_close(r);
}

/* Names the peer's address and counts the connection against it; -1 when
 * the address is at its limit. */
static int count_address(kiln_http_conn *c)
{
    struct sockaddr_storage a;
    int len = sizeof a;
    c->addr[0] = '\0';
    if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&a, &len) == 0) {
        if (a.ss_family == AF_INET6)
            uv_ip6_name((struct sockaddr_in6 *)&a, c->addr, sizeof c->addr);
        else
            uv_ip4_name((struct sockaddr_in *)&a, c->addr, sizeof c->addr);
    }
    c->addr_id = kiln_gw_client_id(c->srv->opts.clients, KILN_GW_CLIENT_ADDRESS, c->addr,
                                   strlen(c->addr));
    if (kiln_gw_clients_connect(c->srv->opts.clients, c->addr_id))
        return -1;
    c->counted = 1;
    return 0;
}

static void on_connection(uv_stream_t *l, int status)
{
    kiln_http_server *s = l->data;
    if (status < 0 || s->stopping) {
        KILN_LOG_WARN("http: accept: %s", uv_strerror(status));
        return;
    }
    if (s->n_conns >= s->opts.max_connections) {
        refuse(s);
        return;
    }
    kiln_http_conn *c = calloc(1, sizeof *c);
    kiln_http_reader *r = c ? kiln_http_reader_create(&s->opts.limits, NULL) : NULL;
    if (!r || uv_tcp_init(s->loop, &c->tcp)) {
        kiln_http_reader_destroy(r);
        free(c);
        refuse(s);
        return;
    }
    c->reader = r;
    c->srv = s;
    c->tcp.data = c;
    c->n_closed = 1; /* the timer is not initialised yet: one close to wait for */
    /* Linked first so that close_conn's callback can unlink it. */
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    if (uv_timer_init(s->loop, &c->timer)) {
        c->closing = 1;
        uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
        return;
    }
    c->n_closed = 0;
    c->timer.data = c;
    c->t_state = uv_now(s->loop);
    if (uv_accept(l, (uv_stream_t *)&c->tcp)) {
        close_conn(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    set_reading(c, 1);
    if (s->opts.clients && count_address(c)) {
        /* Over its address's share: told so like a refused connection
         * (and, past MAX_REJECTS of those lingering, closed at once), no
         * longer counted as an open one. */
        c->refused = 1;
        s->n_conns--;
        if (++s->n_rejects > MAX_REJECTS) {
            s->h.on_own_response(s->ud, 503);
            close_conn(c);
            return;
        }
        own_error(c, 503, "too_many_connections", "too many connections from this client");
        return;
    }
    arm(c);
}

static void listener_closed(uv_handle_t *h)
{
    kiln_http_server *s = h->data;
    s->listener_closed = 1;
    maybe_free_server(s);
}

kiln_http_server *kiln_http_server_start(uv_loop_t *loop, const kiln_http_server_opts *opts,
                                         const kiln_http_handlers *h, void *ud, kiln_err *err)
{
    kiln_http_server *s = calloc(1, sizeof *s);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    s->loop = loop;
    s->opts = *opts;
    s->h = *h;
    s->ud = ud;
    struct sockaddr_storage addr;
    int rc = strchr(opts->host, ':')
                 ? uv_ip6_addr(opts->host, opts->port, (struct sockaddr_in6 *)&addr)
                 : uv_ip4_addr(opts->host, opts->port, (struct sockaddr_in *)&addr);
    if (rc) {
        kiln_err_set(err, KILN_ERR_INVALID, "invalid listen address '%s'", opts->host);
        free(s);
        return NULL;
    }
    if ((rc = uv_tcp_init(loop, &s->listener))) {
        kiln_err_set(err, KILN_ERR_IO, "uv_tcp_init: %s", uv_strerror(rc));
        free(s);
        return NULL;
    }
    s->listener.data = s;
    if ((rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0)) ||
        (rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection))) {
        kiln_err_set(err, KILN_ERR_IO, "cannot listen on %s:%d: %s", opts->host, opts->port,
                     uv_strerror(rc));
        /* The handle is registered with the loop: its memory goes in the
         * close callback, on the loop's next run. */
        s->stopping = 1;
        uv_close((uv_handle_t *)&s->listener, listener_closed);
        return NULL;
    }
    struct sockaddr_storage bound;
    int len = sizeof bound;
    if (uv_tcp_getsockname(&s->listener, (struct sockaddr *)&bound, &len) == 0)
        s->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
    return s;
}

int kiln_http_server_port(const kiln_http_server *s)
{
    return s->port;
}

void kiln_http_server_stats_get(const kiln_http_server *s, kiln_http_server_stats *st)
{
    st->connections = s->n_conns;
    st->refused = s->refused;
}

void kiln_http_server_stop(kiln_http_server *s)
{
    if (!s || s->stopping)
        return;
    s->stopping = 1;
    uv_close((uv_handle_t *)&s->listener, listener_closed);
    for (kiln_http_conn *c = s->conns; c; c = c->next)
        close_conn(c);
    for (reject *r = s->rejects; r; r = r->next)
        reject_close(r);
}

void kiln_http_set_pending(kiln_http_conn *c, void *pending)
{
    c->pending = pending;
}

void kiln_http_set_steps(kiln_http_conn *c, int steps)
{
    c->steps = steps;
}

double kiln_http_conn_age_ms(const kiln_http_conn *c)
{
    return (double)(uv_now(c->srv->loop) - c->t_request);
}

void kiln_http_respond(kiln_http_conn *c, int status, const char *content_type,
                       const char *extra_headers, kiln_buf *body)
{
    assert(c->state == C_BUSY && !c->closing);
    c->pending = NULL;
    write_response(c, status, content_type, extra_headers, body);
}

/* ---- streamed answers ---- */

typedef struct stream_write {
    uv_write_t req;
    kiln_http_conn *c;
    kiln_buf buf;
} stream_write;

static void on_stream_written(uv_write_t *w, int status)
{
    stream_write *sw = w->data;
    kiln_http_conn *c = sw->c;
    kiln_buf_free(&sw->buf);
    free(sw);
    if (status < 0 && !c->closing)
        close_conn(c); /* the client is gone: on_abort cancels the request */
}

/* Queues `buf` (taken) on the connection; a failure closes it. */
static void stream_send(kiln_http_conn *c, kiln_buf *buf)
{
    stream_write *sw = calloc(1, sizeof *sw);
    if (!sw || c->closing) {
        free(sw);
        kiln_buf_free(buf);
        if (!c->closing)
            close_conn(c);
        return;
    }
    sw->c = c;
    sw->buf = *buf;
    *buf = (kiln_buf){0};
    sw->req.data = sw;
    uv_buf_t b = uv_buf_init((char *)sw->buf.data, (unsigned)sw->buf.len);
    if (uv_write(&sw->req, (uv_stream_t *)&c->tcp, &b, 1, on_stream_written)) {
        kiln_buf_free(&sw->buf);
        free(sw);
        close_conn(c);
        return;
    }
    /* A client that does not read its stream cannot make the gateway
     * hold its events without end. */
    if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > KILN_HTTP_STREAM_BACKLOG) {
        KILN_LOG_WARN("http: request %s: the client leaves its stream unread; closing", c->rid);
        close_conn(c);
    }
}

/* `body` as one chunk of the chunked encoding (nothing for an empty one:
 * a zero-length chunk would end the body), appended to out; as it is for
 * an HTTP/1.0 client (whose answer ends when the connection closes). */
static int chunk_of(const kiln_http_conn *c, kiln_buf *out, const kiln_buf *body)
{
    if (!body->len)
        return 0;
    if (c->raw_stream)
        return kiln_buf_append(out, body->data, body->len, NULL);
    char size[24];
    int n = snprintf(size, sizeof size, "%zx\r\n", body->len);
    return kiln_buf_append(out, size, (size_t)n, NULL) ||
           kiln_buf_append(out, body->data, body->len, NULL) ||
           kiln_buf_append(out, "\r\n", 2, NULL);
}

void kiln_http_stream_start(kiln_http_conn *c, int status, const char *content_type,
                            const char *extra_headers)
{
    assert(c->state == C_BUSY && !c->closing && !c->streaming);
    c->streaming = 1;
    c->streamed = 0;
    const kiln_http_request *req = kiln_http_reader_request(c->reader);
    c->raw_stream = req && req->http10;
    if (c->srv->stopping || c->raw_stream)
        c->close_after = 1;
    char head[sizeof c->head];
    snprintf(head, sizeof head,
             "HTTP/1.1 %d %s\r\nServer: kiln\r\nContent-Type: %s\r\n"
             "%sX-Request-Id: %s\r\n%sConnection: %s\r\n\r\n",
             status, http_status_str((enum http_status)status), content_type,
             c->raw_stream ? "" : "Transfer-Encoding: chunked\r\n", conn_rid(c),
             extra_headers ? extra_headers : "", c->close_after ? "close" : "keep-alive");
    kiln_buf b = {0};
    if (kiln_buf_append(&b, head, strlen(head), NULL)) {
        close_conn(c);
        return;
    }
    stream_send(c, &b);
}

void kiln_http_stream_write(kiln_http_conn *c, kiln_buf *body)
{
    assert(c->streaming);
    kiln_buf b = {0};
    if (c->closing || chunk_of(c, &b, body)) {
        kiln_buf_free(&b), kiln_buf_free(body);
        if (!c->closing)
            close_conn(c);
        return;
    }
    c->streamed += body->len;
    kiln_buf_free(body);
    if (b.len)
        stream_send(c, &b);
}

void kiln_http_stream_end(kiln_http_conn *c, kiln_buf *body)
{
    assert(c->state == C_BUSY && c->streaming && !c->closing);
    kiln_buf b = {0};
    if (chunk_of(c, &b, body) ||
        (!c->raw_stream && kiln_buf_append(&b, "0\r\n\r\n", 5, NULL))) {
        kiln_buf_free(&b), kiln_buf_free(body);
        close_conn(c);
        return;
    }
    c->streamed += body->len;
    kiln_buf_free(body);
    c->pending = NULL;
    access_log(c, 200, c->streamed);
    if (c->srv->stopping)
        c->close_after = 1;
    /* The tail goes like a whole response's body: on_written then moves
     * on to the next request (or closes). */
    c->body = b;
    uv_buf_t buf = uv_buf_init((char *)c->body.data, (unsigned)c->body.len);
    c->state = C_WRITING;
    c->t_state = uv_now(c->srv->loop);
    c->wreq.data = c;
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &buf, 1, on_written)) {
        kiln_buf_free(&c->body);
        close_conn(c);
        return;
    }
    arm(c);
}

int kiln_http_streaming(const kiln_http_conn *c)
{
    return c->streaming;
}
