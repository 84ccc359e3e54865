#include "bench_http.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <http_parser.h>

#define MAX_BODY (512u << 20)

struct kiln_http_client {
    char host[256];
    int port;
    double timeout_s;
    int fd; /* -1 when not connected */
};

kiln_status kiln_http_parse_url(const char *url, char *host, size_t host_len, int *port,
                                kiln_err *err)
{
    static const char scheme[] = "http://";
    if (strncmp(url, scheme, sizeof scheme - 1))
        return kiln_err_set(err, KILN_ERR_INVALID, "url must start with http:// (got '%s')", url);
    const char *h = url + sizeof scheme - 1, *end;
    if (*h == '[') {
        end = strchr(++h, ']');
        if (!end)
            return kiln_err_set(err, KILN_ERR_INVALID, "url '%s': unclosed [", url);
    } else {
        end = h + strcspn(h, ":/");
    }
    size_t n = (size_t)(end - h);
    if (!n || n >= host_len)
        return kiln_err_set(err, KILN_ERR_INVALID, "url '%s': bad host", url);
    memcpy(host, h, n);
    host[n] = '\0';
    const char *p = end + (*end == ']');
    *port = 80;
    if (*p == ':') {
        char *e;
        long v = strtol(p + 1, &e, 10);
        if (e == p + 1 || v < 1 || v > 65535)
            return kiln_err_set(err, KILN_ERR_INVALID, "url '%s': bad port", url);
        *port = (int)v;
        p = e;
    }
    if (*p && strcmp(p, "/"))
        return kiln_err_set(err, KILN_ERR_INVALID, "url '%s': give the server only, no path", url);
    return KILN_OK;
}

kiln_http_client *kiln_http_client_create(const char *url, double timeout_s, kiln_err *err)
{
    kiln_http_client *c = calloc(1, sizeof *c);
    if (!c) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (kiln_http_parse_url(url, c->host, sizeof c->host, &c->port, err)) {
        free(c);
        return NULL;
    }
    c->timeout_s = timeout_s;
    c->fd = -1;
    return c;
}

static void disconnect(kiln_http_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
}

void kiln_http_client_destroy(kiln_http_client *c)
{
    if (!c)
        return;
    disconnect(c);
    free(c);
}

static kiln_status connect_to(kiln_http_client *c, kiln_err *err)
{
    char port[16];
    snprintf(port, sizeof port, "%d", c->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res;
    int rc = getaddrinfo(c->host, port, &hints, &res);
    if (rc)
        return kiln_err_set(err, KILN_ERR_IO, "%s: %s", c->host, gai_strerror(rc));
    struct timeval tv = {.tv_sec = (time_t)c->timeout_s,
                         .tv_usec = (suseconds_t)((c->timeout_s - (double)(time_t)c->timeout_s) * 1e6)};
    int e = 0;
    for (struct addrinfo *a = res; a && c->fd < 0; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            e = errno;
            continue;
        }
        int one = 1;
        /* SO_SNDTIMEO also bounds connect() on Linux. */
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) ||
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) ||
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) ||
            connect(fd, a->ai_addr, a->ai_addrlen)) {
            e = errno;
            close(fd);
            continue;
        }
        c->fd = fd;
    }
    freeaddrinfo(res);
    if (c->fd < 0)
        return kiln_err_set(err, KILN_ERR_IO, "cannot connect to %s:%d: %s", c->host, c->port,
                            strerror(e));
    return KILN_OK;
}

static kiln_status send_all(kiln_http_client *c, const void *p, size_t n, kiln_err *err)
{
    const char *b = p;
    while (n) {
        ssize_t k = send(c->fd, b, n, MSG_NOSIGNAL);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return kiln_err_set(err, KILN_ERR_IO, "send: %s",
                                k < 0 ? strerror(errno) : "connection closed");
        b += k;
        n -= (size_t)k;
    }
    return KILN_OK;
}

typedef struct reader {
    kiln_buf *body;
    int done;
    kiln_status st;
    kiln_err *err;
} reader;

static int on_body(http_parser *p, const char *at, size_t n)
{
    reader *r = p->data;
    if (r->body->len + n > MAX_BODY) {
        r->st = kiln_err_set(r->err, KILN_ERR_TOO_LARGE, "response body over %u MiB",
                             MAX_BODY >> 20);
        return 1;
    }
    if ((r->st = kiln_buf_append(r->body, at, n, r->err)))
        return 1;
    return 0;
}

static int on_complete(http_parser *p)
{
    ((reader *)p->data)->done = 1;
    http_parser_pause(p, 1); /* bytes after the message belong to no request */
    return 0;
}

