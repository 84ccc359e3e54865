/* The gateway's HTTP request reader without sockets: pipelined requests
 * come out one at a time and in order however the bytes are split, bodies
 * by Content-Length or chunks, keep-alive rules, the size limits (413 from
 * the declared length before any body byte, 413 for chunks adding up, 431,
 * 414), malformed requests (400), Expect: 100-continue, and every entry of
 * the request smuggling corpus (tests/fuzz/http_corpus: strict RFC 9112
 * framing) with the outcome its name gives, however it is split. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h>

#include "services/gateway/api_keys.h"
#include "services/gateway/http_reader.h"
#include "tests/test.h"

static const kiln_http_limits limits = {.max_header_bytes = 1024, .max_body_bytes = 100};

typedef struct got {
    int n;
    char paths[8][64];
    char bodies[8][128];
    char ctypes[8][64];
    int keep_alive[8], http10[8];
    kiln_http_method methods[8];
    int error_status;
    int continues;
} got;

/* Feeds `s` in pieces of `chunk` bytes (0: all at once), collecting
 * requests as a server would. */
static void run(const char *s, size_t len, size_t chunk, got *g)
{
    memset(g, 0, sizeof *g);
    kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
    size_t off = 0, avail = chunk ? 0 : len;
    while (off < len && g->n < 8) {
        if (off == avail)
            avail = avail + chunk > len ? len : avail + chunk;
        kiln_http_event ev;
        size_t given = avail - off;
        size_t n = kiln_http_reader_feed(r, s + off, given, &ev);
        off += n;
        g->continues += kiln_http_reader_take_continue(r);
        if (ev == KILN_HTTP_ERROR) {
            const char *msg;
            g->error_status = kiln_http_reader_error(r, &msg);
            CHECK(msg && msg[0]);
            break;
        }
        if (ev == KILN_HTTP_REQUEST) {
            kiln_http_request *q = kiln_http_reader_request(r);
            snprintf(g->paths[g->n], 64, "%.63s", q->path);
            snprintf(g->bodies[g->n], 128, "%.*s", (int)q->body.len,
                     q->body.data ? (char *)q->body.data : "");
            CHECK(q->body.data && q->body.data[q->body.len] == '\0');
            snprintf(g->ctypes[g->n], 64, "%.63s", q->content_type);
            g->keep_alive[g->n] = q->keep_alive;
            g->http10[g->n] = q->http10;
            g->methods[g->n] = q->method;
            g->n++;
            CHECK(!kiln_http_reader_in_request(r));
            kiln_http_reader_next(r);
        } else {
            CHECK(n == given); /* NEED_MORE consumes everything */
        }
    }
    kiln_http_reader_destroy(r);
}

static void test_pipelined(void)
{
    static const char s[] =
        "GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n"
        "POST /v1/images/generations?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        "Content-Length: 13\r\n\r\n{\"prompt\":1}\n"
        "POST /chunked HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        "5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        "HEAD /readyz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    size_t chunks[] = {0, 1, 2, 7, 64};
    for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
        got g;
        run(s, sizeof s - 1, chunks[k], &g);
        CHECKF(g.n == 4 && g.error_status == 0, "chunk %zu: %d requests, error %d", chunks[k], g.n,
               g.error_status);
        CHECK(strcmp(g.paths[0], "/healthz") == 0 && g.methods[0] == KILN_HTTP_GET);
        CHECK(strcmp(g.paths[1], "/v1/images/generations") == 0 && g.methods[1] == KILN_HTTP_POST);
        CHECK(strcmp(g.bodies[1], "{\"prompt\":1}\n") == 0);
        CHECK(strcmp(g.ctypes[1], "application/json") == 0);
        CHECK(strcmp(g.bodies[2], "hello world") == 0);
        CHECK(g.methods[3] == KILN_HTTP_HEAD && !g.keep_alive[3]);
        CHECK(g.keep_alive[0] && g.keep_alive[1] && g.keep_alive[2]);
    }
}

static void test_keep_alive_rules(void)
{
    got g;
    const char *s = "GET / HTTP/1.0\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.n == 1 && !g.keep_alive[0] && g.http10[0]); /* http10: streams unchunked */
    s = "GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.n == 1 && g.keep_alive[0]);
    s = "GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.n == 1 && !g.keep_alive[0] && !g.http10[0]);
}

