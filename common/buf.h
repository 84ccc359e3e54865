/* kiln growable byte buffer: encoders append to it, services send its bytes.
 *
 *   kiln_buf b = {0};
 *   if (kiln_buf_append(&b, "abc", 3, &err)) return err.code;
 *   send(fd, b.data, b.len, 0);
 *   kiln_buf_free(&b);
 *
 * A zeroed kiln_buf is a valid empty buffer.  `data` is owned by the buffer
 * (malloc'd) and may move on every append; `len` bytes are valid.  Not
 * thread-safe: one owner at a time.
 */
#ifndef KILN_BUF_H
#define KILN_BUF_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

typedef struct kiln_buf {
    uint8_t *data;
    size_t len;
    size_t cap;
} kiln_buf;

/* Makes room for `extra` more bytes after `len` (capacity grows
 * geometrically).  Fails with KILN_ERR_NOMEM (also on size overflow),
 * leaving the buffer unchanged. */
kiln_status kiln_buf_reserve(kiln_buf *b, size_t extra, kiln_err *err);

/* Appends n bytes (p may be NULL when n is 0).  KILN_ERR_NOMEM on failure,
 * leaving the buffer unchanged. */
kiln_status kiln_buf_append(kiln_buf *b, const void *p, size_t n, kiln_err *err);

/* Empties the buffer but keeps its memory for reuse. */
void kiln_buf_clear(kiln_buf *b);

/* Frees the memory and zeroes the struct; accepts a zeroed buffer. */
void kiln_buf_free(kiln_buf *b);

#endif
