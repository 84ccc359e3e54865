#include "multipart.h"

#include <string.h>
#include <strings.h>

#define PART_HEADERS_MAX 8192

static int is_ows(char c)
{
    return c == ' ' || c == '\t';
}

int kiln_header_param(const char *v, size_t vlen, const char *key, char *out, size_t out_len)
{
    size_t klen = strlen(key), i = 0;
    while (i < vlen && v[i] != ';') /* the media type / disposition type */
        i++;
    while (i < vlen) {
        i++; /* the ';' */
        while (i < vlen && is_ows(v[i]))
            i++;
        size_t k0 = i;
        while (i < vlen && v[i] != '=' && v[i] != ';' && !is_ows(v[i]))
            i++;
        size_t k1 = i;
        while (i < vlen && is_ows(v[i]))
            i++;
        if (i >= vlen || v[i] != '=') {
            while (i < vlen && v[i] != ';')
                i++;
            continue;
        }
        i++;
        while (i < vlen && is_ows(v[i]))
            i++;
        int match = k1 - k0 == klen && strncasecmp(v + k0, key, klen) == 0;
        size_t n = 0;
        if (i < vlen && v[i] == '"') {
            for (i++;; i++) {
                if (i >= vlen)
                    return -1; /* unterminated quoted string */
                char c = v[i];
                if (c == '"')
                    break;
                if (c == '\\') {
                    if (++i >= vlen)
                        return -1;
                    c = v[i];
                }
                if (match) {
                    if (n + 1 >= out_len)
                        return -1;
                    out[n++] = c;
                }
            }
            i++;
            while (i < vlen && is_ows(v[i]))
                i++;
            if (i < vlen && v[i] != ';')
                return -1; /* junk after the closing quote */
        } else {
            size_t s = i;
            while (i < vlen && v[i] != ';' && !is_ows(v[i]))
                i++;
            if (match) {
                if (i - s + 1 > out_len)
                    return -1;
                memcpy(out, v + s, i - s);
                n = i - s;
            }
            while (i < vlen && v[i] != ';')
                i++;
        }
        if (match) {
            out[n] = '\0';
            return 1;
        }
    }
    return 0;
}

/* RFC 2046 bchars. */
static int boundary_char(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("'()+_,-./:=? ", c));
}

kiln_status kiln_multipart_boundary(const char *ct, char *out, kiln_err *err)
{
    static const char type[] = "multipart/form-data";
    while (is_ows(*ct))
        ct++;
    size_t tl = sizeof type - 1, clen = strlen(ct);
    if (strncasecmp(ct, type, tl) != 0 || (ct[tl] && ct[tl] != ';' && !is_ows(ct[tl])))
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "Content-Type must be multipart/form-data or application/json");
    int r = kiln_header_param(ct, clen, "boundary", out, KILN_MULTIPART_BOUNDARY_MAX);
    if (r <= 0)
        return kiln_err_set(err, KILN_ERR_INVALID, "multipart/form-data needs a boundary of "
                                                   "1 to 70 characters");
    size_t bl = strlen(out);
    if (bl == 0 || out[bl - 1] == ' ')
        return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart boundary");
    for (size_t i = 0; i < bl; i++)
        if (!boundary_char(out[i]))
            return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart boundary");
    return KILN_OK;
}

/* Parses the header block at h[0..len) (without its final empty line). */
static kiln_status part_headers(const char *h, size_t len, kiln_multipart_part *p, kiln_err *err)
{
    int have_disposition = 0;
    size_t i = 0;
    while (i < len) {
        const char *nl = memchr(h + i, '\n', len - i);
        size_t end = nl ? (size_t)(nl - h) : len;
        size_t le = end > i && h[end - 1] == '\r' ? end - 1 : end;
        const char *line = h + i;
        size_t ll = le - i;
        i = end + 1;
        const char *colon = memchr(line, ':', ll);
        if (!colon || colon == line)
            return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart part header");
        size_t nlen = (size_t)(colon - line);
        const char *v = colon + 1;
        size_t vl = ll - nlen - 1;
        while (vl && is_ows(*v))
            v++, vl--;
        while (vl && is_ows(v[vl - 1]))
            vl--;
        if (nlen == 19 && strncasecmp(line, "Content-Disposition", 19) == 0) {
            if (vl < 9 || strncasecmp(v, "form-data", 9) != 0 ||
                (vl > 9 && v[9] != ';' && !is_ows(v[9])))
                return kiln_err_set(err, KILN_ERR_INVALID,
                                    "multipart part disposition must be form-data");
            int r = kiln_header_param(v, vl, "name", p->name, sizeof p->name);
            if (r < 0)
                return kiln_err_set(err, KILN_ERR_INVALID,
                                    "multipart field name is malformed or longer than %d bytes",
                                    KILN_MULTIPART_NAME_MAX - 1);
            if (r == 0)
                return kiln_err_set(err, KILN_ERR_INVALID, "multipart part without a name");
            char fname[1024];
            r = kiln_header_param(v, vl, "filename", fname, sizeof fname);
            if (r < 0)
                return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart filename");
            p->is_file = r == 1;
            have_disposition = 1;
        } else if (nlen == 12 && strncasecmp(line, "Content-Type", 12) == 0) {
            if (vl >= sizeof p->content_type)
                return kiln_err_set(err, KILN_ERR_INVALID, "multipart part Content-Type too long");
            memcpy(p->content_type, v, vl);
            p->content_type[vl] = '\0';
        }
    }
    if (!have_disposition)
        return kiln_err_set(err, KILN_ERR_INVALID, "multipart part without Content-Disposition");
    return KILN_OK;
}

