#include "gw_client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

void gwc_response_free(gwc_response *r)
{
    kiln_buf_free(&r->body);
    memset(r, 0, sizeof *r);
}

int gwc_connect(int port)
{
    return gwc_connect_from(port, NULL);
}

int gwc_connect_from(int port, const char *local)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (local) {
        struct sockaddr_in l = {.sin_family = AF_INET};
        if (inet_pton(AF_INET, local, &l.sin_addr) != 1 ||
            bind(fd, (struct sockaddr *)&l, sizeof l)) {
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        close(fd);
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

int gwc_send(int fd, const void *data, size_t len, int timeout_ms)
{
    const char *p = data;
    while (len) {
        struct pollfd pf = {.fd = fd, .events = POLLOUT};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return -1;
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

void gwc_format(kiln_buf *out, const char *method, const char *path, const char *ctype,
                const void *body, size_t len, int close)
{
    gwc_format_h(out, method, path, ctype, NULL, body, len, close);
}

void gwc_format_h(kiln_buf *out, const char *method, const char *path, const char *ctype,
                  const char *extra, const void *body, size_t len, int close)
{
    char head[1024];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s", method, path,
                     extra ? extra : "");
    if (ctype)
        n += snprintf(head + n, sizeof head - (size_t)n, "Content-Type: %s\r\n", ctype);
    if (body || !strcmp(method, "POST"))
        n += snprintf(head + n, sizeof head - (size_t)n, "Content-Length: %zu\r\n", len);
    n += snprintf(head + n, sizeof head - (size_t)n, "%s\r\n", close ? "Connection: close\r\n" : "");
    kiln_buf_append(out, head, (size_t)n, NULL);
    kiln_buf_append(out, body, len, NULL);
}

int gwc_parse(kiln_buf *in, gwc_response *r)
{
    const char *d = (const char *)in->data;
    if (!d)
        return 0;
    const char *end = in->len ? memmem(d, in->len, "\r\n\r\n", 4) : NULL;
    if (!end)
        return in->len > 8192 ? -1 : 0;
    size_t hlen = (size_t)(end - d) + 4;
    int status;
    if (sscanf(d, "HTTP/1.1 %d ", &status) != 1)
        return -1;
    gwc_response tmp = {.status = status};
    snprintf(tmp.headers, sizeof tmp.headers, "%.*s", (int)hlen, d);
    char cl[32];
    if (!gwc_header(&tmp, "Transfer-Encoding", cl, sizeof cl) && !strcmp(cl, "chunked")) {
        /* A streamed answer: chunks up to the zero-length one. */
        size_t at = hlen;
        for (;;) {
            const char *nl = NULL;
            for (size_t k = at; !nl && k + 1 < in->len; k++)
                if (d[k] == '\r' && d[k + 1] == '\n')
                    nl = d + k;
            if (!nl) {
                kiln_buf_free(&tmp.body);
                return 0;
            }
            char *e;
            size_t n = strtoull(d + at, &e, 16);
            if (e == d + at || e != nl) {
                kiln_buf_free(&tmp.body);
                return -1;
            }
            size_t data = (size_t)(nl - d) + 2;
            if (in->len < data + n + 2 || memcmp(d + data + n, "\r\n", 2)) {
                kiln_buf_free(&tmp.body);
                return in->len < data + n + 2 ? 0 : -1;
            }
            at = data + n + 2;
            if (!n)
                break;
            kiln_buf_append(&tmp.body, d + data, n, NULL);
        }
        memmove(in->data, in->data + at, in->len - at);
        in->len -= at;
        *r = tmp;
        return 1;
    }
    if (gwc_header(&tmp, "Content-Length", cl, sizeof cl))
        return -1;
    size_t blen = strtoull(cl, NULL, 10);
    if (status == 100) { /* an interim response: drop it */
        memmove(in->data, in->data + hlen, in->len - hlen);
        in->len -= hlen;
        return gwc_parse(in, r);
    }
    if (in->len < hlen + blen)
        return 0;
    kiln_buf_append(&tmp.body, d + hlen, blen, NULL);
    memmove(in->data, in->data + hlen + blen, in->len - hlen - blen);
    in->len -= hlen + blen;
    *r = tmp;
    return 1;
}

int gwc_read_response(int fd, kiln_buf *in, gwc_response *r, int timeout_ms)
{
    for (;;) {
        int p = gwc_parse(in, r);
        if (p)
            return p > 0 ? 0 : -1;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return -1;
        if (kiln_buf_reserve(in, 65536, NULL))
            return -1;
        ssize_t n = recv(fd, in->data + in->len, 65536, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        in->len += (size_t)n;
    }
}

int gwc_wait_closed(int fd, int timeout_ms)
{
    char buf[4096];
    for (;;) {
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        if (poll(&pf, 1, timeout_ms) <= 0)
            return 0;
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        if (n == 0 || (n < 0 && errno == ECONNRESET))
            return 1;
        if (n < 0)
            return 0;
    }
}

int gwc_request(int port, const char *method, const char *path, const char *ctype,
                const void *body, size_t len, gwc_response *r, int timeout_ms)
{
    return gwc_request_h(port, method, path, ctype, NULL, body, len, r, timeout_ms);
}

int gwc_request_h(int port, const char *method, const char *path, const char *ctype,
                  const char *extra, const void *body, size_t len, gwc_response *r,
                  int timeout_ms)
{
    memset(r, 0, sizeof *r);
    int fd = gwc_connect(port);
    if (fd < 0)
        return -1;
    kiln_buf req = {0}, in = {0};
    gwc_format_h(&req, method, path, ctype, extra, body, len, 1);
    int rc = gwc_send(fd, req.data, req.len, timeout_ms);
    if (!rc)
        rc = gwc_read_response(fd, &in, r, timeout_ms);
    kiln_buf_free(&req);
    kiln_buf_free(&in);
    close(fd);
    return rc;
}

int gwc_header(const gwc_response *r, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    for (const char *line = strstr(r->headers, "\r\n"); line && line[2]; line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (strncasecmp(h, name, nl) == 0 && h[nl] == ':') {
            const char *v = h + nl + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            snprintf(out, cap, "%.*s", (int)(e ? e - v : (long)strlen(v)), v);
            return 0;
        }
    }
    return -1;
}
