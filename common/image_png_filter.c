/* PNG row filters (PNG 1.2 section 6) for 8-bit RGB rows, used by the
 * striped encoder (image_png_striped.c).  Every loop is written branch-free
 * over ints so that optimizing builds vectorize it: the branchy PAETH was
 * about 6x slower at -O3 on 1024x1024.  The adaptive choice is libpng's
 * default heuristic (pngwutil.c png_write_find_filter): the filter whose
 * output bytes, read as signed, have the smallest sum of absolute values. */
#include <stdlib.h>
#include <string.h>

#include "image_impl.h"

/* `up` NULL is the first row: PNG defines the row above as zeros. */
static void filter_sub(uint8_t *o, const uint8_t *cur, size_t n)
{
    for (size_t i = 0; i < 3 && i < n; i++)
        o[i] = cur[i];
    for (size_t i = 3; i < n; i++)
        o[i] = (uint8_t)(cur[i] - cur[i - 3]);
}

static void filter_up(uint8_t *o, const uint8_t *cur, const uint8_t *up, size_t n)
{
    for (size_t i = 0; i < n; i++)
        o[i] = (uint8_t)(cur[i] - up[i]);
}

static void filter_avg(uint8_t *o, const uint8_t *cur, const uint8_t *up, size_t n)
{
    for (size_t i = 0; i < 3 && i < n; i++)
        o[i] = (uint8_t)(cur[i] - (up ? up[i] >> 1 : 0));
    if (!up) {
        for (size_t i = 3; i < n; i++)
            o[i] = (uint8_t)(cur[i] - (cur[i - 3] >> 1));
        return;
    }
    for (size_t i = 3; i < n; i++)
        o[i] = (uint8_t)(cur[i] - ((cur[i - 3] + up[i]) >> 1));
}

static void filter_paeth(uint8_t *o, const uint8_t *cur, const uint8_t *up, size_t n)
{
    if (!up) { /* b = c = 0: the predictor is a, as SUB */
        filter_sub(o, cur, n);
        return;
    }
    for (size_t i = 0; i < 3 && i < n; i++)
        o[i] = (uint8_t)(cur[i] - up[i]); /* a = c = 0: the predictor is b */
    for (size_t i = 3; i < n; i++) {
        int a = cur[i - 3], b = up[i], c = up[i - 3];
        int pa = abs(b - c), pb = abs(a - c), pc = abs(a + b - 2 * c);
        int pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
        o[i] = (uint8_t)(cur[i] - pred);
    }
}

/* Sum of the bytes read as signed, in absolute value. */
static unsigned long signed_sum(const uint8_t *p, size_t n)
{
    unsigned long s = 0;
    for (size_t i = 0; i < n; i++) {
        int v = (int8_t)p[i];
        s += (unsigned long)abs(v);
    }
    return s;
}

static void filter_one(int type, uint8_t *o, const uint8_t *cur, const uint8_t *up, size_t n)
{
    switch (type) {
    case KILN_PNG_FILTER_NONE: memcpy(o, cur, n); break;
    case KILN_PNG_FILTER_SUB: filter_sub(o, cur, n); break;
    case KILN_PNG_FILTER_UP:
        if (up)
            filter_up(o, cur, up, n);
        else
            memcpy(o, cur, n);
        break;
    case KILN_PNG_FILTER_AVG: filter_avg(o, cur, up, n); break;
    default: filter_paeth(o, cur, up, n); break;
    }
}

void kiln_image_png_filter_row(kiln_png_filter filter, uint8_t *o, const uint8_t *cur,
                               const uint8_t *up, size_t n, uint8_t *scratch)
{
    if (filter != KILN_PNG_FILTER_ADAPTIVE) {
        o[0] = (uint8_t)filter; /* the enum follows PNG's filter type numbers */
        filter_one(filter, o + 1, cur, up, n);
        return;
    }
    unsigned long best = 0;
    int best_type = -1;
    for (int t = KILN_PNG_FILTER_NONE; t <= KILN_PNG_FILTER_PAETH; t++) {
        uint8_t *dst = best_type < 0 ? o + 1 : scratch;
        filter_one(t, dst, cur, up, n);
        /* NONE is scored on its bytes as signed too, as libpng does. */
        unsigned long s = signed_sum(dst, n);
        if (best_type < 0 || s < best) {
            if (dst == scratch)
                memcpy(o + 1, scratch, n);
            best = s;
            best_type = t;
        }
    }
    o[0] = (uint8_t)best_type;
}
