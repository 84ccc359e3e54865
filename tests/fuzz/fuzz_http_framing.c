/* libFuzzer target for the gateway's HTTP framing (built with -Dfuzz=true
 * and clang): whether a byte stream is a sequence of requests, and which,
 * must depend on the bytes alone, never on how they arrive.  The input is
 * one connection's bytes; it is fed to kiln_http_reader whole, one byte at
 * a time and in pieces of pseudo-random sizes, and every run must give the
 * same requests (method, path, Content-Type, keep-alive, body) and end the
 * same way (status and message), with NEED_MORE always consuming all it
 * is given and bodies within the limit.  Seed it with the smuggling
 * corpus:
 *   build-fuzz/tests/fuzz/fuzz_http_framing -max_total_time=300 -dict=tests/fuzz/http.dict \
 *       CORPUS_DIR tests/fuzz/http_corpus */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "services/gateway/http_reader.h"

#define MAX_REQUESTS 16

static const kiln_http_limits limits = {.max_header_bytes = 2048, .max_body_bytes = 4096};

typedef struct outcome {
    int n;
    uint64_t digest[MAX_REQUESTS];
    int status;
    char msg[160]; /* copied: the reader owns its message */
} outcome;

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static uint64_t digest(const kiln_http_request *q)
{
    uint64_t h = 14695981039346656037ull;
    h = fnv(h, &q->method, sizeof q->method);
    h = fnv(h, q->method_name, strlen(q->method_name) + 1);
    h = fnv(h, q->path, strlen(q->path) + 1);
    h = fnv(h, q->content_type, strlen(q->content_type) + 1);
    h = fnv(h, &q->keep_alive, sizeof q->keep_alive);
    return fnv(h, q->body.data, q->body.len);
}

/* piece 0: all at once; else sizes from a xorshift seeded with `piece`. */
static void run(const uint8_t *data, size_t len, uint64_t piece, outcome *o)
{
    memset(o, 0, sizeof *o);
    kiln_http_reader *r = kiln_http_reader_create(&limits, NULL);
    if (!r)
        abort();
    size_t off = 0, avail = 0;
    uint64_t x = piece;
    while (off < len && o->n < MAX_REQUESTS) {
        if (off == avail) {
            size_t k = len;
            if (piece) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                k = piece == 1 ? 1 : 1 + x % 97;
            }
            avail = len - avail < k ? len : avail + k;
        }
        kiln_http_event ev;
        size_t given = avail - off;
        size_t n = kiln_http_reader_feed(r, (const char *)data + off, given, &ev);
        if (n > given)
            abort();
        off += n;
        (void)kiln_http_reader_take_continue(r);
        if (ev == KILN_HTTP_ERROR) {
            const char *msg = NULL;
            o->status = kiln_http_reader_error(r, &msg);
            if (!msg || !msg[0] || strlen(msg) >= sizeof o->msg)
                abort();
            strcpy(o->msg, msg);
            break;
        }
        if (ev == KILN_HTTP_REQUEST) {
            kiln_http_request *q = kiln_http_reader_request(r);
            if (!q->body.data || q->body.data[q->body.len] != '\0' ||
                q->body.len > limits.max_body_bytes)
                abort();
            o->digest[o->n++] = digest(q);
            kiln_http_reader_next(r);
        } else if (n != given) {
            abort(); /* NEED_MORE consumes what it is given */
        }
    }
    kiln_http_reader_destroy(r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    outcome whole, other;
    run(data, len, 0, &whole);
    if (whole.status && (whole.status < 400 || whole.status > 505))
        abort();
    const uint64_t pieces[] = {1, 0x9e3779b97f4a7c15ull, 12345};
    for (size_t k = 0; k < sizeof pieces / sizeof pieces[0]; k++) {
        run(data, len, pieces[k], &other);
        if (other.n != whole.n || other.status != whole.status ||
            memcmp(other.digest, whole.digest, sizeof whole.digest) ||
            strcmp(whole.msg, other.msg) != 0)
            abort();
    }
    return 0;
}