kiln_status kiln_multipart_parse(const void *body, size_t len, const char *boundary,
                                 kiln_multipart_part *parts, int max_parts, int *n_parts,
                                 kiln_err *err)
{
    const char *b = body;
    char delim[KILN_MULTIPART_BOUNDARY_MAX + 4] = "\r\n--";
    size_t bl = strlen(boundary);
    if (bl == 0 || bl >= KILN_MULTIPART_BOUNDARY_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart boundary");
    memcpy(delim + 4, boundary, bl);
    size_t dl = bl + 4;
    *n_parts = 0;

    /* The first delimiter may open the body (no preamble, no CRLF). */
    size_t pos;
    if (len >= dl - 2 && memcmp(b, delim + 2, dl - 2) == 0) {
        pos = dl - 2;
    } else {
        const char *f = len ? memmem(b, len, delim, dl) : NULL;
        if (!f)
            return kiln_err_set(err, KILN_ERR_INVALID, "multipart body has no boundary");
        pos = (size_t)(f - b) + dl;
    }
    for (;;) {
        /* pos is just past a delimiter: "--" closes, else padding + CRLF. */
        if (len - pos >= 2 && b[pos] == '-' && b[pos + 1] == '-')
            return KILN_OK;
        while (pos < len && is_ows(b[pos]))
            pos++;
        if (len - pos >= 2 && b[pos] == '\r' && b[pos + 1] == '\n')
            pos += 2;
        else if (pos < len && b[pos] == '\n')
            pos += 1;
        else
            return kiln_err_set(err, KILN_ERR_INVALID, "malformed multipart delimiter line");
        if (*n_parts == max_parts)
            return kiln_err_set(err, KILN_ERR_INVALID, "more than %d multipart parts", max_parts);
        kiln_multipart_part *p = &parts[*n_parts];
        memset(p, 0, sizeof *p);
        /* Headers end at the first empty line (CRLFCRLF, or LF LF). */
        size_t hend = pos, dstart = 0;
        for (; hend < len && hend - pos <= PART_HEADERS_MAX; hend++) {
            if (b[hend] != '\n')
                continue;
            if (hend == pos || (hend == pos + 1 && b[pos] == '\r')) { /* no headers */
                dstart = hend + 1;
                hend = pos;
                break;
            }
            if (hend + 1 < len && b[hend + 1] == '\n') {
                dstart = hend + 2;
                break;
            }
            if (hend + 2 < len && b[hend + 1] == '\r' && b[hend + 2] == '\n') {
                dstart = hend + 3;
                break;
            }
        }
        if (!dstart)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "multipart part headers are unterminated or longer than %d bytes",
                                PART_HEADERS_MAX);
        if (part_headers(b + pos, hend - pos, p, err))
            return err ? err->code : KILN_ERR_INVALID;
        /* An empty part's data ends at once: the delimiter's CRLF may follow
         * the header block directly, so search from two bytes back. */
        const char *f = memmem(b + dstart - 2, len - (dstart - 2), delim, dl);
        if (!f)
            return kiln_err_set(err, KILN_ERR_INVALID, "multipart body is missing its closing "
                                                       "boundary");
        size_t dend = (size_t)(f - b);
        if (dend < dstart) /* the CRLF ending the headers is the delimiter's */
            dend = dstart;
        p->data = (const uint8_t *)b + dstart;
        p->len = dend - dstart;
        (*n_parts)++;
        pos = (size_t)(f - b) + dl;
    }
}
