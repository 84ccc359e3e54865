/* Internals of api_request.c shared with the field reader (api_fields.c)
 * and the two body readers (api_json_in.c, api_form_in.c): a draft
 * collects the fields as the body gives them (type-checked as they come),
 * then api_request.c's finish checks ranges and validates it into a
 * kiln_api_request. */
#ifndef KILN_GW_API_IMPL_H
#define KILN_GW_API_IMPL_H

#include <cjson/cJSON.h>
#include <stdint.h>

#include "api_request.h"

/* The request fields kiln knows, OpenAI's and its own extensions.  The
 * table that names them, says their types and the routes they belong to
 * is in api_fields.c. */
typedef enum api_field {
    F_MODEL, F_PROMPT, F_NEGATIVE, F_N, F_SIZE, F_SEED, F_STEPS, F_GUIDANCE, F_RESPONSE_FORMAT,
    F_OUTPUT_FORMAT, F_COMPRESSION, F_MAX_SEQ, F_STREAM, F_PARTIAL_IMAGES, F_QUALITY,
    F_BACKGROUND, F_MODERATION, F_STYLE, F_USER, F_INPUT_FIDELITY, F_IMAGE, F_IMAGE_ARRAY,
    F_IMAGES, F_MASK, F_STRENGTH, F_COUNT
} api_field;

/* Values of the enumerated string fields (index into their lists in
 * api_fields.c); -1: not given. */
enum { Q_AUTO, Q_STANDARD, Q_LOW, Q_MEDIUM, Q_HIGH, Q_HD };
enum { BG_AUTO, BG_OPAQUE, BG_TRANSPARENT };
enum { FID_LOW, FID_HIGH };

typedef struct api_draft {
    kiln_api_kind kind;
    int ignore_unknown; /* kiln_api_config.ignore_unknown */
    uint64_t seen;      /* one bit per api_field given */
    char *model, *prompt, *negative_prompt, *user;
    /* Integers as given (whole numbers, range-checked by finish so that
     * the error can quote them). */
    double n, steps, max_seq, compression, partial_images;
    double guidance, strength;
    int width, height; /* 0 x 0: "auto" */
    uint64_t seed;
    kiln_image_format format;
    int stream;
    int quality, background, moderation, style, input_fidelity; /* enum indices */
    int n_images;
    int images_field; /* F_IMAGE, F_IMAGE_ARRAY or F_IMAGES: the field that gave them */
    kiln_buf images[KILN_MAX_REFS];
    int has_mask;
    kiln_buf mask;    /* the mask's PNG file */
} api_draft;

/* A field value as a body reader found it: text from a form field (a view,
 * not NUL-terminated) or a JSON value. */
typedef struct api_value {
    const char *text;
    size_t len;
    const cJSON *json; /* non-NULL for JSON bodies */
} api_value;

/* The field called `name` on d's route, or -1 (unknown, or a field of the
 * other route). */
int api_field_find(const api_draft *d, const char *name);

/* Sets the field `name` from v (a null JSON value is "not given").  400 on
 * a value of the wrong type, a duplicate, an unknown field (code
 * unknown_parameter, unless d->ignore_unknown: then it is skipped) or a
 * value kiln refuses.  Images go through api_add_image. */
kiln_status api_set(api_draft *d, const char *name, const api_value *v, kiln_api_error *e);

/* Keeps the mask's file bytes (copied); once. */
kiln_status api_set_mask(api_draft *d, const void *data, size_t len, kiln_api_error *e);

/* Appends a reference image's encoded bytes (copied); `param` names the
 * field in errors. */
kiln_status api_add_image(api_draft *d, const char *param, const void *data, size_t len,
                          kiln_api_error *e);

/* Fills e: status 400 (413 for KILN_ERR_TOO_LARGE, 500 for
 * KILN_ERR_NOMEM), param, code, message. */
kiln_status api_fail(kiln_api_error *e, kiln_status st, const char *param, const char *code,
                     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* OpenAI's wording for a value of the wrong JSON type:
 * "Invalid type for 'n': expected an integer, but got a string instead."
 * (code invalid_type).  `want` is "a string", "an integer", ... */
kiln_status api_bad_type(kiln_api_error *e, const char *param, const char *want,
                         const cJSON *got);

/* The name of a quality value ("auto" for -1). */
const char *api_quality_name(int q);

/* "Unknown parameter: 'name'." (code unknown_parameter). */
kiln_status api_unknown(kiln_api_error *e, const char *name);

kiln_status api_read_json(api_draft *d, const void *body, size_t len, kiln_api_error *e);
kiln_status api_read_form(api_draft *d, const char *content_type, const void *body, size_t len,
                          kiln_api_error *e);

#endif
