/* Internals of api_request.c shared with its two body readers
 * (api_json_in.c, api_form_in.c): a draft collects the fields as the body
 * gives them, then api_finish validates it into a kiln_api_request. */
#ifndef KILN_GW_API_IMPL_H
#define KILN_GW_API_IMPL_H

#include <cjson/cJSON.h>
#include <stdint.h>

#include "api_request.h"

typedef struct api_draft {
    kiln_api_kind kind;
    unsigned seen; /* one bit per field of the table in api_request.c */
    char *model, *prompt, *negative_prompt;
    int64_t n, steps, max_seq, compression;
    double guidance;
    int width, height; /* 0 x 0: "auto" */
    uint64_t seed;
    kiln_image_format format;
    int stream;
    int n_images;
    kiln_buf images[KILN_MAX_REFS];
} api_draft;

/* A field value as a body reader found it: text from a form field (a view,
 * not NUL-terminated) or a JSON value. */
typedef struct api_value {
    const char *text;
    size_t len;
    const cJSON *json; /* non-NULL for JSON bodies */
} api_value;

/* Sets the field `name` (ignored when unknown) from v.  400 on a bad value,
 * a duplicate or a refused field. */
kiln_status api_set(api_draft *d, const char *name, const api_value *v, kiln_api_error *e);

/* Appends a reference image's encoded bytes (copied). */
kiln_status api_add_image(api_draft *d, const void *data, size_t len, kiln_api_error *e);

/* Fills e: status 400 (or 500 for KILN_ERR_NOMEM), param, code, message. */
kiln_status api_fail(kiln_api_error *e, kiln_status st, const char *param, const char *code,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

kiln_status api_read_json(api_draft *d, const void *body, size_t len, kiln_api_error *e);
kiln_status api_read_form(api_draft *d, const char *content_type, const void *body, size_t len,
                          kiln_api_error *e);

#endif