/* One attempt.  *stale is set when the connection was found closed or
 * reset before any byte of a response: the server closed it while idle, so
 * sending again is safe. */
static kiln_status attempt(kiln_http_client *c, const kiln_buf *req, int *status, kiln_buf *resp,
                           int *stale, kiln_err *err)
{
    int got = 0;
    *stale = 0;
    kiln_buf_clear(resp);
    kiln_status st = send_all(c, req->data, req->len, err);
    if (st) {
        *stale = errno == EPIPE || errno == ECONNRESET;
        return st;
    }
    http_parser_settings s;
    http_parser_settings_init(&s);
    s.on_body = on_body;
    s.on_message_complete = on_complete;
    http_parser p;
    http_parser_init(&p, HTTP_RESPONSE);
    reader r = {resp, 0, KILN_OK, err};
    p.data = &r;
    char buf[65536];
    while (!r.done) {
        ssize_t k = recv(c->fd, buf, sizeof buf, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno == ECONNRESET && !got)
            *stale = 1;
        if (k < 0)
            return kiln_err_set(err, KILN_ERR_IO, "receive: %s",
                                errno == EAGAIN || errno == EWOULDBLOCK ? "timed out"
                                                                        : strerror(errno));
        if (k > 0)
            got = 1;
        size_t used = http_parser_execute(&p, &s, buf, (size_t)k);
        if (r.st)
            return r.st;
        if (r.done)
            break;
        if (HTTP_PARSER_ERRNO(&p) != HPE_OK || used != (size_t)k)
            return kiln_err_set(err, KILN_ERR_FORMAT, "bad HTTP response: %s",
                                http_errno_description(HTTP_PARSER_ERRNO(&p)));
        if (k == 0) {
            *stale = !got;
            return kiln_err_set(err, KILN_ERR_IO, "connection closed %s",
                                got ? "mid-response" : "before a response");
        }
    }
    *status = (int)p.status_code;
    if (!http_should_keep_alive(&p))
        disconnect(c);
    return KILN_OK;
}

/* The request's bytes: head and body. */
static kiln_status format_request(const kiln_http_client *c, const char *method, const char *path,
                                  const char *ctype, const void *body, size_t len, kiln_buf *req,
                                  kiln_err *err)
{
    char head[1024];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: %s:%d\r\nUser-Agent: kiln-bench\r\n"
                      "Accept: */*\r\n%s%s%sContent-Length: %zu\r\n\r\n",
                      method, path, c->host, c->port, ctype ? "Content-Type: " : "",
                      ctype ? ctype : "", ctype ? "\r\n" : "", len);
    if (hn < 0 || (size_t)hn >= sizeof head)
        return kiln_err_set(err, KILN_ERR_INVALID, "request line too long");
    kiln_status st = kiln_buf_append(req, head, (size_t)hn, err);
    if (!st)
        st = kiln_buf_append(req, body, len, err);
    return st;
}

kiln_status kiln_http_send_and_drop(kiln_http_client *c, const char *method, const char *path,
                                    const char *ctype, const void *body, size_t len,
                                    double after_s, int reset, int *answered, kiln_err *err)
{
    *answered = 0;
    disconnect(c); /* a connection of its own, so the drop reaches this request */
    kiln_buf req = {0};
    kiln_status st = format_request(c, method, path, ctype, body, len, &req, err);
    if (!st)
        st = connect_to(c, err);
    if (!st)
        st = send_all(c, req.data, req.len, err);
    kiln_buf_free(&req);
    if (!st) {
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int ms = after_s > 0 ? (int)(after_s * 1000) : 0, rc;
        while ((rc = poll(&p, 1, ms)) < 0 && errno == EINTR) {
        }
        *answered = rc > 0;
        if (reset) {
            struct linger l = {1, 0}; /* close() sends RST instead of FIN */
            setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        }
    }
    disconnect(c);
    return st;
}

kiln_status kiln_http_request(kiln_http_client *c, const char *method, const char *path,
                              const char *ctype, const void *body, size_t len, int *status,
                              kiln_buf *resp, kiln_err *err)
{
    kiln_buf req = {0};
    kiln_status st = format_request(c, method, path, ctype, body, len, &req, err);
    for (int tries = 0; !st; tries++) {
        int reused = c->fd >= 0, stale = 0;
        if (!reused && (st = connect_to(c, err)))
            break;
        st = attempt(c, &req, status, resp, &stale, err);
        if (st)
            disconnect(c);
        if (!st || !reused || !stale || tries)
            break;
        st = KILN_OK;
        kiln_err_clear(err);
    }
    kiln_buf_free(&req);
    return st;
}
