#include "base64.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/* The characters of every 12-bit value, two per lookup: a response carries
 * megabytes of image (a 1024x1024 PNG of the random checkpoints is ~3 MB),
 * encoded on the gateway's loop; 3 MB took 1.4 ms a character at a time on
 * the development machine, 0.9 ms a pair at a time. */
static char pairs[4096][2];
static pthread_once_t pairs_once = PTHREAD_ONCE_INIT;

static void fill_pairs(void)
{
    for (int k = 0; k < 4096; k++)
        pairs[k][0] = alphabet[k >> 6], pairs[k][1] = alphabet[k & 63];
}

size_t kiln_base64_encoded_len(size_t n)
{
    return (n / 3 + (n % 3 != 0)) * 4;
}

kiln_status kiln_base64_encode(const void *data, size_t n, kiln_buf *out, kiln_err *err)
{
    if (n > (SIZE_MAX / 4) * 3 - 3)
        return kiln_err_set(err, KILN_ERR_NOMEM, "base64 output too large");
    size_t olen = kiln_base64_encoded_len(n);
    if (olen == 0)
        return KILN_OK; /* an empty buffer may have no memory at all */
    kiln_status st = kiln_buf_reserve(out, olen, err);
    if (st)
        return st;
    const uint8_t *p = data;
    char *o = (char *)out->data + out->len;
    size_t i = 0;
    pthread_once(&pairs_once, fill_pairs);
    for (; i + 3 <= n; i += 3, o += 4) {
        uint32_t v = (uint32_t)p[i] << 16 | (uint32_t)p[i + 1] << 8 | p[i + 2];
        memcpy(o, pairs[v >> 12], 2);
        memcpy(o + 2, pairs[v & 4095], 2);
    }
    if (i < n) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0);
        *o++ = alphabet[v >> 18];
        *o++ = alphabet[(v >> 12) & 63];
        *o++ = i + 1 < n ? alphabet[(v >> 6) & 63] : '=';
        *o++ = '=';
    }
    out->len += olen;
    return KILN_OK;
}

/* 0..63 for an alphabet character (either alphabet), -1 to skip, -2 for
 * padding, -3 for anything else. */
static int value_of(unsigned char c)
{
    if (c >= 'A' && c <= 'Z')
        return c - 'A';
    if (c >= 'a' && c <= 'z')
        return c - 'a' + 26;
    if (c >= '0' && c <= '9')
        return c - '0' + 52;
    switch (c) {
    case '+': case '-': return 62;
    case '/': case '_': return 63;
    case '\r': case '\n': case ' ': case '\t': return -1;
    case '=': return -2;
    default: return -3;
    }
}

kiln_status kiln_base64_decode(const char *text, size_t len, kiln_buf *out, kiln_err *err)
{
    kiln_status st = kiln_buf_reserve(out, len / 4 * 3 + 3, err);
    if (st)
        return st;
    uint8_t *o = out->data + out->len;
    uint32_t acc = 0;
    int have = 0, pad = 0;
    for (size_t i = 0; i < len; i++) {
        int v = value_of((unsigned char)text[i]);
        if (v == -1)
            continue;
        if (v == -3)
            return kiln_err_set(err, KILN_ERR_INVALID, "invalid base64 character at offset %zu", i);
        if (v == -2) {
            pad++;
            continue;
        }
        if (pad)
            return kiln_err_set(err, KILN_ERR_INVALID, "base64 padding before the end");
        acc = acc << 6 | (uint32_t)v;
        if (++have == 4) {
            *o++ = (uint8_t)(acc >> 16);
            *o++ = (uint8_t)(acc >> 8);
            *o++ = (uint8_t)acc;
            acc = 0;
            have = 0;
        }
    }
    /* 2 characters carry 1 byte, 3 carry 2; padding, when present, must
     * complete the last group exactly. */
    if (have == 1 || (pad && have + pad != 4) || (!have && pad))
        return kiln_err_set(err, KILN_ERR_INVALID, "base64 text has a truncated last group");
    if (have == 2) {
        if (acc & 0xf)
            return kiln_err_set(err, KILN_ERR_INVALID, "base64 text has stray bits at the end");
        *o++ = (uint8_t)(acc >> 4);
    } else if (have == 3) {
        if (acc & 0x3)
            return kiln_err_set(err, KILN_ERR_INVALID, "base64 text has stray bits at the end");
        *o++ = (uint8_t)(acc >> 10);
        *o++ = (uint8_t)(acc >> 2);
    }
    out->len = (size_t)(o - out->data);
    return KILN_OK;
}
