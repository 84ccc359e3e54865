/* kiln OpenAI Images API requests: reading /v1/images/generations and
 * /v1/images/edits bodies (JSON, or multipart/form-data) into a validated
 * generation request.
 *
 *   kiln_api_config cfg = {.model_id = "klein-4b", .traits = traits,  // from the replicas' hello
 *                          .limits = KILN_LIMITS_SERVICE, .image_limits = KILN_IMAGE_LIMITS_DEFAULT};
 *   kiln_api_request r;
 *   kiln_api_error e;
 *   if (kiln_api_parse(KILN_API_EDIT, content_type, body, len, &cfg, &r, &e))
 *       -> respond e.status with kiln_api_error_body(e.err.msg, e.param, ...)
 *   ... r.plan.req.width, r.plan.req.steps, r.plan.cfg, r.prompt, r.images[i] ...
 *   kiln_api_request_free(&r);
 *
 * Both routes accept both body forms: multipart/form-data when the
 * Content-Type says so, JSON otherwise (so `curl -d '{...}'` works without a
 * Content-Type).  Fields follow OpenAI's names; model-specific ones
 * (seed, num_inference_steps, guidance_scale, negative_prompt,
 * max_sequence_length) are kiln extensions.  Every OpenAI field is honoured,
 * accepted where kiln does what it asks anyway (docs/API.md says which), or
 * refused with OpenAI's code (unsupported_value for what kiln cannot do,
 * e.g. background "transparent"); unknown fields are refused as OpenAI does
 * (unknown_parameter) unless cfg->ignore_unknown.  Errors carry OpenAI's
 * codes and wording: invalid_type, integer_below_min_value,
 * integer_above_max_value, decimal_*, empty_string,
 * string_above_max_length, missing_required_parameter, invalid_value
 * (listing the supported values).  Reference images are decoded only to validate
 * them (a non-image is 400 here, not a failure inside the encoder) and are
 * kept as the original file bytes, which is exactly what the CLI's encoder
 * reads from the file.  Validation ends in the request plan
 * (kiln_plan_make, engine/plan.h) with the service limits and the traits
 * the replicas announced, so the CLI and the service accept and refuse
 * the same requests and agree on CFG and rows; the service then refuses a
 * request whose cost exceeds cfg->max_cost (400, code cost_limit_exceeded, the message giving
 * both).
 *
 * Pure (no I/O, no clock, no randomness: a request without a seed has
 * seed_given == 0 and the caller draws one); thread-safe on distinct
 * requests, so the gateway runs it on its worker pool.
 */
#ifndef KILN_GW_API_REQUEST_H
#define KILN_GW_API_REQUEST_H

#include <stddef.h>

#include "api_response.h"
#include "common/buf.h"
#include "common/error.h"
#include "common/image.h"
#include "engine/plan.h"

#define KILN_API_PARAM_MAX 32
#define KILN_API_MODEL_MAX 128
/* JSON bodies: values (cJSON nodes) and nesting a request may hold.  A
 * request has about twenty fields and at most KILN_MAX_REFS images; the
 * rest is room for ignored OpenAI fields. */
#define KILN_API_JSON_MAX_NODES 1024
#define KILN_API_JSON_MAX_DEPTH 16

typedef enum kiln_api_kind {
    KILN_API_GENERATE = 0, /* /v1/images/generations */
    KILN_API_EDIT,         /* /v1/images/edits: at least one image */
} kiln_api_kind;

typedef struct kiln_api_config {
    const char *model_id; /* the served model's name; requests may omit it */
    kiln_model_traits traits;
    kiln_limits limits;
    kiln_image_limits image_limits; /* uploads larger than this are refused */
    size_t max_body_bytes;          /* edits; generations get kiln_api_body_limit's share */
    double max_cost;                /* kiln_request_cost's ceiling per request; 0: none */
    /* Unknown fields are skipped instead of refused (kiln-gateway
     * --ignore-unknown-fields, for clients written for other servers). */
    int ignore_unknown;
    /* The pixels an edit's references may hold in all (their headers'
     * sizes, summed before any is decoded); 0: no limit. */
    int64_t max_ref_pixels;
} kiln_api_config;

typedef struct kiln_api_error {
    int status;                    /* HTTP status: 400, 413 or 500 */
    char param[KILN_API_PARAM_MAX]; /* the offending field, "" when none */
    const char *code;              /* OpenAI-style code ("invalid_value", "model_not_found", ...) */
    kiln_err err;                  /* message safe to show the client */
} kiln_api_error;

/* The user field's longest value (it goes into log lines). */
#define KILN_API_USER_MAX 256
/* A request id: the client's X-Request-Id (http_reader.h) or "req_" + 16
 * hex digits, with the NUL. */
#define KILN_REQUEST_ID_MAX 65

typedef struct kiln_api_request {
    kiln_api_kind kind;
    /* The id the gateway gives the request (routes.c; empty until then):
     * in its X-Request-Id header, in 5xx messages, and in the log lines
     * about it, so that a client's report leads to the details. */
    char request_id[KILN_REQUEST_ID_MAX];
    /* The request resolved into its plan (engine/plan.h): plan.req has the
     * width, height, n, steps, guidance, max_sequence_length, format and
     * compression; its string pointers point at the fields below and its
     * refs and mask are NULL (the decoded pixels were only needed to
     * validate).  plan.negative is what the encoder must encode: NULL when
     * the request runs without CFG, else negative_prompt or "" (diffusers'
     * default); plan.cost its kiln_request_cost in Mtok. */
    kiln_plan plan;
    char *prompt;          /* owned */
    char *negative_prompt; /* owned; NULL when absent */
    int seed_given;        /* 0: the caller picks req.seed */
    int n_images;          /* edit references, in upload order */
    kiln_buf images[KILN_MAX_REFS]; /* the original encoded files, owned */
    kiln_buf mask;         /* inpainting: the mask's PNG file, owned; empty: none */
    /* The response's echo of the request (OpenAI's quality and background
     * fields) and its usage (kiln_api_usage: the tokens the transformer
     * sees). */
    const char *quality;    /* static: "auto" when not given */
    int stream;             /* answer with server-sent events (kiln_api_stream_events) */
    int partial_images;     /* asked for (0..3); kiln sends none yet */
    kiln_api_usage usage;
    char *user;             /* owned; OpenAI's end-user id, for the logs; NULL when absent */
    uint64_t client;       /* who asked (clients.h; the caller sets it), 0: unknown */
} kiln_api_request;

/* Parses and validates a request body.  On success `out` owns its strings
 * and images (kiln_api_request_free).  On failure `out` holds nothing and
 * `e` says why (400 for bad input, 500 only for allocation failures). */
kiln_status kiln_api_parse(kiln_api_kind kind, const char *content_type, const void *body,
                           size_t len, const kiln_api_config *cfg, kiln_api_request *out,
                           kiln_api_error *e);

/* Accepts a zeroed or already freed request. */
void kiln_api_request_free(kiln_api_request *r);

/* The largest body a request of `kind` can need: edits carry images (up
 * to cfg->max_body_bytes); a generation holds text only, a prompt and a
 * negative prompt of at most limits.max_prompt_bytes each, in JSON's
 * escapes at worst 6 bytes per byte (\u00XX), plus room for the other
 * fields.  kiln_api_parse refuses more with 413; the HTTP server does so
 * from Content-Length, before reading. */
size_t kiln_api_body_limit(const kiln_api_config *cfg, kiln_api_kind kind);

#endif
