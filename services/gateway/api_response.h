/* kiln OpenAI-shaped response bodies: errors and generated images.
 *
 *   kiln_buf body = {0};
 *   kiln_api_error_json(&body, 400, "n must be between 1 and 10", "n", "invalid_value", &err);
 *   // {"error":{"message":"n must ...","type":"invalid_request_error","param":"n","code":"invalid_value"}}
 *
 *   kiln_api_image imgs[] = {{png, png_len, 42}, ...};
 *   kiln_api_images_meta m = {time(NULL), KILN_IMAGE_PNG, 1024, 1024, "auto", "opaque", usage};
 *   kiln_api_images_json(&body, &m, imgs, 2, &err);
 *   // {"created":...,"data":[{"b64_json":"...","seed":42,"revised_prompt":null},...],
 *   //  "background":"opaque","output_format":"png","quality":"auto","size":"1024x1024",
 *   //  "usage":{"input_tokens":...,...}}
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

/* OpenAI's `usage` of an images response, as kiln counts tokens: the
 * tokens its transformer sees.  Text: max_sequence_length per encoded
 * prompt (klein pads or truncates every prompt to it; twice with
 * classifier-free guidance, for the negative prompt).  Image (input): the
 * packed latent tokens (16 x 16 pixel patches) of the edit references at
 * their prepared size.  Output: the packed latent tokens of the n images.
 * input_tokens = text + image, total_tokens = input + output. */
typedef struct kiln_api_usage {
    int64_t text_tokens, image_tokens, output_tokens;
} kiln_api_usage;

/* What an images response says besides its images. */
typedef struct kiln_api_images_meta {
    int64_t created;
    kiln_image_format format;
    int width, height;
    const char *quality;    /* echoed as asked ("auto" by default) */
    const char *background; /* what the images have: "opaque" (kiln's models make no alpha) */
    kiln_api_usage usage;
} kiln_api_images_meta;

typedef struct kiln_api_image {
    const uint8_t *data; /* the encoded file */
    size_t len;
    uint64_t seed;
} kiln_api_image;

kiln_status kiln_api_images_json(kiln_buf *out, const kiln_api_images_meta *meta,
                                 const kiln_api_image *images, int n, kiln_err *err);

/* The answer to a `stream: true` request as OpenAI's server-sent events:
 * per image i, "event: image_generation.completed\ndata: {...}\n\n"
 * (image_edit.completed for edits) whose data has OpenAI's
 * ImageGenCompletedEvent fields (type, b64_json, background, created_at,
 * output_format, quality, size, usage) and kiln's seed.  The input tokens
 * count on the first event, each image's output tokens on its own, so the
 * events' usage sums to the request's.  The previews before them are
 * kiln_api_partial_events. */
kiln_status kiln_api_stream_events(kiln_buf *out, const kiln_api_images_meta *meta,
                                   const kiln_api_image *images, int n, int edit, kiln_err *err);

/* Preview `index` of a streamed request as OpenAI's events: per image i,
 * "event: image_generation.partial_image\ndata: {...}\n\n"
 * (image_edit.partial_image for edits) with the fields of OpenAI's
 * ImageGenPartialImageEvent (type, b64_json, background, created_at,
 * output_format, partial_image_index, quality, size) and kiln's seed (which
 * image of n it previews). */
kiln_status kiln_api_partial_events(kiln_buf *out, const kiln_api_images_meta *meta,
                                    const kiln_api_image *images, int n, int index, int edit,
                                    kiln_err *err);

/* An error after a stream began (its 200 is out): "event: error\ndata:
 * {"type":"error","error":{...}}\n\n" with kiln_api_error_json's object,
 * which openai-python's stream iterator raises as an APIError. */
kiln_status kiln_api_stream_error(kiln_buf *out, int status, const char *message,
                                  const char *code, kiln_err *err);

/* Appends OpenAI's usage object:
 * {"input_tokens":..,"input_tokens_details":{"image_tokens":..,"text_tokens":..},
 *  "output_tokens":..,"total_tokens":..}. */
kiln_status kiln_api_usage_json(kiln_buf *out, const kiln_api_usage *u, kiln_err *err);

#endif