static void test_limits(void)
{
    got g;
    /* Refused from the declared length, before the body. */
    const char *s = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.n == 0 && g.error_status == 413);
    s = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n";
    char ok[256];
    snprintf(ok, sizeof ok, "%s%0100d", s, 0);
    run(ok, strlen(ok), 3, &g);
    CHECK(g.n == 1 && g.error_status == 0);
    /* Chunks adding up past the limit. */
    s = "POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
        "40\r\n0000000000000000000000000000000000000000000000000000000000000000\r\n"
        "40\r\n0000000000000000000000000000000000000000000000000000000000000000\r\n0\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.n == 0 && g.error_status == 413);
    /* Headers past max_header_bytes: 431; a long target: 414. */
    char big[4096];
    int n = snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: a\r\nX-Pad: ");
    memset(big + n, 'a', 1100);
    strcpy(big + n + 1100, "\r\n\r\n");
    run(big, strlen(big), 0, &g);
    CHECK(g.error_status == 431);
    n = snprintf(big, sizeof big, "GET /");
    memset(big + n, 'a', KILN_HTTP_TARGET_MAX + 1);
    strcpy(big + n + KILN_HTTP_TARGET_MAX + 1, " HTTP/1.1\r\n\r\n");
    kiln_http_limits roomy = {.max_header_bytes = 8192, .max_body_bytes = 10};
    kiln_http_reader *r = kiln_http_reader_create(&roomy, NULL);
    kiln_http_event ev;
    kiln_http_reader_feed(r, big, strlen(big), &ev);
    const char *msg;
    CHECK(ev == KILN_HTTP_ERROR && kiln_http_reader_error(r, &msg) == 414);
    kiln_http_reader_destroy(r);
    /* A Content-Type too long. */
    n = snprintf(big, sizeof big, "POST / HTTP/1.1\r\nHost: a\r\nContent-Type: ");
    memset(big + n, 'a', KILN_HTTP_CTYPE_MAX + 1);
    strcpy(big + n + KILN_HTTP_CTYPE_MAX + 1, "\r\n\r\n");
    r = kiln_http_reader_create(&roomy, NULL);
    kiln_http_reader_feed(r, big, strlen(big), &ev);
    CHECK(ev == KILN_HTTP_ERROR && kiln_http_reader_error(r, &msg) == 431);
    kiln_http_reader_destroy(r);
}

static size_t route_limit(void *ud, const kiln_http_request *head)
{
    (void)ud;
    return strcmp(head->path, "/small") == 0 ? 10 : 1000;
}

/* A route's own body limit, asked with the request's head: refused from
 * Content-Length (naming the limit) or as chunks add up; capped by
 * max_body_bytes. */
static void test_route_limits(void)
{
    kiln_http_limits lim = limits;
    lim.body_limit = route_limit;
    static const struct {
        const char *req;
        int status;
    } cases[] = {
        {"POST /small HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\n", 413},
        {"POST /small?x HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n0123456789", 0},
        {"POST /small HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
         "6\r\nabcdef\r\n6\r\nabcdef\r\n0\r\n\r\n", 413},
        {"POST /big HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n", -1},
        {"POST /big HTTP/1.1\r\nHost: a\r\nContent-Length: 101\r\n\r\n", 413},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_http_reader *r = kiln_http_reader_create(&lim, NULL);
        kiln_http_event ev;
        kiln_http_reader_feed(r, cases[i].req, strlen(cases[i].req), &ev);
        const char *msg = "";
        int st = ev == KILN_HTTP_ERROR ? kiln_http_reader_error(r, &msg) : ev == KILN_HTTP_REQUEST ? 0 : -1;
        CHECKF(st == cases[i].status, "case %zu: %d", i, st);
        if (st == 413)
            CHECKF(strstr(msg, "at most") != NULL, "case %zu: %s", i, msg);
        kiln_http_reader_destroy(r);
    }
}

