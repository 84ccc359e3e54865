#include "http_strict.h"

#include <string.h>

#include "http_reader.h"

/* Empty lines skipped before a request line (RFC 9112 section 2.2 asks
 * for at least one); more is noise, not a request. */
#define MAX_LEADING_CRLF 8
#define MAX_CHUNK_DIGITS 16 /* the parser refuses sizes past 2^64 too */

enum {
    G_START = 0,   /* before the request line */
    G_START_LF,    /* empty line: LF after CR */
    G_METHOD,
    G_TARGET_START,
    G_TARGET,
    G_VERSION,     /* "HTTP/d.d", n characters in */
    G_LINE_LF,     /* LF ending the request line */
    G_FIELD_START, /* a field line or the empty line ending the section */
    G_NAME,
    G_VALUE,
    G_VALUE_LF,
    G_END_LF,      /* LF of the empty line */
    G_AT_BODY,     /* header section done; the caller describes the body */
    G_BODY,        /* `left` bytes of Content-Length body */
    G_CHUNK_SIZE,
    G_CHUNK_BWS,   /* whitespace after the size, before ';' */
    G_CHUNK_EXT,
    G_CHUNK_SIZE_LF,
    G_CHUNK_DATA,
    G_CHUNK_DATA_CR,
    G_CHUNK_DATA_LF,
    G_DONE,
    G_FAILED,
};

