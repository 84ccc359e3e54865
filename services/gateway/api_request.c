#include "api_request.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "api_impl.h"

#define INVALID(e, param, ...) api_fail(e, KILN_ERR_INVALID, param, "invalid_value", __VA_ARGS__)
#define UNSUPPORTED(e, param, ...) \
    api_fail(e, KILN_ERR_INVALID, param, "unsupported_value", __VA_ARGS__)

#define SEEN(d, f) (((d)->seen >> (f)) & 1u)

/* A number as OpenAI quotes it in range errors. */
static const char *num_text(double v, char *buf, size_t cap)
{
    if (fabs(v) < 1e15)
        snprintf(buf, cap, "%.15g", v);
    else
        snprintf(buf, cap, "%.6g", v);
    return buf;
}

/* OpenAI's range errors: "Invalid 'n': integer above maximum value.
 * Expected a value <= 10, but got 11 instead." (integer_above_max_value;
 * decimal_* for numbers that need not be whole). */
static kiln_status check_range(api_draft *d, int field, const char *name, double v, double lo,
                               double hi, int decimal, kiln_api_error *e)
{
    if (!SEEN(d, field) || (v >= lo && v <= hi))
        return KILN_OK;
    char got[32], lim[32];
    const char *kind = decimal ? "decimal" : "integer";
    int above = v > hi;
    static const char *const codes[] = {"integer_above_max_value", "integer_below_min_value",
                                        "decimal_above_max_value", "decimal_below_min_value"};
    const char *c = codes[(decimal ? 2 : 0) + (above ? 0 : 1)];
    return api_fail(e, KILN_ERR_INVALID, name, c,
                    "Invalid '%s': %s %s value. Expected a value %s %s, but got %s instead.", name,
                    kind, above ? "above maximum" : "below minimum", above ? "<=" : ">=",
                    num_text(above ? hi : lo, lim, sizeof lim), num_text(v, got, sizeof got));
}

/* OpenAI's string checks: a required field missing, empty, or too long. */
static kiln_status check_text(const char *name, const char *s, int required, int allow_empty,
                              size_t max, kiln_api_error *e)
{
    if (!s)
        return required ? api_fail(e, KILN_ERR_INVALID, name, "missing_required_parameter",
                                   "Missing required parameter: '%s'.", name)
                        : KILN_OK;
    size_t len = strlen(s);
    if (!len && !allow_empty)
        return api_fail(e, KILN_ERR_INVALID, name, "empty_string",
                        "Invalid '%s': empty string. Expected a string with minimum length 1, "
                        "but got an empty string instead.", name);
    if (len > max)
        return api_fail(e, KILN_ERR_INVALID, name, "string_above_max_length",
                        "Invalid '%s': string too long. Expected a string with maximum length "
                        "%zu bytes, but got a string with length %zu instead.", name, max, len);
    return KILN_OK;
}

/* The OpenAI fields kiln cannot honour, refused with why (docs/API.md,
 * "Fields"). */
static kiln_status check_openai_fields(const api_draft *d, kiln_api_error *e)
{
    if (d->quality > Q_STANDARD)
        return UNSUPPORTED(e, "quality",
                           "quality '%s' is not supported: kiln renders one quality per model, "
                           "set by num_inference_steps; send 'auto' or leave quality out",
                           api_quality_name(d->quality));
    if (d->background == BG_TRANSPARENT)
        return UNSUPPORTED(e, "background",
                           "background 'transparent' is not supported: this model makes opaque "
                           "images (no alpha channel); send 'opaque' or 'auto'");
    if (d->style >= 0)
        return UNSUPPORTED(e, "style", "style is not supported: it selects DALL-E 3 presets, "
                                       "which this model does not have");
    if (d->input_fidelity == FID_LOW)
        return UNSUPPORTED(e, "input_fidelity",
                           "input_fidelity 'low' is not supported: this model always conditions "
                           "on the whole reference images (as 'high' does); send 'high' or leave "
                           "it out");
    return KILN_OK;
}

/* The request field a kiln_request_resolve message is about: its first
 * word, with width and height reported as `size`. */
