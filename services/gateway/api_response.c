#include "api_response.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "base64.h"
#include "engine/request.h"

const char *kiln_api_error_type(int status)
{
    if (status == 429)
        return "rate_limit_error";
    return status >= 500 ? "server_error" : "invalid_request_error";
}

static kiln_status append_str(kiln_buf *out, const char *s, kiln_err *err)
{
    return kiln_buf_append(out, s, strlen(s), err);
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when invalid. */
static size_t utf8_seq(const unsigned char *s, size_t left)
{
    size_t n = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3
                                : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
    if (!n || n > left || !kiln_utf8_valid((const char *)s, n))
        return 0;
    return n;
}

kiln_status kiln_json_append_string(kiln_buf *out, const char *s, size_t len, kiln_err *err)
{
    size_t start = out->len;
    const unsigned char *p = (const unsigned char *)s;
    kiln_status st = kiln_buf_reserve(out, len + 2, err);
    if (!st)
        st = kiln_buf_append(out, "\"", 1, err);
    for (size_t k = 0; !st && k < len;) {
        unsigned char c = p[k];
        char esc[8];
        const char *rep = NULL;
        size_t adv = 1;
        if (c == '"')
            rep = "\\\"";
        else if (c == '\\')
            rep = "\\\\";
        else if (c == '\n')
            rep = "\\n";
        else if (c == '\r')
            rep = "\\r";
        else if (c == '\t')
            rep = "\\t";
        else if (c < 0x20 || c == 0x7f) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            rep = esc;
        } else if (c >= 0x80 && !(adv = utf8_seq(p + k, len - k))) {
            rep = "\\ufffd";
            adv = 1;
        }
        st = rep ? append_str(out, rep, err) : kiln_buf_append(out, p + k, adv, err);
        k += adv;
    }
    if (!st)
        st = kiln_buf_append(out, "\"", 1, err);
    if (st)
        out->len = start;
    return st;
}

kiln_status kiln_api_error_json(kiln_buf *out, int status, const char *message, const char *param,
                                const char *code, kiln_err *err)
{
    size_t start = out->len;
    kiln_status st = append_str(out, "{\"error\":{\"message\":", err);
    if (!st)
        st = kiln_json_append_string(out, message, strlen(message), err);
    if (!st)
        st = append_str(out, ",\"type\":", err);
    if (!st) {
        const char *t = kiln_api_error_type(status);
        st = kiln_json_append_string(out, t, strlen(t), err);
    }
    if (!st)
        st = append_str(out, ",\"param\":", err);
    if (!st)
        st = param && *param ? kiln_json_append_string(out, param, strlen(param), err)
                             : append_str(out, "null", err);
    if (!st)
        st = append_str(out, ",\"code\":", err);
    if (!st)
        st = code && *code ? kiln_json_append_string(out, code, strlen(code), err)
                           : append_str(out, "null", err);
    if (!st)
        st = append_str(out, "}}", err);
    if (st)
        out->len = start;
    return st;
}

kiln_status kiln_api_usage_json(kiln_buf *out, const kiln_api_usage *u, kiln_err *err)
{
    char tmp[256];
    int64_t in = u->text_tokens + u->image_tokens;
    snprintf(tmp, sizeof tmp,
             "{\"input_tokens\":%" PRId64 ",\"input_tokens_details\":{\"image_tokens\":%" PRId64
             ",\"text_tokens\":%" PRId64 "},\"output_tokens\":%" PRId64
             ",\"total_tokens\":%" PRId64 "}",
             in, u->image_tokens, u->text_tokens, u->output_tokens, in + u->output_tokens);
    return append_str(out, tmp, err);
}

kiln_status kiln_api_images_json(kiln_buf *out, const kiln_api_images_meta *m,
                                 const kiln_api_image *images, int n, kiln_err *err)
{
    size_t start = out->len, total = 512;
    for (int i = 0; i < n; i++)
        total += kiln_base64_encoded_len(images[i].len) + 96;
    kiln_status st = kiln_buf_reserve(out, total, err);
    char tmp[200];
    if (!st) {
        snprintf(tmp, sizeof tmp, "{\"created\":%" PRId64 ",\"data\":[", m->created);
        st = append_str(out, tmp, err);
    }
    for (int i = 0; !st && i < n; i++) {
        st = append_str(out, i ? ",{\"b64_json\":\"" : "{\"b64_json\":\"", err);
        if (!st)
            st = kiln_base64_encode(images[i].data, images[i].len, out, err);
        if (!st) {
            snprintf(tmp, sizeof tmp, "\",\"seed\":%" PRIu64 ",\"revised_prompt\":null}",
                     images[i].seed);
            st = append_str(out, tmp, err);
        }
    }
    if (!st) {
        /* quality and background are kiln's own static strings. */
        snprintf(tmp, sizeof tmp,
                 "],\"background\":\"%s\",\"output_format\":\"%s\",\"quality\":\"%s\","
                 "\"size\":\"%dx%d\",\"usage\":",
                 m->background ? m->background : "opaque", kiln_image_format_name(m->format),
                 m->quality ? m->quality : "auto", m->width, m->height);
        st = append_str(out, tmp, err);
    }
    if (!st)
        st = kiln_api_usage_json(out, &m->usage, err);
    if (!st)
        st = append_str(out, "}", err);
    if (st)
        out->len = start;
    return st;
}

