/* libFuzzer target for the gateway's request handling (built with
 * -Dfuzz=true and clang).  The first byte picks a mode:
 * - HTTP: the rest is a connection's byte stream, fed to kiln_http_reader
 *   in pieces whose size comes from the second byte; every complete
 *   request goes through kiln_api_parse for the route it names (edits when
 *   the path says so), with its own Content-Type;
 * - JSON / multipart: the rest is a request body for kiln_api_parse
 *   directly (multipart with the boundary "B"), as a generation or an edit;
 * - base64: the rest goes through kiln_base64_decode and, when valid,
 *   must encode back to the canonical form of itself.
 * A parsed request must satisfy what the scheduler relies on (sizes,
 * counts, strings, images); anything else aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "services/gateway/api_request.h"
#include "services/gateway/base64.h"
#include "services/gateway/http_reader.h"

static const kiln_http_limits http_limits = {.max_header_bytes = 4096, .max_body_bytes = 65536};

static kiln_api_config config(void)
{
    kiln_api_config c = {.model_id = "klein-tiny",
                         .traits = {.cfg = 1, .default_steps = 4, .default_guidance = 4.0f,
                                    .shrink_images = 1, .inpaint_strength = 0.8},
                         .limits = KILN_LIMITS_SERVICE,
                         .image_limits = {.max_side = 512, .max_pixels = 1 << 18},
                         .max_body_bytes = 65536};
    c.limits.min_side = 64;
    c.limits.max_side = 1024;
    return c;
}

static void check_request(const kiln_api_request *r, kiln_api_kind kind, const kiln_api_config *c)
{
    const kiln_request *q = &r->plan.req;
    if (q->width % 16 || q->height % 16 || q->width < c->limits.min_side ||
        q->width > c->limits.max_side || q->height < c->limits.min_side ||
        q->height > c->limits.max_side)
        abort();
    if (q->n < 1 || q->n > c->limits.max_n || q->steps < 1 || q->steps > c->limits.max_steps)
        abort();
    if (q->max_sequence_length < 1 || q->max_sequence_length > 512 || q->compression < 0 ||
        q->compression > 100 || !(q->guidance >= 0 && q->guidance <= 100))
        abort();
    if (!r->prompt || q->prompt != r->prompt || !kiln_utf8_valid(r->prompt, strlen(r->prompt)))
        abort();
    if (r->plan.negative && !kiln_utf8_valid(r->plan.negative, strlen(r->plan.negative)))
        abort();
    if ((kind == KILN_API_EDIT) != (r->n_images > 0) || r->n_images > KILN_MAX_REFS)
        abort();
    for (int i = 0; i < r->n_images; i++)
        if (!r->images[i].len || !r->images[i].data)
            abort();
}

static void check_error(const kiln_api_error *e)
{
    if ((e->status != 400 && e->status != 413 && e->status != 500) || !e->err.msg[0] || !e->code)
        abort();
}

static void parse(kiln_api_kind kind, const char *ctype, const uint8_t *body, size_t len)
{
    kiln_api_config c = config();
    kiln_api_request r;
    kiln_api_error e;
    if (kiln_api_parse(kind, ctype, body, len, &c, &r, &e) == KILN_OK) {
        check_request(&r, kind, &c);
        kiln_api_request_free(&r);
    } else {
        check_error(&e);
    }
}

static void http_stream(const uint8_t *data, size_t len)
{
    if (len < 1)
        return;
    size_t piece = 1 + data[0] % 64;
    data++, len--;
    kiln_http_reader *rd = kiln_http_reader_create(&http_limits, NULL);
    if (!rd)
        return;
    size_t off = 0;
    while (off < len) {
        size_t give = len - off < piece ? len - off : piece;
        kiln_http_event ev;
        size_t n = kiln_http_reader_feed(rd, (const char *)data + off, give, &ev);
        if (n > give)
            abort();
        off += n;
        (void)kiln_http_reader_take_continue(rd);
        if (ev == KILN_HTTP_ERROR) {
            const char *msg;
            int st = kiln_http_reader_error(rd, &msg);
            if (st < 400 || st > 505 || !msg)
                abort();
            break;
        }
        if (ev == KILN_HTTP_REQUEST) {
            kiln_http_request *q = kiln_http_reader_request(rd);
            if (!q->body.data || q->body.data[q->body.len] != '\0' ||
                q->body.len > http_limits.max_body_bytes)
                abort();
            kiln_api_kind kind = strstr(q->path, "edits") ? KILN_API_EDIT : KILN_API_GENERATE;
            parse(kind, q->content_type, q->body.data, q->body.len);
            kiln_http_reader_next(rd);
        } else if (n != give) {
            abort(); /* NEED_MORE consumes what it is given */
        }
    }
    kiln_http_reader_destroy(rd);
}

static void base64_roundtrip(const uint8_t *data, size_t len)
{
    kiln_buf out = {0}, back = {0}, again = {0};
    if (kiln_base64_decode((const char *)data, len, &out, NULL) == KILN_OK) {
        if (kiln_base64_encode(out.data, out.len, &back, NULL) ||
            kiln_base64_decode((const char *)back.data, back.len, &again, NULL) ||
            again.len != out.len || (out.len && memcmp(again.data, out.data, out.len)))
            abort();
    } else if (out.len) {
        abort(); /* a failed decode leaves the buffer as it was */
    }
    kiln_buf_free(&out), kiln_buf_free(&back), kiln_buf_free(&again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    if (len < 1)
        return 0;
    uint8_t mode = data[0] % 6;
    data++, len--;
    switch (mode) {
    case 0:
    case 1: http_stream(data, len); break;
    case 2: parse(KILN_API_GENERATE, "application/json", data, len); break;
    case 3: parse(KILN_API_EDIT, "application/json", data, len); break;
    case 4: parse(KILN_API_EDIT, "multipart/form-data; boundary=B", data, len); break;
    default: base64_roundtrip(data, len); break;
    }
    return 0;
}