static void param_of(const char *msg, char *param, size_t len)
{
    static const char *known[] = {"prompt", "negative_prompt", "n", "num_inference_steps",
                                  "guidance_scale", "max_sequence_length",
                                  "output_compression", "image", "size", "strength", "mask"};
    size_t w = strcspn(msg, " :");
    if ((w == 5 && strncmp(msg, "width", 5) == 0) || (w == 6 && strncmp(msg, "height", 6) == 0)) {
        snprintf(param, len, "size");
        return;
    }
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        if (strlen(known[i]) == w && strncmp(msg, known[i], w) == 0) {
            snprintf(param, len, "%s", known[i]);
            return;
        }
    if (strstr(msg, "reference"))
        snprintf(param, len, "image");
    else
        param[0] = '\0';
}

/* The field an error about reference i names, in param[KILN_API_PARAM_MAX]:
 * "image", or the element of OpenAI's JSON form ("images[i].image_url"). */
static const char *image_param(const api_draft *d, int i, char *param)
{
    if (d->images_field != F_IMAGES)
        return "image";
    snprintf(param, KILN_API_PARAM_MAX, "images[%d].image_url", i);
    return param;
}

/* Decoding a reference to validate it holds width x height x 3 bytes (a
 * 64 MP one 192 MiB, from as little as ~200 KiB of PNG).  Those over
 * BIG_REF_PIXELS are decoded one at a time across the parse threads, so
 * that the gateway holds about one of them decoded however many edits
 * bring them at once; smaller ones (up to 48 MiB) decode side by side. */
#define BIG_REF_PIXELS (16ll << 20)
static pthread_mutex_t big_decode = PTHREAD_MUTEX_INITIALIZER;

static kiln_status check_images(api_draft *d, const kiln_api_config *cfg, kiln_image *dims,
                                kiln_api_error *e)
{
    /* Their sizes from the headers first: references that would take
     * more than the limit to decode (decompression bombs: a flat 64 MP
     * PNG is ~200 KiB) are refused before a pixel is decoded, here and in
     * the encoder, which decodes each again. */
    int64_t total = 0, pixels[KILN_MAX_REFS];
    char buf[KILN_API_PARAM_MAX];
    for (int i = 0; i < d->n_images; i++) {
        kiln_err err = {0};
        int w, h;
        if (kiln_image_probe(d->images[i].data, d->images[i].len, &cfg->image_limits, &w, &h,
                             &err))
            return api_fail(e, err.code, image_param(d, i, buf), "invalid_image",
                            "image %d: %s", i + 1, err.msg);
        pixels[i] = (int64_t)w * h;
        total += pixels[i];
    }
    if (cfg->max_ref_pixels > 0 && total > cfg->max_ref_pixels)
        return api_fail(e, KILN_ERR_INVALID, d->images_field == F_IMAGES ? "images" : "image",
                        "invalid_image",
                        "the %d image(s) hold %.1f megapixels in all and this server's limit is "
                        "%.1f; %ssend them smaller", d->n_images, (double)total / (1 << 20),
                        (double)cfg->max_ref_pixels / (1 << 20),
                        cfg->traits.shrink_images
                            ? "the model scales each image to at most 1 megapixel, so "
                            : "");
    for (int i = 0; i < d->n_images; i++) {
        const char *param = image_param(d, i, buf);
        kiln_image img = {0};
        kiln_err err = {0};
        int big = pixels[i] > BIG_REF_PIXELS;
        if (big)
            pthread_mutex_lock(&big_decode);
        kiln_status st = kiln_image_decode(d->images[i].data, d->images[i].len,
                                           &cfg->image_limits, &img, &err);
        dims[i].width = img.width, dims[i].height = img.height; /* only its size is kept */
        kiln_image_free(&img);
        if (big)
            pthread_mutex_unlock(&big_decode);
        if (st)
            return api_fail(e, err.code, param, err.code == KILN_ERR_NOMEM ? "server_error"
                                                                             : "invalid_image",
                            "image %d: %s", i + 1, err.msg);
        int w, h;
        /* The encoder refuses these too; refusing here gives the client a
         * 400 before the request queues. */
        if (kiln_request_image_size(&cfg->traits, dims[i].width, dims[i].height, &w, &h, &err))
            return api_fail(e, KILN_ERR_INVALID, param, "invalid_image", "image %d: %s", i + 1,
                            err.msg);
    }
    return KILN_OK;
}

