/* The request's text in JPEG and WebP files, as the PNG carries it in iTXt
 * chunks (image_png.c): one "key: value" line per entry.  JPEG: a COM
 * segment right after SOI (exiftool's Comment; JFIF readers skip it).
 * WebP: an XMP packet (dc:description) in an extended (VP8X) file, the
 * container's way to carry metadata (RIFF container spec, "Extended File
 * Format"); the image chunk is kept as the encoder wrote it. */
#include "image_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "key: value\n" lines, NUL-terminated, at most `max` bytes (the text is
 * cut at a UTF-8 character boundary, marked by "..."). */
static char *text_lines(const kiln_image_text *t, int n, size_t max, size_t *len, kiln_err *err)
{
    size_t need = 1;
    for (int i = 0; i < n; i++)
        need += strlen(t[i].key) + 2 + strlen(t[i].value) + 1;
    char *s = malloc(need);
    if (!s) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    size_t k = 0;
    for (int i = 0; i < n; i++)
        k += (size_t)sprintf(s + k, "%s: %s\n", t[i].key, t[i].value);
    if (k > max) {
        k = max - 3;
        while (k && ((unsigned char)s[k] & 0xc0) == 0x80)
            k--;
        memcpy(s + k, "...", 3);
        k += 3;
    }
    s[k] = '\0';
    *len = k;
    return s;
}

static kiln_status insert(kiln_buf *b, size_t at, const void *p, size_t n, kiln_err *err)
{
    size_t tail = b->len - at;
    kiln_status st = kiln_buf_reserve(b, n, err);
    if (st)
        return st;
    memmove(b->data + at + n, b->data + at, tail);
    memcpy(b->data + at, p, n);
    b->len += n;
    return KILN_OK;
}

kiln_status kiln_image_jpeg_add_text(kiln_buf *jpeg, size_t start, const kiln_image_text *t, int n,
                                     kiln_err *err)
{
    if (jpeg->len < start + 2 || jpeg->data[start] != 0xff || jpeg->data[start + 1] != 0xd8)
        return kiln_err_set(err, KILN_ERR_INTERNAL, "JPEG text: no SOI marker");
    size_t len;
    char *s = text_lines(t, n, 65533, &len, err); /* a segment's length field counts itself */
    if (!s)
        return err->code;
    uint8_t head[4] = {0xff, 0xfe, (uint8_t)((len + 2) >> 8), (uint8_t)(len + 2)};
    kiln_status st = insert(jpeg, start + 2, s, len, err);
    if (!st)
        st = insert(jpeg, start + 2, head, 4, err);
    free(s);
    return st;
}

static void le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16), p[3] = (uint8_t)(v >> 24);
}

static void le24(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16);
}

/* The text with &, <, > and " escaped for XML. */
static char *xml_escape(const char *s, kiln_err *err)
{
    char *o = malloc(strlen(s) * 6 + 1);
    if (!o) {
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        return NULL;
    }
    size_t k = 0;
    for (; *s; s++) {
        const char *e = *s == '&' ? "&amp;" : *s == '<' ? "&lt;" : *s == '>' ? "&gt;"
                        : *s == '"' ? "&quot;" : NULL;
        if (e)
            k += (size_t)sprintf(o + k, "%s", e);
        else
            o[k++] = *s;
    }
    o[k] = '\0';
    return o;
}

kiln_status kiln_image_webp_add_text(kiln_buf *webp, size_t start, int width, int height,
                                     const kiln_image_text *t, int n, kiln_err *err)
{
    uint8_t *p = webp->data + start;
    size_t len = webp->len - start;
    if (len < 20 || memcmp(p, "RIFF", 4) || memcmp(p + 8, "WEBP", 4) ||
        (memcmp(p + 12, "VP8 ", 4) && memcmp(p + 12, "VP8L", 4)))
        return kiln_err_set(err, KILN_ERR_INTERNAL, "WebP text: not a simple-format WebP file");
    size_t tl;
    char *lines = text_lines(t, n, 1u << 20, &tl, err);
    char *esc = lines ? xml_escape(lines, err) : NULL;
    free(lines);
    if (!esc)
        return err->code;
    static const char pre[] =
        "<?xpacket begin=\"\" id=\"W5M0MpCehiHzreSzNTczkc9d\"?>"
        "<x:xmpmeta xmlns:x=\"adobe:ns:meta/\"><rdf:RDF "
        "xmlns:rdf=\"http://www.w3.org/1999/02/22-rdf-syntax-ns#\"><rdf:Description rdf:about=\"\" "
        "xmlns:dc=\"http://purl.org/dc/elements/1.1/\"><dc:description><rdf:Alt>"
        "<rdf:li xml:lang=\"x-default\">";
    static const char post[] = "</rdf:li></rdf:Alt></dc:description></rdf:Description></rdf:RDF>"
                               "</x:xmpmeta><?xpacket end=\"r\"?>";
    size_t xl = strlen(pre) + strlen(esc) + strlen(post);
    size_t chunk = 8 + xl + (xl & 1); /* chunks are padded to even sizes */
    uint8_t *x = calloc(1, chunk);
    kiln_status st = KILN_OK;
    if (!x) {
        free(esc);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    }
    memcpy(x, "XMP ", 4);
    le32(x + 4, (uint32_t)xl);
    memcpy(x + 8, pre, strlen(pre));
    memcpy(x + 8 + strlen(pre), esc, strlen(esc));
    memcpy(x + 8 + strlen(pre) + strlen(esc), post, strlen(post));
    free(esc);
    /* VP8X: flags (XMP), 3 reserved bytes, canvas width - 1, height - 1 */
    uint8_t vp8x[18] = {'V', 'P', '8', 'X', 10, 0, 0, 0, 0x04};
    le24(vp8x + 12, (uint32_t)(width - 1));
    le24(vp8x + 15, (uint32_t)(height - 1));
    st = kiln_buf_append(webp, x, chunk, err);
    free(x);
    if (!st)
        st = insert(webp, start + 12, vp8x, sizeof vp8x, err);
    if (!st)
        le32(webp->data + start + 4, (uint32_t)(webp->len - start - 8));
    return st;
}
