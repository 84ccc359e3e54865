/* kiln OpenAI-shaped response bodies: errors and generated images.
 *
 *   kiln_buf body = {0};
 *   kiln_api_error_json(&body, 400, "n must be between 1 and 10", "n", "invalid_value", &err);
 *   // {"error":{"message":"n must ...","type":"invalid_request_error","param":"n","code":"invalid_value"}}
 *
 *   kiln_api_image imgs[] = {{png, png_len, 42}, ...};
 *   kiln_api_images_json(&body, time(NULL), imgs, 2, KILN_IMAGE_PNG, 1024, 1024, &err);
 *   // {"created":...,"data":[{"b64_json":"...","seed":42,"revised_prompt":null},...],
 *   //  "output_format":"png","size":"1024x1024"}
 *
 * Both append to `out` (KILN_ERR_NOMEM leaves its length unchanged).
 * Strings are escaped for JSON, and bytes that are not valid UTF-8 become
 * U+FFFD, so any message (even one quoting client input) gives valid JSON.
 * Thread-safe on distinct buffers.
 */
#ifndef KILN_GW_API_RESPONSE_H
#define KILN_GW_API_RESPONSE_H

#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/error.h"
#include "common/image.h"

/* OpenAI's error `type` for an HTTP status: invalid_request_error (4xx),
 * rate_limit_error (429), server_error (5xx). */
const char *kiln_api_error_type(int status);

/* param and code may be NULL or "" (written as null). */
kiln_status kiln_api_error_json(kiln_buf *out, int status, const char *message, const char *param,
                                const char *code, kiln_err *err);

/* Appends s as a quoted JSON string. */
kiln_status kiln_json_append_string(kiln_buf *out, const char *s, size_t len, kiln_err *err);

typedef struct kiln_api_image {
    const uint8_t *data; /* the encoded file */
    size_t len;
    uint64_t seed;
} kiln_api_image;

kiln_status kiln_api_images_json(kiln_buf *out, int64_t created, const kiln_api_image *images,
                                 int n, kiln_image_format format, int width, int height,
                                 kiln_err *err);

#endif