static void test_malformed(void)
{
    static const char *bad[] = {
        "GARBAGE\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        "GET / HTTP/1.1\r\nHost: a\r\nBad Header\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Type: a\r\nContent-Type: b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        got g;
        run(bad[i], strlen(bad[i]), 0, &g);
        CHECKF(g.error_status == 400, "case %zu: status %d, %d requests", i, g.error_status, g.n);
    }
    got g;
    run("GET / HTTP/2.0\r\n\r\n", 18, 0, &g);
    CHECK(g.error_status == 505 && g.n == 0);
    /* Feeding after an error keeps reporting it. */
    kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
    kiln_http_event ev;
    kiln_http_reader_feed(r, "XX\r\n\r\n", 6, &ev);
    CHECK(ev == KILN_HTTP_ERROR);
    CHECK(kiln_http_reader_feed(r, "GET / HTTP/1.1\r\nHost: a\r\n\r\n", 27, &ev) == 0 && ev == KILN_HTTP_ERROR);
    kiln_http_reader_destroy(r);
}

static void test_expect_continue(void)
{
    got g;
    /* Byte by byte, so the headers are in before the body. */
    const char *s = "POST /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\nabc";
    run(s, strlen(s), 1, &g);
    CHECK(g.n == 1 && g.continues == 1 && strcmp(g.bodies[0], "abc") == 0);
    /* Not for a refused body, nor without a body. */
    s = "POST /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1000\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.continues == 0 && g.error_status == 413);
    s = "GET /x HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n";
    run(s, strlen(s), 0, &g);
    CHECK(g.continues == 0 && g.n == 1);
}

static void test_in_request(void)
{
    kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
    kiln_http_event ev;
    CHECK(!kiln_http_reader_in_request(r));
    kiln_http_reader_feed(r, "POST / HTTP/1.1\r\nHost: a\r\nContent-", 34, &ev);
    CHECK(ev == KILN_HTTP_NEED_MORE && kiln_http_reader_in_request(r));
    CHECK(!kiln_http_reader_headers_done(r));
    kiln_http_reader_feed(r, "Length: 4\r\n\r\nab", 15, &ev);
    CHECK(ev == KILN_HTTP_NEED_MORE && kiln_http_reader_headers_done(r));
    kiln_http_reader_feed(r, "cd", 2, &ev);
    CHECK(ev == KILN_HTTP_REQUEST && !kiln_http_reader_in_request(r));
    /* The handler may take the body away. */
    kiln_http_request *q = kiln_http_reader_request(r);
    kiln_buf body = q->body;
    q->body = (kiln_buf){0};
    CHECK(body.len == 4 && memcmp(body.data, "abcd", 4) == 0);
    kiln_buf_free(&body);
    kiln_http_reader_next(r);
    CHECK(!kiln_http_reader_in_request(r) && !kiln_http_reader_headers_done(r));
    kiln_http_reader_destroy(r);
}

/* A corpus entry is named r<N>_<status|ok>_<what>.http: N requests come
 * out, then the reader stops with that status (ok: none). */
static void replay_entry(const char *dir, const char *name)
{
    int want_n, want_status = 0;
    char what[16];
    if (sscanf(name, "r%d_%15[^_]_", &want_n, what) != 2 ||
        (strcmp(what, "ok") != 0 && sscanf(what, "%d", &want_status) != 1)) {
        CHECKF(0, "corpus entry %s is not named r<N>_<status|ok>_<what>.http", name);
        return;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    char data[4096];
    size_t len = f ? fread(data, 1, sizeof data, f) : 0;
    if (f)
        fclose(f);
    CHECKF(len > 0 && len < sizeof data, "%s: cannot read it", path);
    size_t chunks[] = {0, 1, 2, 5, 17};
    for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
        got g;
        run(data, len, chunks[k], &g);
        CHECKF(g.n == want_n && g.error_status == want_status,
               "%s in pieces of %zu: %d requests and status %d, want %d and %d", name, chunks[k],
               g.n, g.error_status, want_n, want_status);
    }
}

static void test_smuggling_corpus(void)
{
    const char *src = getenv("KILN_SOURCE_ROOT");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tests/fuzz/http_corpus", src ? src : ".");
    DIR *d = opendir(dir);
    CHECKF(d != NULL, "cannot open %s", dir);
    if (!d)
        return;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strlen(e->d_name) > 5 && strcmp(e->d_name + strlen(e->d_name) - 5, ".http") == 0) {
            replay_entry(dir, e->d_name);
            n++;
        }
    closedir(d);
    CHECKF(n >= 80, "only %d corpus entries in %s", n, dir);
}

/* What the client is told for the framing errors a proxy would read
 * differently: the message names the rule. */