/* RFC 9110 section 5.6.2 tchar. */
static int tchar(unsigned char c)
{
    if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return 1;
    return c && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

static int hexdigit(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* field-vchar, SP, HTAB (obs-text included, as RFC 9110 section 5.5 does). */
static int value_char(unsigned char c)
{
    return c == '\t' || (c >= 0x20 && c != 0x7f);
}

static int framing_field(const char *name, int n)
{
    static const char *const names[] = {"content-length", "transfer-encoding", "host"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if ((size_t)n == strlen(names[k]) && memcmp(name, names[k], (size_t)n) == 0)
            return 1;
    return 0;
}

void kiln_http_strict_reset(kiln_http_strict *g, size_t max_head)
{
    memset(g, 0, sizeof *g);
    g->max_head = max_head;
}

static size_t fail_status(kiln_http_strict *g, int status, const char *why, size_t at)
{
    g->state = G_FAILED;
    g->status = status;
    g->why = why;
    return at;
}

static size_t fail(kiln_http_strict *g, const char *why, size_t at)
{
    return fail_status(g, 400, why, at);
}

/* States that are part of a head (request line, fields) or trailer
 * section, whose bytes count against max_head. */
static int in_head(int state)
{
    return (state >= G_METHOD && state <= G_END_LF);
}

/* The bytes of one line end: CR must be followed by LF. */
#define BARE_CR "a CR not followed by LF in the request"

size_t kiln_http_strict_scan(kiln_http_strict *g, const char *data, size_t len)
{
    static const char version[] = "HTTP/d.d";
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = p[i];
        if ((in_head(g->state) || (g->state == G_START && c != '\r')) && ++g->head > g->max_head)
            return fail_status(g, 431, "request headers are too large", i);
        switch (g->state) {
        case G_START:
            if (c == '\r') {
                if (++g->n > MAX_LEADING_CRLF)
                    return fail(g, "too many empty lines before the request line", i);
                g->state = G_START_LF;
                break;
            }
            g->n = 0;
            g->state = G_METHOD;
            /* fall through */
        case G_METHOD:
            if (c == ' ' && g->n > 0) {
                g->state = G_TARGET_START;
                g->method_done = 1;
                break;
            }
            if (!tchar(c))
                return fail(g, "malformed request line (the method must be a token followed "
                               "by one space)", i);
            g->n++;
            break;
        case G_START_LF:
            if (c != '\n')
                return fail(g, BARE_CR, i);
            g->state = G_START;
            break;
        case G_TARGET_START:
        case G_TARGET:
            if (c == ' ' && g->state == G_TARGET) {
                g->state = G_VERSION;
                g->n = 0;
                break;
            }
            if (c <= 0x20 || c >= 0x7f)
                return fail(g, "malformed request line (the target must be visible ASCII "
                               "followed by one space)", i);
            if (g->state == G_TARGET_START)
                g->n = 0;
            if (++g->n > KILN_HTTP_TARGET_MAX)
                return fail_status(g, 414, "request target is too long", i);
            g->state = G_TARGET;
            break;
        case G_VERSION:
            if (g->n == (int)sizeof version - 1) {
                if (c != '\r')
                    return fail(g, "malformed request line (it must end in HTTP/x.y and CRLF)", i);
                g->state = G_LINE_LF;
                break;
            }
            if (version[g->n] == 'd' ? !(c >= '0' && c <= '9') : c != (unsigned char)version[g->n])
                return fail(g, "malformed request line (it must end in HTTP/x.y and CRLF)", i);
            g->n++;
            break;
        case G_LINE_LF:
        case G_VALUE_LF:
            if (c != '\n')
                return fail(g, BARE_CR, i);
            g->state = G_FIELD_START;
            break;
        case G_FIELD_START:
            if (c == '\r') {
                g->state = G_END_LF;
                break;
            }
            if (c == ' ' || c == '\t')
                return fail(g, "a header line starts with whitespace (obs-fold, or whitespace "
                               "after the request line), which is not accepted", i);
            g->state = G_NAME;
            g->n = 0;
            /* fall through */
        case G_NAME:
            if (c == ':') {
                if (g->n == 0)
                    return fail(g, "a header line has an empty field name", i);
                if (g->trailers && framing_field(g->name, g->n))
                    return fail(g, "Content-Length, Transfer-Encoding and Host are not allowed "
                                   "in a trailer section", i);
                g->state = G_VALUE;
                break;
            }
            if (!tchar(c))
                return fail(g, c == ' ' || c == '\t'
                                   ? "whitespace between a header field name and its colon"
                                   : "invalid character in a header field name", i);
            if (g->n < (int)sizeof g->name)
                g->name[g->n] = (char)(c >= 'A' && c <= 'Z' ? c | 0x20 : c);
            g->n++;
            break;
        case G_VALUE:
            if (c == '\r') {
                g->state = G_VALUE_LF;
                break;
            }
            if (!value_char(c))
                return fail(g, c == '\n' ? "a header line ends in a bare LF (CRLF is required)"
                                         : "invalid character in a header field value", i);
            break;
        case G_END_LF:
            if (c != '\n')
                return fail(g, BARE_CR, i);
            if (g->trailers) {
                g->state = G_DONE;
                return i + 1;
            }
            g->state = G_AT_BODY;
            return i + 1;
        case G_BODY: {
            uint64_t k = len - i < g->left ? len - i : g->left;
            g->left -= k;
            i += k - 1;
            if (!g->left) {
                g->state = G_DONE;
                return i + 1;
            }
            break;
        }
        case G_CHUNK_SIZE:
            if (hexdigit(c)) {
                if (++g->n > MAX_CHUNK_DIGITS)
                    return fail(g, "a chunk size is too large", i);
                g->left = g->left * 16 + (uint64_t)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
                break;
            }
            if (g->n == 0)
                return fail(g, "malformed chunk size line", i);
            if (c == '\r') {
                g->state = G_CHUNK_SIZE_LF;
                break;
            }
            g->state = G_CHUNK_BWS;
            /* fall through */
        case G_CHUNK_BWS:
            if (c == ';') {
                g->state = G_CHUNK_EXT;
                break;
            }
            if (c != ' ' && c != '\t')
                return fail(g, "malformed chunk size line", i);
            break;
        case G_CHUNK_EXT:
            if (c == '\r') {
                g->state = G_CHUNK_SIZE_LF;
                break;
            }
            if (!value_char(c))
                return fail(g, "malformed chunk extension", i);
            break;
        case G_CHUNK_SIZE_LF:
            if (c != '\n')
                return fail(g, BARE_CR, i);
            if (g->left == 0) {
                /* The last chunk: a trailer section follows. */
                g->trailers = 1;
                g->head = 0;
                g->state = G_FIELD_START;
            } else {
                g->state = G_CHUNK_DATA;
            }
            break;
        case G_CHUNK_DATA: {
            uint64_t k = len - i < g->left ? len - i : g->left;
            g->left -= k;
            i += k - 1;
            if (!g->left)
                g->state = G_CHUNK_DATA_CR;
            break;
        }
        case G_CHUNK_DATA_CR:
        case G_CHUNK_DATA_LF:
            if (c != (g->state == G_CHUNK_DATA_CR ? '\r' : '\n'))
                return fail(g, "chunk data is not followed by CRLF", i);
            if (g->state == G_CHUNK_DATA_LF) {
                g->state = G_CHUNK_SIZE;
                g->n = 0;
                g->left = 0;
            } else {
                g->state = G_CHUNK_DATA_LF;
            }
            break;
        case G_AT_BODY:
        case G_DONE:
        case G_FAILED:
            return i;
        }
    }
    return len;
}

int kiln_http_strict_at_body(const kiln_http_strict *g)
{
    return g->state == G_AT_BODY;
}

void kiln_http_strict_body(kiln_http_strict *g, int chunked, uint64_t length)
{
    if (g->state != G_AT_BODY)
        return;
    g->n = 0;
    g->left = chunked ? 0 : length;
    g->state = chunked ? G_CHUNK_SIZE : length ? G_BODY : G_DONE;
}

int kiln_http_strict_done(const kiln_http_strict *g)
{
    return g->state == G_DONE;
}

int kiln_http_strict_failed(const kiln_http_strict *g, const char **why)
{
    if (g->state != G_FAILED)
        return 0;
    *why = g->why;
    return g->status;
}

int kiln_http_strict_method_ok(const kiln_http_strict *g)
{
    return g->method_done;
}