/* One SSE event's start up to its image: 'event: TYPE', then the data
 * object's type and its b64_json string, left open for the fields after it. */
static kiln_status event_image_head(kiln_buf *out, const char *type, const kiln_api_image *image,
                                    kiln_err *err)
{
    char tmp[128];
    snprintf(tmp, sizeof tmp, "event: %s\ndata: {\"type\":\"%s\",\"b64_json\":\"", type, type);
    kiln_status st = append_str(out, tmp, err);
    return st ? st : kiln_base64_encode(image->data, image->len, out, err);
}

kiln_status kiln_api_stream_events(kiln_buf *out, const kiln_api_images_meta *m,
                                   const kiln_api_image *images, int n, int edit, kiln_err *err)
{
    size_t start = out->len, total = 256;
    for (int i = 0; i < n; i++)
        total += kiln_base64_encoded_len(images[i].len) + 600;
    kiln_status st = kiln_buf_reserve(out, total, err);
    const char *type = edit ? "image_edit.completed" : "image_generation.completed";
    char tmp[400];
    for (int i = 0; !st && i < n; i++) {
        st = event_image_head(out, type, &images[i], err);
        if (!st) {
            snprintf(tmp, sizeof tmp,
                     "\",\"background\":\"%s\",\"created_at\":%" PRId64
                     ",\"output_format\":\"%s\",\"quality\":\"%s\",\"size\":\"%dx%d\","
                     "\"seed\":%" PRIu64 ",\"usage\":",
                     m->background ? m->background : "opaque", m->created,
                     kiln_image_format_name(m->format), m->quality ? m->quality : "auto",
                     m->width, m->height, images[i].seed);
            st = append_str(out, tmp, err);
        }
        if (!st) {
            kiln_api_usage u = {.output_tokens = n ? m->usage.output_tokens / n : 0};
            if (i == 0)
                u.text_tokens = m->usage.text_tokens, u.image_tokens = m->usage.image_tokens,
                u.output_tokens = m->usage.output_tokens - (n - 1) * u.output_tokens;
            st = kiln_api_usage_json(out, &u, err);
        }
        if (!st)
            st = append_str(out, "}\n\n", err);
    }
    if (st)
        out->len = start;
    return st;
}

kiln_status kiln_api_partial_events(kiln_buf *out, const kiln_api_images_meta *m,
                                    const kiln_api_image *images, int n, int index, int edit,
                                    kiln_err *err)
{
    size_t start = out->len, total = 256;
    for (int i = 0; i < n; i++)
        total += kiln_base64_encoded_len(images[i].len) + 400;
    kiln_status st = kiln_buf_reserve(out, total, err);
    const char *type = edit ? "image_edit.partial_image" : "image_generation.partial_image";
    char tmp[400];
    for (int i = 0; !st && i < n; i++) {
        st = event_image_head(out, type, &images[i], err);
        if (!st) {
            snprintf(tmp, sizeof tmp,
                     "\",\"background\":\"%s\",\"created_at\":%" PRId64
                     ",\"output_format\":\"%s\",\"partial_image_index\":%d,\"quality\":\"%s\","
                     "\"size\":\"%dx%d\",\"seed\":%" PRIu64 "}\n\n",
                     m->background ? m->background : "opaque", m->created,
                     kiln_image_format_name(m->format), index, m->quality ? m->quality : "auto",
                     m->width, m->height, images[i].seed);
            st = append_str(out, tmp, err);
        }
    }
    if (st)
        out->len = start;
    return st;
}

kiln_status kiln_api_stream_error(kiln_buf *out, int status, const char *message,
                                  const char *code, kiln_err *err)
{
    size_t start = out->len;
    kiln_buf obj = {0};
    kiln_status st = kiln_api_error_json(&obj, status, message, NULL, code, err);
    /* {"error":{...}} becomes {"type":"error","error":{...}} */
    if (!st)
        st = append_str(out, "event: error\ndata: {\"type\":\"error\",", err);
    if (!st && obj.len > 1)
        st = kiln_buf_append(out, obj.data + 1, obj.len - 1, err);
    if (!st)
        st = append_str(out, "\n\n", err);
    kiln_buf_free(&obj);
    if (st)
        out->len = start;
    return st;
}
