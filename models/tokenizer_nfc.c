/* NFC in O(n log n) on utf8proc's tables.
 *
 * utf8proc_map() puts combining marks in canonical order with an in-place
 * exchange sort, quadratic in the length of a run of marks: one base letter
 * followed by 100k alternating marks (a 200 kB prompt) took 45 s.  So the
 * three steps are driven here: utf8proc decomposes each code point, runs of
 * marks are sorted stably by combining class (what utf8proc's sort computes
 * too), and utf8proc_reencode() composes, which is a single linear pass. */
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "tokenizer_internal.h"

static uint8_t ccc(utf8proc_int32_t cp)
{
    return (uint8_t)utf8proc_get_property(cp)->combining_class;
}

/* Stable sort of a run of marks (all ccc > 0) by combining class. */
static kiln_status sort_run(utf8proc_int32_t *run, size_t n, kiln_err *err)
{
    if (n <= 16) {
        for (size_t i = 1; i < n; i++) {
            utf8proc_int32_t c = run[i];
            uint8_t k = ccc(c);
            size_t j = i;
            for (; j > 0 && ccc(run[j - 1]) > k; j--)
                run[j] = run[j - 1];
            run[j] = c;
        }
        return KILN_OK;
    }
    size_t start[257] = {0};
    for (size_t i = 0; i < n; i++)
        start[ccc(run[i]) + 1]++;
    for (int k = 1; k <= 256; k++)
        start[k] += start[k - 1];
    utf8proc_int32_t *tmp = malloc(n * sizeof *tmp);
    if (!tmp)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < n; i++)
        tmp[start[ccc(run[i])]++] = run[i];
    memcpy(run, tmp, n * sizeof *tmp);
    free(tmp);
    return KILN_OK;
}

kiln_status kiln_tok_nfc(const uint8_t *text, size_t len, uint8_t **out, size_t *out_len,
                         kiln_err *err)
{
    *out = NULL;
    /* Canonical decompositions are at most 4 code points; grow if ever more. */
    size_t cap = len + 16, n = 0;
    utf8proc_int32_t *buf = malloc(cap * sizeof *buf);
    if (!buf)
        return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate(text + i, (utf8proc_ssize_t)(len - i), &cp);
        int boundclass = 0;
        utf8proc_ssize_t m = k > 0 ? utf8proc_decompose_char(cp, buf + n,
                                                             (utf8proc_ssize_t)(cap - n - 1),
                                                             UTF8PROC_DECOMPOSE, &boundclass)
                                   : k;
        if (m >= 0 && (size_t)m > cap - n - 1) {
            size_t grown = cap * 2 + (size_t)m;
            utf8proc_int32_t *b = realloc(buf, grown * sizeof *b);
            if (!b) {
                free(buf);
                return kiln_err_set(err, KILN_ERR_NOMEM, "tokenizer: out of memory");
            }
            buf = b;
            cap = grown;
            continue; /* decompose this code point again into the larger buffer */
        }
        if (m < 0) {
            free(buf);
            return kiln_err_set(err, KILN_ERR_INVALID, "NFC normalisation failed at byte %zu: %s",
                                i, utf8proc_errmsg(m));
        }
        n += (size_t)m;
        i += (size_t)k;
    }
    for (size_t i = 0; i < n;) {
        if (!ccc(buf[i])) {
            i++;
            continue;
        }
        size_t j = i + 1;
        while (j < n && ccc(buf[j]))
            j++;
        kiln_status st = j - i > 1 ? sort_run(buf + i, j - i, err) : KILN_OK;
        if (st) {
            free(buf);
            return st;
        }
        i = j;
    }
    /* The buffer has room for n + 1 code points, more than the n * 4 + 1
     * bytes of UTF-8 that reencode may write in place. */
    utf8proc_ssize_t bytes = utf8proc_reencode(buf, (utf8proc_ssize_t)n,
                                               UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (bytes < 0) {
        free(buf);
        return kiln_err_set(err, KILN_ERR_INVALID, "NFC normalisation failed: %s",
                            utf8proc_errmsg(bytes));
    }
    *out = (uint8_t *)buf;
    *out_len = (size_t)bytes;
    return KILN_OK;
}
