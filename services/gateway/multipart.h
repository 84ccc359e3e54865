/* kiln multipart/form-data (RFC 7578) parsing for /v1/images/edits uploads.
 *
 *   char boundary[KILN_MULTIPART_BOUNDARY_MAX];
 *   if (kiln_multipart_boundary(content_type, boundary, &err)) -> 400
 *   kiln_multipart_part parts[KILN_MULTIPART_MAX_PARTS];
 *   int n;
 *   if (kiln_multipart_parse(body, len, boundary, parts, KILN_MULTIPART_MAX_PARTS, &n, &err))
 *       -> 400 with err.msg
 *   for (i < n) parts[i].name, parts[i].is_file, parts[i].data, parts[i].len
 *
 * The whole body is in memory (the HTTP layer bounds its size), so parts
 * are views into it: `data` stays valid while the body does.  Strict where
 * ambiguity could hide an attack (every part needs a Content-Disposition of
 * form-data with a name; header blocks are bounded; the closing delimiter
 * must be present) and lenient where real clients differ (preamble and
 * epilogue ignored, quoted or bare parameters, LF-only line ends inside part
 * headers, case-insensitive header and parameter names).  Pure functions,
 * thread-safe.
 */
#ifndef KILN_GW_MULTIPART_H
#define KILN_GW_MULTIPART_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

#define KILN_MULTIPART_BOUNDARY_MAX 71 /* RFC 2046: 1..70 characters, plus the NUL */
#define KILN_MULTIPART_NAME_MAX 64     /* field names, with the NUL */
#define KILN_MULTIPART_TYPE_MAX 128    /* part Content-Type, with the NUL */
#define KILN_MULTIPART_MAX_PARTS 64

typedef struct kiln_multipart_part {
    char name[KILN_MULTIPART_NAME_MAX];
    int is_file;                                /* the part had a filename parameter */
    char content_type[KILN_MULTIPART_TYPE_MAX]; /* "" when the part had none */
    const uint8_t *data;                        /* a view into the body */
    size_t len;
} kiln_multipart_part;

/* Extracts the boundary parameter of a `multipart/form-data` Content-Type
 * header value into out[KILN_MULTIPART_BOUNDARY_MAX].  KILN_ERR_INVALID when
 * the type is something else or the boundary is missing or malformed. */
kiln_status kiln_multipart_boundary(const char *content_type, char *out, kiln_err *err);

/* Splits body[0..len) into at most max_parts parts (*n_parts gets the
 * count).  KILN_ERR_INVALID naming what is wrong (missing delimiter, broken
 * part headers, too many parts, a name too long). */
kiln_status kiln_multipart_parse(const void *body, size_t len, const char *boundary,
                                 kiln_multipart_part *parts, int max_parts, int *n_parts,
                                 kiln_err *err);

/* Reads one `; key=value` parameter (case-insensitive key, value bare or
 * quoted with backslash escapes) from a header value of vlen bytes into
 * out[out_len].  Returns 1 when found, 0 when absent, -1 when the value is
 * malformed or does not fit.  Shared with the HTTP layer's Content-Type
 * handling. */
int kiln_header_param(const char *value, size_t vlen, const char *key, char *out, size_t out_len);

#endif
