/* kiln strict HTTP/1.1 framing: a validator that walks a request's raw
 * bytes ahead of http-parser and refuses what RFC 9112 makes invalid but
 * Debian's libhttp-parser (built with HTTP_PARSER_STRICT=0) lets through:
 * the differences a proxy in front of kiln could read otherwise (request
 * smuggling).
 *
 *   kiln_http_strict g;
 *   kiln_http_strict_reset(&g, 16384);                    // head bytes allowed
 *   size_t ok = kiln_http_strict_scan(&g, data, len);     // bytes that are fine
 *   feed data[0..ok) to http-parser;
 *   if ((status = kiln_http_strict_failed(&g, &why))) -> status with why, close
 *   if (kiln_http_strict_at_body(&g)) -> kiln_http_strict_body(&g, chunked, length)
 *       once the parser has the headers, then scan on
 *   if (kiln_http_strict_done(&g)) -> the request ends here (the parser must agree)
 *
 * What it enforces: the request line is `token SP visible-target SP
 * HTTP/d.d CRLF` (a few empty lines before it are skipped, as RFC 9112
 * section 2.2 allows); every line ends in CRLF (a bare CR or LF is an
 * error); a field line is `token ":" value` with no whitespace before the
 * colon (section 5.1) and no obs-fold or whitespace-led line (5.2); values
 * hold no control characters but HTAB; chunk-size lines are hex digits
 * with optional extensions, every chunk's data is followed by CRLF, and a
 * trailer section is field lines too, none of them Content-Length,
 * Transfer-Encoding or Host (RFC 9110 section 6.5.1: trailers never frame
 * or route a message).  Sizes: a request target over KILN_HTTP_TARGET_MAX
 * bytes is 414, a request line and header section (or a trailer section)
 * over the head limit 431; every other fault is 400.  Because it decides
 * byte by byte, its verdict never depends on how the bytes are split.  The meaning of the fields
 * (Content-Length, Transfer-Encoding, Host) is checked by the reader's
 * callbacks; this only sees the bytes.
 *
 * Scanning stops at two boundaries so the caller can feed the parser in
 * between: the end of the header section (kiln_http_strict_at_body: the
 * caller says what body follows) and the end of the message.
 *
 * A plain struct, no allocation; not thread-safe (one per connection).
 */
#ifndef KILN_GW_HTTP_STRICT_H
#define KILN_GW_HTTP_STRICT_H

#include <stddef.h>
#include <stdint.h>

typedef struct kiln_http_strict {
    int state;
    int status;        /* set on failure: 400, 414 or 431 */
    size_t head, max_head; /* bytes of the current head (or trailer) section, and its limit */
    int n;             /* characters in the current element (method, version, chunk size) */
    int trailers;      /* the field lines being read are a trailer section */
    int method_done;   /* the method was a token followed by SP */
    uint64_t left;     /* body or chunk bytes still to pass */
    char name[20];     /* a trailer field's name so far, lowercase, truncated */
    const char *why;   /* set on failure */
} kiln_http_strict;

/* Ready for a new request whose head may hold max_head bytes. */
void kiln_http_strict_reset(kiln_http_strict *g, size_t max_head);

/* Scans data[0..len) and returns how many bytes are valid, stopping early
 * at the end of the header section, at the end of the message, or at the
 * first invalid byte (then kiln_http_strict_failed says why). */
size_t kiln_http_strict_scan(kiln_http_strict *g, const char *data, size_t len);

/* 1 once the header section has ended and the body is not yet described. */
int kiln_http_strict_at_body(const kiln_http_strict *g);

/* The body that follows the header section: chunked, else `length` bytes
 * (0: none). */
void kiln_http_strict_body(kiln_http_strict *g, int chunked, uint64_t length);

/* 1 once the whole message has been scanned. */
int kiln_http_strict_done(const kiln_http_strict *g);

/* After an invalid byte, the status to answer (400, 414 or 431) with *why
 * (a message safe to show a client); else 0. */
int kiln_http_strict_failed(const kiln_http_strict *g, const char **why);

/* 1 once the request line began with a well-formed method token and its
 * space, so a method the parser does not know is worth a 501 rather than
 * a 400. */
int kiln_http_strict_method_ok(const kiln_http_strict *g);

#endif