/* The tokens the transformer sees (kiln_api_usage). */
static kiln_api_usage usage_of(const kiln_plan *plan, const kiln_model_traits *traits,
                               const kiln_image *refs, int n_refs)
{
    const kiln_request *q = &plan->req;
    kiln_api_usage u = {0};
    u.text_tokens = (int64_t)q->max_sequence_length * (plan->cfg ? 2 : 1);
    for (int i = 0; i < n_refs; i++) {
        int w, h;
        if (kiln_request_image_size(traits, refs[i].width, refs[i].height, &w, &h, NULL) == 0)
            u.image_tokens += (int64_t)(w / 16) * (h / 16);
    }
    u.output_tokens = (int64_t)plan->rows * (q->width / 16) * (q->height / 16);
    return u;
}

static kiln_status finish(api_draft *d, const kiln_api_config *cfg, kiln_api_request *out,
                          kiln_api_error *e)
{
    const kiln_limits *lim = &cfg->limits;
    if (check_openai_fields(d, e))
        return e->err.code;
    if (d->model && strcmp(d->model, cfg->model_id) != 0)
        return api_fail(e, KILN_ERR_INVALID, "model", "model_not_found",
                        "The model '%.64s' does not exist; this server serves '%s'", d->model,
                        cfg->model_id);
    if (check_text("prompt", d->prompt, 1, 0, lim->max_prompt_bytes, e) ||
        check_text("negative_prompt", d->negative_prompt, 0, 1, lim->max_prompt_bytes, e) ||
        check_text("user", d->user, 0, 1, KILN_API_USER_MAX, e))
        return e->err.code;
    if (d->kind == KILN_API_EDIT && d->n_images == 0)
        return api_fail(e, KILN_ERR_INVALID, "image", "missing_required_parameter",
                        "Missing required parameter: 'image' (or 'images'): send one or more "
                        "reference images");
    if (check_range(d, F_N, "n", d->n, 1, lim->max_n, 0, e) ||
        check_range(d, F_STEPS, "num_inference_steps", d->steps, 1, lim->max_steps, 0, e) ||
        check_range(d, F_MAX_SEQ, "max_sequence_length", d->max_seq, 1, 512, 0, e) ||
        check_range(d, F_GUIDANCE, "guidance_scale", d->guidance, 0, 100, 1, e) ||
        check_range(d, F_COMPRESSION, "output_compression", d->compression, 0, 100, 0, e) ||
        check_range(d, F_PARTIAL_IMAGES, "partial_images", d->partial_images, 0, 3, 0, e) ||
        check_range(d, F_STRENGTH, "strength", d->strength, 0, 1, 1, e))
        return e->err.code;
    /* strength's range is (0, 1]: 0 would leave the image as it is. */
    if (SEEN(d, F_STRENGTH) && d->strength == 0)
        return api_fail(e, KILN_ERR_INVALID, "strength", "decimal_below_min_value",
                        "Invalid 'strength': decimal below minimum value. Expected a value > 0, "
                        "but got 0 instead.");

    kiln_image dims[KILN_MAX_REFS] = {{0}};
    if (check_images(d, cfg, dims, e))
        return e->err.code;
    /* The mask is decoded only to validate it (and read its size), as the
     * images are; the encoder reads the file (engine/inpaint.h). */
    kiln_image mask_dims = {0};
    if (d->has_mask) {
        kiln_image m = {0};
        kiln_err merr = {0};
        if (kiln_image_decode_mask(d->mask.data, d->mask.len, &cfg->image_limits, &m, &merr))
            return api_fail(e, merr.code, "mask",
                            merr.code == KILN_ERR_NOMEM ? "server_error" : "invalid_image",
                            "mask: %s", merr.msg);
        mask_dims.width = m.width, mask_dims.height = m.height;
        kiln_image_free(&m);
    }

    memset(out, 0, sizeof *out);
    kiln_request req, *q = &req;
    kiln_request_init(q);
    q->prompt = d->prompt;
    q->negative_prompt = d->negative_prompt;
    q->n = SEEN(d, F_N) ? (int)d->n : 0;
    q->width = d->width, q->height = d->height;
    q->seed = d->seed;
    q->steps = SEEN(d, F_STEPS) ? (int)d->steps : 0;
    if (SEEN(d, F_GUIDANCE))
        q->guidance = (float)d->guidance;
    q->max_sequence_length = SEEN(d, F_MAX_SEQ) ? (int)d->max_seq : 0;
    q->refs = d->n_images ? dims : NULL;
    q->n_refs = d->n_images;
    q->format = d->format;
    q->compression = SEEN(d, F_COMPRESSION) ? (int)d->compression : -1;
    q->strength = SEEN(d, F_STRENGTH) ? d->strength : 0;
    q->mask = d->has_mask ? &mask_dims : NULL;
    kiln_err err = {0};
    /* Resolved as the CLI resolves it (engine/plan.h): defaults, CFG and
     * its negative prompt, rows, cost. */
    kiln_plan *plan = &out->plan;
    if (kiln_plan_make(plan, q, NULL, 1, &cfg->traits, lim, &err)) {
        char param[KILN_API_PARAM_MAX];
        param_of(err.msg, param, sizeof param);
        return api_fail(e, err.code, param, "invalid_value", "%s", err.msg);
    }
    out->usage = usage_of(plan, &cfg->traits, dims, d->n_images);
    plan->req.refs = NULL;
    plan->req.mask = NULL;
    q = &plan->req;
    if (cfg->max_cost > 0 && plan->cost > cfg->max_cost)
        return api_fail(e, KILN_ERR_INVALID, "", "cost_limit_exceeded",
                        "the request is too large: its cost is %.3g Mtok (%dx%d, n %d, %d steps%s, "
                        "%d reference(s)) and this server's limit is %.3g Mtok per request; "
                        "ask for fewer images, fewer steps or a smaller size",
                        plan->cost, q->width, q->height, q->n, q->steps,
                        plan->cfg ? " with CFG" : "", d->n_images, cfg->max_cost);
    out->kind = d->kind;
    out->prompt = d->prompt, d->prompt = NULL;
    out->negative_prompt = d->negative_prompt, d->negative_prompt = NULL;
    out->seed_given = SEEN(d, F_SEED);
    out->quality = api_quality_name(d->quality);
    out->stream = d->stream;
    out->partial_images = SEEN(d, F_PARTIAL_IMAGES) ? (int)d->partial_images : 0;
    out->user = d->user, d->user = NULL;
    out->mask = d->mask, d->mask = (kiln_buf){0};
    out->n_images = d->n_images;
    for (int i = 0; i < d->n_images; i++)
        out->images[i] = d->images[i], d->images[i] = (kiln_buf){0};
    d->n_images = 0;
    return KILN_OK;
}

