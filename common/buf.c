#include "buf.h"

#include <stdlib.h>
#include <string.h>

kiln_status kiln_buf_reserve(kiln_buf *b, size_t extra, kiln_err *err)
{
    if (extra > SIZE_MAX - b->len)
        return kiln_err_set(err, KILN_ERR_NOMEM, "buffer size overflow");
    size_t need = b->len + extra;
    if (need <= b->cap)
        return KILN_OK;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < need)
        cap = cap > SIZE_MAX / 2 ? need : cap * 2;
    uint8_t *p = realloc(b->data, cap);
    if (!p)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory growing a buffer to %zu bytes",
                            cap);
    b->data = p;
    b->cap = cap;
    return KILN_OK;
}

kiln_status kiln_buf_append(kiln_buf *b, const void *p, size_t n, kiln_err *err)
{
    if (n == 0)
        return KILN_OK;
    kiln_status st = kiln_buf_reserve(b, n, err);
    if (st)
        return st;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return KILN_OK;
}

void kiln_buf_clear(kiln_buf *b)
{
    b->len = 0;
}

void kiln_buf_free(kiln_buf *b)
{
    free(b->data);
    b->data = NULL;
    b->len = 0;
    b->cap = 0;
}