static void test_strict_messages(void)
{
    static const struct {
        const char *req, *msg;
    } cases[] = {
        {"GET / HTTP/1.1\r\nHost: a\r\nContent-Length : 1\r\n\r\nx", "colon"},
        {"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", "obs-fold"},
        {"GET / HTTP/1.1\r\n\r\n", "Host"},
        {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
         "Content-Length"},
        {"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxyz", "CRLF"},
        {"FOO / HTTP/1.1\r\nHost: a\r\n\r\n", "not implemented"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
        kiln_http_event ev;
        kiln_http_reader_feed(r, cases[i].req, strlen(cases[i].req), &ev);
        const char *msg = "";
        int st = ev == KILN_HTTP_ERROR ? kiln_http_reader_error(r, &msg) : 0;
        CHECKF(st >= 400 && strcasestr(msg, cases[i].msg), "case %zu: status %d, message '%s'", i, st,
               msg);
        kiln_http_reader_destroy(r);
    }
}

/* The Authorization header: available once the headers are in (before
 * the body), split anywhere; repeated or over-long ones are emptied (no
 * key can match them); the next request starts without it. */
static void test_authorization(void)
{
    const char *s = "POST /v1/x HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer abc\r\n"
                    "Content-Length: 2\r\n\r\nhi"
                    "GET /y HTTP/1.1\r\nHost: a\r\n\r\n";
    for (size_t chunk = 0; chunk <= 1; chunk++) { /* whole, and byte by byte */
        kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
        kiln_http_event ev = KILN_HTTP_NEED_MORE;
        size_t off = 0, len = strlen(s);
        int seen_early = 0;
        while (ev == KILN_HTTP_NEED_MORE && off < len) {
            size_t give = chunk && len - off > chunk ? chunk : len - off;
            off += kiln_http_reader_feed(r, s + off, give, &ev);
            if (ev == KILN_HTTP_NEED_MORE && kiln_http_reader_headers_done(r))
                seen_early |= !strcmp(kiln_http_reader_request(r)->authorization, "Bearer abc");
        }
        CHECK(ev == KILN_HTTP_REQUEST);
        CHECK(!strcmp(kiln_http_reader_request(r)->authorization, "Bearer abc"));
        CHECK(!chunk || seen_early);
        kiln_http_reader_next(r);
        kiln_http_reader_feed(r, s + off, len - off, &ev);
        CHECK(ev == KILN_HTTP_REQUEST && kiln_http_reader_request(r)->authorization[0] == '\0');
        kiln_http_reader_destroy(r);
    }
    kiln_http_limits big = {.max_header_bytes = 8192, .max_body_bytes = 100};
    kiln_http_reader *r = kiln_http_reader_create(&big, NULL);
    kiln_http_event ev;
    const char *twice =
        "GET / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n";
    kiln_http_reader_feed(r, twice, strlen(twice), &ev);
    CHECK(ev == KILN_HTTP_REQUEST && kiln_http_reader_request(r)->authorization[0] == '\0');
    kiln_http_reader_next(r);
    char lng[4096];
    int n = snprintf(lng, sizeof lng, "GET / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer %0*d\r\n\r\n",
                     KILN_HTTP_AUTH_MAX, 0);
    kiln_http_reader_feed(r, lng, (size_t)n, &ev);
    CHECK(ev == KILN_HTTP_REQUEST && kiln_http_reader_request(r)->authorization[0] == '\0');
    kiln_http_reader_destroy(r);
}

/* X-Request-Id: a usable client id is kept (trailing blanks dropped),
 * one too long, with characters that could forge a header or log line,
 * or given twice is dropped (the server then makes its own). */
static void test_request_id(void)
{
    kiln_http_limits big = {.max_header_bytes = 8192, .max_body_bytes = 100};
    char lng[256];
    snprintf(lng, sizeof lng, "%0*d", KILN_HTTP_RID_MAX + 1, 0);
    static const char ok64[] = "0123456789012345678901234567890123456789012345678901234567890123";
    const struct {
        const char *headers, *want;
    } cases[] = {
        {"X-Request-Id: client-7f:a/b+c=d@e.f_g\r\n", "client-7f:a/b+c=d@e.f_g"},
        {"x-request-id:  abc  \r\n", "abc"},
        {"X-Request-Id: a b\r\n", ""},
        {"X-Request-Id: a\"b\r\n", ""},
        {"X-Request-Id: caf\xc3\xa9\r\n", ""},
        {"X-Request-Id: \r\n", ""},
        {"X-Request-Id: a\r\nX-Request-Id: a\r\n", ""},
        {NULL, ok64},
        {NULL, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char req[512], hdr[300];
        if (cases[i].headers)
            snprintf(hdr, sizeof hdr, "%s", cases[i].headers);
        else
            snprintf(hdr, sizeof hdr, "X-Request-Id: %s\r\n", i == 7 ? ok64 : lng);
        int n = snprintf(req, sizeof req, "GET / HTTP/1.1\r\nHost: a\r\n%s\r\n", hdr);
        for (size_t chunk = 0; chunk <= 1; chunk++) {
            kiln_http_reader *r = kiln_http_reader_create(&big, NULL);
            kiln_http_event ev = KILN_HTTP_NEED_MORE;
            size_t off = 0;
            while (ev == KILN_HTTP_NEED_MORE && off < (size_t)n)
                off += kiln_http_reader_feed(r, req + off, chunk ? 1 : (size_t)n - off, &ev);
            CHECK(ev == KILN_HTTP_REQUEST);
            const char *got = kiln_http_reader_request(r)->request_id;
            CHECKF(strcmp(got, cases[i].want) == 0, "case %zu: '%s'", i, got);
            kiln_http_reader_next(r);
            CHECK(kiln_http_reader_request(r)->request_id[0] == '\0');
            kiln_http_reader_destroy(r);
        }
    }
}

/* API key files and the bearer check. */
static void test_api_keys(void)
{
    char path[64];
    snprintf(path, sizeof path, "/tmp/kiln-test-apikeys-%ld", (long)getpid());
    kiln_err err = {0};
    static const struct {
        const char *text;
        int ok;
    } cases[] = {
        {"# rotation: old and new\nkey-old-0123456789\n\n  key-new-0123456789  \n", 1},
        {"", 0},                                  /* no key */
        {"# nothing\n", 0},                       /* no key */
        {"short\n", 0},                           /* under 16 characters */
        {"has a space in it 0123\n", 0},          /* spaces */
        {"k\x01y0123456789012345\n", 0},          /* control character */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        FILE *f = fopen(path, "w");
        CHECK(f && fputs(cases[i].text, f) >= 0);
        if (f)
            fclose(f);
        kiln_api_keys *k = kiln_api_keys_load(path, &err);
        CHECKF(!k == !cases[i].ok, "case %zu: %s", i, err.msg);
        if (!cases[i].ok)
            CHECK(err.code == KILN_ERR_INVALID && strstr(err.msg, path));
        kiln_api_keys_free(k);
    }
    FILE *f = fopen(path, "w");
    CHECK(f && fputs(cases[0].text, f) >= 0);
    if (f)
        fclose(f);
    kiln_api_keys *k = kiln_api_keys_load(path, &err);
    CHECK(k != NULL);
    if (k) {
        CHECK(kiln_api_keys_check(k, "Bearer key-old-0123456789"));
        CHECK(kiln_api_keys_check(k, "bearer   key-new-0123456789 "));
        CHECK(!kiln_api_keys_check(k, NULL));
        CHECK(!kiln_api_keys_check(k, ""));
        CHECK(!kiln_api_keys_check(k, "key-old-0123456789"));
        CHECK(!kiln_api_keys_check(k, "Basic key-old-0123456789"));
        CHECK(!kiln_api_keys_check(k, "Bearer key-old-012345678"));
        CHECK(!kiln_api_keys_check(k, "Bearer key-old-01234567890"));
        CHECK(!kiln_api_keys_check(k, "Bearer "));
    }
    kiln_api_keys_free(k);
    unlink(path);
    CHECK(kiln_api_keys_load(path, &err) == NULL && err.code == KILN_ERR_NOT_FOUND);
}

int main(void)
{
    RUN(test_pipelined);
    RUN(test_keep_alive_rules);
    RUN(test_limits);
    RUN(test_route_limits);
    RUN(test_malformed);
    RUN(test_expect_continue);
    RUN(test_in_request);
    RUN(test_smuggling_corpus);
    RUN(test_strict_messages);
    RUN(test_authorization);
    RUN(test_request_id);
    RUN(test_api_keys);
    return test_finish();
}