static void draft_free(api_draft *d)
{
    free(d->model);
    free(d->user);
    kiln_buf_free(&d->mask);
    free(d->prompt);
    free(d->negative_prompt);
    for (int i = 0; i < d->n_images; i++)
        kiln_buf_free(&d->images[i]);
}

size_t kiln_api_body_limit(const kiln_api_config *cfg, kiln_api_kind kind)
{
    size_t text = 2 * 6 * cfg->limits.max_prompt_bytes + (64u << 10);
    if (kind == KILN_API_EDIT || text > cfg->max_body_bytes)
        return cfg->max_body_bytes;
    return text;
}

kiln_status kiln_api_parse(kiln_api_kind kind, const char *content_type, const void *body,
                           size_t len, const kiln_api_config *cfg, kiln_api_request *out,
                           kiln_api_error *e)
{
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    size_t limit = kiln_api_body_limit(cfg, kind);
    if (len > limit)
        return api_fail(e, KILN_ERR_TOO_LARGE, "", "too_large",
                        "request body is too large: at most %zu bytes%s", limit,
                        kind == KILN_API_EDIT ? "" : " (only edits carry images)");
    api_draft d = {.kind = kind, .format = KILN_IMAGE_PNG, .ignore_unknown = cfg->ignore_unknown,
                   .quality = -1, .background = -1, .moderation = -1, .style = -1,
                   .input_fidelity = -1};
    const char *ct = content_type ? content_type : "";
    while (*ct == ' ' || *ct == '\t')
        ct++;
    kiln_status st = strncasecmp(ct, "multipart/", 10) == 0
                         ? api_read_form(&d, ct, body, len, e)
                         : api_read_json(&d, body, len, e);
    if (!st)
        st = finish(&d, cfg, out, e);
    if (st)
        memset(out, 0, sizeof *out);
    /* The request took what it kept; the rest goes. */
    draft_free(&d);
    return st;
}

void kiln_api_request_free(kiln_api_request *r)
{
    free(r->prompt);
    free(r->negative_prompt);
    free(r->user);
    kiln_buf_free(&r->mask);
    for (int i = 0; i < r->n_images; i++)
        kiln_buf_free(&r->images[i]);
    memset(r, 0, sizeof *r);
}
