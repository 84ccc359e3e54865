/* kiln base64: the standard alphabet (RFC 4648) for images in JSON bodies.
 *
 *   kiln_buf out = {0};
 *   if (kiln_base64_encode(png.data, png.len, &out, &err)) ...   // appends text
 *   if (kiln_base64_decode(text, len, &bytes, &err)) -> 400 with err.msg
 *
 * Encoding writes padded standard base64 and no line breaks (what OpenAI's
 * b64_json holds).  Decoding is lenient where clients differ and strict
 * elsewhere: it accepts the standard and the URL-safe alphabets, padding or
 * none, and skips CR, LF, space and tab (MIME-wrapped text); any other byte,
 * a lone trailing character, padding in the middle or non-zero bits after
 * the last byte is KILN_ERR_INVALID.  Both append to `out` and leave its
 * length unchanged on failure.  Thread-safe on distinct buffers.
 */
#ifndef KILN_GW_BASE64_H
#define KILN_GW_BASE64_H

#include <stddef.h>

#include "common/buf.h"
#include "common/error.h"

/* Bytes of the base64 text of n input bytes (no NUL). */
size_t kiln_base64_encoded_len(size_t n);

/* Appends the base64 text of data[0..n).  KILN_ERR_NOMEM. */
kiln_status kiln_base64_encode(const void *data, size_t n, kiln_buf *out, kiln_err *err);

/* Appends the bytes of text[0..len).  KILN_ERR_INVALID, _NOMEM. */
kiln_status kiln_base64_decode(const char *text, size_t len, kiln_buf *out, kiln_err *err);

#endif
