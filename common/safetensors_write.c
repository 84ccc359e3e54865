/* safetensors writer: sorted names, data laid out contiguously in name
 * order (the reference loader rejects gaps), header padded with spaces to a
 * multiple of 8 so the data block starts 8-byte aligned, as the
 * huggingface/safetensors writer does.  The header carries
 * {"__metadata__": {"format": "pt"}} because transformers refuses files
 * without a recognised format tag. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

#define ST_CHUNK (8u << 20)

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t ncap = (b->len + n + 1) * 2;
        char *np = realloc(b->p, ncap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = ncap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_string(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            sb_put(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, s, 1);
        }
    }
    sb_put(b, "\"", 1);
}

typedef struct order {
    size_t idx;
    const char *name;
} order;

static int cmp_order(const void *a, const void *b)
{
    return strcmp(((const order *)a)->name, ((const order *)b)->name);
}

static kiln_status entry_bytes(const kiln_st_entry *e, uint64_t *out, kiln_err *err)
{
    size_t es = kiln_dtype_size(e->dtype);
    if (!e->name || !strcmp(e->name, "__metadata__") || !es || e->ndim < 0 ||
        e->ndim > KILN_MAX_DIMS)
        return kiln_err_set(err, KILN_ERR_INVALID, "tensor '%s': bad name, dtype or rank",
                            e->name ? e->name : "(null)");
    uint64_t n = es;
    for (int i = 0; i < e->ndim; i++) {
        if (e->shape[i] < 0 || (e->shape[i] && n > UINT64_MAX / (uint64_t)e->shape[i]))
            return kiln_err_set(err, KILN_ERR_INVALID, "tensor '%s': bad shape", e->name);
        n *= (uint64_t)e->shape[i];
    }
    *out = n;
    return KILN_OK;
}

static kiln_status build_header(const kiln_st_entry *entries, const order *ord, size_t n,
                                sbuf *h, kiln_err *err)
{
    sb_str(h, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (size_t k = 0; k < n; k++) {
        const kiln_st_entry *e = &entries[ord[k].idx];
        uint64_t bytes;
        kiln_status rc = entry_bytes(e, &bytes, err);
        if (rc)
            return rc;
        char num[64];
        sb_str(h, ",");
        sb_json_string(h, e->name);
        sb_str(h, ":{\"dtype\":\"");
        sb_str(h, kiln_dtype_name(e->dtype));
        sb_str(h, "\",\"shape\":[");
        for (int i = 0; i < e->ndim; i++) {
            snprintf(num, sizeof num, i ? ",%lld" : "%lld", (long long)e->shape[i]);
            sb_str(h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + bytes));
        sb_str(h, num);
        off += bytes;
    }
    sb_str(h, "}");
    while (h->len % 8)
        sb_str(h, " ");
    if (h->oom)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory building a safetensors header");
    return KILN_OK;
}

static kiln_status write_all(FILE *f, const void *p, size_t n, const char *path, kiln_err *err)
{
    if (n && fwrite(p, 1, n, f) != n)
        return kiln_err_set(err, KILN_ERR_IO, "writing %s failed: %s", path, strerror(errno));
    return KILN_OK;
}

static kiln_status write_tensor(FILE *f, const kiln_st_entry *e, size_t idx, uint64_t bytes,
                                kiln_st_fill_fn fill, void *ctx, void **chunk, const char *path,
                                kiln_err *err)
{
    if (bytes == 0)
        return KILN_OK;
    if (e->data)
        return write_all(f, e->data, (size_t)bytes, path, err);
    if (!fill)
        return kiln_err_set(err, KILN_ERR_INVALID, "tensor '%s' has no data", e->name);
    if (!*chunk && !(*chunk = malloc(ST_CHUNK)))
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (uint64_t off = 0; off < bytes; off += ST_CHUNK) {
        size_t n = bytes - off < ST_CHUNK ? (size_t)(bytes - off) : ST_CHUNK;
        kiln_status rc = fill(ctx, idx, (size_t)off, *chunk, n, err);
        if (rc || (rc = write_all(f, *chunk, n, path, err)))
            return rc;
    }
    return KILN_OK;
}

kiln_status kiln_st_write_stream(const char *path, const kiln_st_entry *entries, size_t n,
                                 kiln_st_fill_fn fill, void *ctx, kiln_err *err)
{
    order *ord = malloc((n ? n : 1) * sizeof *ord);
    sbuf h = {0};
    void *chunk = NULL;
    FILE *f = NULL;
    kiln_status rc = KILN_OK;
    if (!ord) {
        rc = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        ord[i] = (order){i, entries[i].name ? entries[i].name : ""};
    if (n)
        qsort(ord, n, sizeof *ord, cmp_order);
    for (size_t i = 1; i < n; i++) {
        if (!strcmp(ord[i].name, ord[i - 1].name)) {
            rc = kiln_err_set(err, KILN_ERR_INVALID, "tensor '%s' given twice", ord[i].name);
            goto out;
        }
    }
    if ((rc = build_header(entries, ord, n, &h, err)))
        goto out;
    if (!(f = fopen(path, "wb"))) {
        rc = kiln_err_set(err, KILN_ERR_IO, "cannot create %s: %s", path, strerror(errno));
        goto out;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++)
        len8[i] = (uint8_t)((uint64_t)h.len >> (8 * i));
    if ((rc = write_all(f, len8, 8, path, err)) || (rc = write_all(f, h.p, h.len, path, err)))
        goto out;
    for (size_t k = 0; k < n; k++) {
        const kiln_st_entry *e = &entries[ord[k].idx];
        uint64_t bytes;
        entry_bytes(e, &bytes, NULL); /* validated by build_header */
        if ((rc = write_tensor(f, e, ord[k].idx, bytes, fill, ctx, &chunk, path, err)))
            goto out;
    }
out:
    if (f && fclose(f) != 0 && !rc)
        rc = kiln_err_set(err, KILN_ERR_IO, "writing %s failed: %s", path, strerror(errno));
    if (f && rc)
        remove(path);
    free(chunk);
    free(h.p);
    free(ord);
    return rc;
}

kiln_status kiln_st_write(const char *path, const kiln_st_entry *entries, size_t n,
                          kiln_err *err)
{
    return kiln_st_write_stream(path, entries, n, NULL, NULL, err);
}
