#include "api_request.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "api_impl.h"

typedef enum field_type { T_STR, T_INT, T_NUM, T_SEED, T_BOOL, T_IMAGE, T_REFUSED } field_type;

typedef enum field_id {
    F_MODEL, F_PROMPT, F_NEGATIVE, F_N, F_SIZE, F_SEED, F_STEPS, F_GUIDANCE, F_RESPONSE_FORMAT,
    F_OUTPUT_FORMAT, F_COMPRESSION, F_MAX_SEQ, F_STREAM, F_IMAGE, F_IMAGE_ARRAY, F_MASK,
} field_id;

static const struct {
    const char *name;
    field_type type;
} fields[] = {
    [F_MODEL] = {"model", T_STR},
    [F_PROMPT] = {"prompt", T_STR},
    [F_NEGATIVE] = {"negative_prompt", T_STR},
    [F_N] = {"n", T_INT},
    [F_SIZE] = {"size", T_STR},
    [F_SEED] = {"seed", T_SEED},
    [F_STEPS] = {"num_inference_steps", T_INT},
    [F_GUIDANCE] = {"guidance_scale", T_NUM},
    [F_RESPONSE_FORMAT] = {"response_format", T_STR},
    [F_OUTPUT_FORMAT] = {"output_format", T_STR},
    [F_COMPRESSION] = {"output_compression", T_INT},
    [F_MAX_SEQ] = {"max_sequence_length", T_INT},
    [F_STREAM] = {"stream", T_BOOL},
    [F_IMAGE] = {"image", T_IMAGE},
    [F_IMAGE_ARRAY] = {"image[]", T_IMAGE},
    [F_MASK] = {"mask", T_REFUSED},
};
#define N_FIELDS ((int)(sizeof fields / sizeof fields[0]))

kiln_status api_fail(kiln_api_error *e, kiln_status st, const char *param, const char *code,
                     const char *fmt, ...)
{
    e->status = st == KILN_ERR_NOMEM ? 500 : st == KILN_ERR_TOO_LARGE ? 413 : 400;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    e->code = code;
    e->err.code = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err.msg, sizeof e->err.msg, fmt, ap);
    va_end(ap);
    return st;
}

#define INVALID(e, param, ...) api_fail(e, KILN_ERR_INVALID, param, "invalid_value", __VA_ARGS__)
#define NOMEM(e) api_fail(e, KILN_ERR_NOMEM, NULL, "server_error", "out of memory")

/* ---- typed values: JSON values must have the JSON type; form text is
 * parsed strictly (the whole field, no blanks). ---- */

static kiln_status get_string(const api_value *v, const char *name, char **out,
                              kiln_api_error *e)
{
    const char *s = v->text;
    size_t len = v->len;
    if (v->json) {
        if (!cJSON_IsString(v->json))
            return INVALID(e, name, "%s must be a string", name);
        s = v->json->valuestring;
        len = strlen(s);
    } else if (memchr(s, '\0', len)) {
        return INVALID(e, name, "%s must not contain NUL bytes", name);
    }
    char *c = malloc(len + 1);
    if (!c)
        return NOMEM(e);
    memcpy(c, s, len);
    c[len] = '\0';
    *out = c;
    return KILN_OK;
}

/* Strict decimal text: optional '-', 1..19 digits. */
static int parse_decimal(const char *s, size_t len, int allow_minus, uint64_t *mag, int *neg)
{
    size_t i = 0;
    *neg = 0;
    if (allow_minus && len && s[0] == '-')
        *neg = 1, i = 1;
    if (i == len)
        return -1;
    uint64_t v = 0;
    for (; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        unsigned d = (unsigned)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    *mag = v;
    return 0;
}

/* Integers beyond int range are clamped so the range checks refuse them
 * with their usual message. */
static kiln_status get_int(const api_value *v, const char *name, int64_t *out, kiln_api_error *e)
{
    double d;
    if (v->json) {
        if (!cJSON_IsNumber(v->json) || !isfinite(v->json->valuedouble) ||
            v->json->valuedouble != floor(v->json->valuedouble))
            return INVALID(e, name, "%s must be an integer", name);
        d = v->json->valuedouble;
    } else {
        uint64_t mag;
        int neg;
        if (parse_decimal(v->text, v->len, 1, &mag, &neg))
            return INVALID(e, name, "%s must be an integer", name);
        d = neg ? -(double)mag : (double)mag;
    }
    *out = d > INT_MAX ? INT_MAX : d < INT_MIN ? INT_MIN : (int64_t)d;
    return KILN_OK;
}

static kiln_status get_num(const api_value *v, const char *name, double *out, kiln_api_error *e)
{
    if (v->json) {
        if (!cJSON_IsNumber(v->json))
            return INVALID(e, name, "%s must be a number", name);
        *out = v->json->valuedouble;
        return KILN_OK;
    }
    char buf[64];
    if (v->len == 0 || v->len >= sizeof buf)
        return INVALID(e, name, "%s must be a number", name);
    memcpy(buf, v->text, v->len);
    buf[v->len] = '\0';
    char *end;
    errno = 0;
    *out = strtod(buf, &end);
    /* strtod also reads "nan", "inf" and hex floats, which JSON never has. */
    if (*end || errno || !isfinite(*out) || strpbrk(buf, "xXnN"))
        return INVALID(e, name, "%s must be a number", name);
    return KILN_OK;
}

/* Seeds are unsigned 64-bit as torch's manual_seed takes them.  A JSON
 * number is exact only up to 2^53, so larger seeds come as decimal
 * strings. */
static kiln_status get_seed(const api_value *v, uint64_t *out, kiln_api_error *e)
{
    static const char msg[] = "seed must be an integer between 0 and 18446744073709551615 "
                              "(above 2^53 as a decimal string)";
    const char *s = v->text;
    size_t len = v->len;
    if (v->json && cJSON_IsNumber(v->json)) {
        double d = v->json->valuedouble;
        if (!(d >= 0 && d <= 9007199254740992.0) || d != floor(d))
            return INVALID(e, "seed", "%s", msg);
        *out = (uint64_t)d;
        return KILN_OK;
    }
    if (v->json) {
        if (!cJSON_IsString(v->json))
            return INVALID(e, "seed", "%s", msg);
        s = v->json->valuestring;
        len = strlen(s);
    }
    int neg;
    if (parse_decimal(s, len, 0, out, &neg))
        return INVALID(e, "seed", "%s", msg);
    return KILN_OK;
}

static kiln_status get_bool(const api_value *v, const char *name, int *out, kiln_api_error *e)
{
    if (v->json) {
        if (!cJSON_IsBool(v->json))
            return INVALID(e, name, "%s must be true or false", name);
        *out = cJSON_IsTrue(v->json);
        return KILN_OK;
    }
    if (v->len == 4 && memcmp(v->text, "true", 4) == 0)
        *out = 1;
    else if (v->len == 5 && memcmp(v->text, "false", 5) == 0)
        *out = 0;
    else
        return INVALID(e, name, "%s must be true or false", name);
    return KILN_OK;
}

/* "WxH" with 1..5 digits a side, or "auto". */
static kiln_status parse_size(const char *s, int *w, int *h, kiln_api_error *e)
{
    if (strcmp(s, "auto") == 0) {
        *w = *h = 0;
        return KILN_OK;
    }
    const char *x = strchr(s, 'x');
    uint64_t a, b;
    int neg;
    if (!x || x - s > 5 || strlen(x + 1) > 5 || parse_decimal(s, (size_t)(x - s), 0, &a, &neg) ||
        parse_decimal(x + 1, strlen(x + 1), 0, &b, &neg) || a == 0 || b == 0)
        return INVALID(e, "size", "size must be \"WIDTHxHEIGHT\" (e.g. \"1024x1024\") or \"auto\"");
    *w = (int)a, *h = (int)b;
    return KILN_OK;
}

static kiln_status set_string_field(api_draft *d, field_id id, const api_value *v,
                                    kiln_api_error *e)
{
    const char *name = fields[id].name;
    char *s = NULL;
    if (get_string(v, name, &s, e))
        return e->err.code;
    kiln_status st = KILN_OK;
    switch (id) {
    case F_MODEL: d->model = s, s = NULL; break;
    case F_PROMPT: d->prompt = s, s = NULL; break;
    case F_NEGATIVE: d->negative_prompt = s, s = NULL; break;
    case F_SIZE: st = parse_size(s, &d->width, &d->height, e); break;
    case F_RESPONSE_FORMAT:
        if (strcmp(s, "url") == 0)
            st = api_fail(e, KILN_ERR_INVALID, name, "unsupported_value",
                          "response_format \"url\" is not supported: kiln does not store "
                          "images, it returns them inline; use \"b64_json\"");
        else if (strcmp(s, "b64_json") != 0)
            st = INVALID(e, name, "response_format must be \"b64_json\"");
        break;
    case F_OUTPUT_FORMAT:
        if (kiln_image_format_parse(s, &d->format))
            st = INVALID(e, name, "output_format must be \"png\", \"jpeg\" or \"webp\"");
        break;
    default: break;
    }
    free(s);
    return st;
}

kiln_status api_add_image(api_draft *d, const void *data, size_t len, kiln_api_error *e)
{
    if (d->kind != KILN_API_EDIT)
        return INVALID(e, "image", "image is accepted by /v1/images/edits only");
    if (d->n_images == KILN_MAX_REFS)
        return INVALID(e, "image", "at most %d reference images are allowed", KILN_MAX_REFS);
    kiln_buf *b = &d->images[d->n_images];
    if (kiln_buf_append(b, data, len, NULL))
        return NOMEM(e);
    d->n_images++;
    return KILN_OK;
}

kiln_status api_set(api_draft *d, const char *name, const api_value *v, kiln_api_error *e)
{
    int id = 0;
    while (id < N_FIELDS && strcmp(fields[id].name, name) != 0)
        id++;
    if (id == N_FIELDS)
        return KILN_OK; /* OpenAI fields that do not apply, and unknown ones */
    if (v->json && cJSON_IsNull(v->json))
        return KILN_OK; /* clients send null for "not given" */
    field_type t = fields[id].type;
    if (t == T_REFUSED)
        return api_fail(e, KILN_ERR_INVALID, name, "unsupported_value",
                        "%s is not supported: FLUX.2 klein edits take reference images, "
                        "not masks", name);
    if (t == T_IMAGE) {
        if (v->json)
            return INVALID(e, name, "internal: JSON images go through api_read_json");
        return api_add_image(d, v->text, v->len, e);
    }
    if (d->seen & (1u << id))
        return INVALID(e, name, "%s is given more than once", name);
    d->seen |= 1u << id;
    switch (t) {
    case T_STR: return set_string_field(d, (field_id)id, v, e);
    case T_INT:
        return get_int(v, name, id == F_N ? &d->n : id == F_STEPS ? &d->steps
                                       : id == F_COMPRESSION ? &d->compression : &d->max_seq, e);
    case T_NUM: return get_num(v, name, &d->guidance, e);
    case T_SEED: return get_seed(v, &d->seed, e);
    case T_BOOL: return get_bool(v, name, &d->stream, e);
    default: return KILN_OK;
    }
}

/* The request field a kiln_request_resolve message is about: its first
 * word, with width and height reported as `size`. */
static void param_of(const char *msg, char *param, size_t len)
{
    static const char *known[] = {"prompt", "negative_prompt", "n", "num_inference_steps",
                                  "guidance_scale", "max_sequence_length",
                                  "output_compression", "image", "size"};
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

static kiln_status check_images(api_draft *d, const kiln_api_config *cfg, kiln_image *dims,
                                kiln_api_error *e)
{
    for (int i = 0; i < d->n_images; i++) {
        kiln_image img = {0};
        kiln_err err = {0};
        if (kiln_image_decode(d->images[i].data, d->images[i].len, &cfg->image_limits, &img,
                              &err))
            return api_fail(e, err.code, "image", err.code == KILN_ERR_NOMEM ? "server_error"
                                                                             : "invalid_image",
                            "image %d: %s", i + 1, err.msg);
        dims[i].width = img.width, dims[i].height = img.height;
        kiln_image_free(&img);
        int w, h;
        /* The encoder refuses these too; refusing here gives the client a
         * 400 before the request queues. */
        if (kiln_image_flux2_ref_size(dims[i].width, dims[i].height, &w, &h, &err))
            return api_fail(e, KILN_ERR_INVALID, "image", "invalid_image", "image %d: %s", i + 1,
                            err.msg);
    }
    return KILN_OK;
}

static kiln_status finish(api_draft *d, const kiln_api_config *cfg, kiln_api_request *out,
                          kiln_api_error *e)
{
    const kiln_limits *lim = &cfg->limits;
    if (d->stream)
        return api_fail(e, KILN_ERR_INVALID, "stream", "unsupported_value",
                        "stream is not supported: images are returned when complete");
    if (d->model && strcmp(d->model, cfg->model_id) != 0)
        return api_fail(e, KILN_ERR_INVALID, "model", "model_not_found",
                        "The model '%.64s' does not exist; this server serves '%s'", d->model,
                        cfg->model_id);
    if (d->kind == KILN_API_EDIT && d->n_images == 0)
        return INVALID(e, "image", "image is required: send one or more reference images");
    /* Values that kiln_request uses as "not given" must not pass as given. */
    if ((d->seen & (1u << F_N)) && d->n < 1)
        return INVALID(e, "n", "n must be between 1 and %d", lim->max_n);
    if ((d->seen & (1u << F_STEPS)) && d->steps < 1)
        return INVALID(e, "num_inference_steps", "num_inference_steps must be between 1 and %d",
                       lim->max_steps);
    if ((d->seen & (1u << F_MAX_SEQ)) && d->max_seq < 1)
        return INVALID(e, "max_sequence_length", "max_sequence_length must be between 1 and 512");
    if ((d->seen & (1u << F_GUIDANCE)) && !(d->guidance >= 0))
        return INVALID(e, "guidance_scale", "guidance_scale must be between 0 and 100");
    if ((d->seen & (1u << F_COMPRESSION)) && d->compression < 0)
        return INVALID(e, "output_compression", "output_compression must be between 0 and 100");

    kiln_image dims[KILN_MAX_REFS] = {{0}};
    if (check_images(d, cfg, dims, e))
        return e->err.code;

    memset(out, 0, sizeof *out);
    kiln_request *q = &out->req;
    kiln_request_init(q);
    q->prompt = d->prompt;
    q->negative_prompt = d->negative_prompt;
    q->n = (d->seen & (1u << F_N)) ? (int)d->n : 0;
    q->width = d->width, q->height = d->height;
    q->seed = d->seed;
    q->steps = (d->seen & (1u << F_STEPS)) ? (int)d->steps : 0;
    if (d->seen & (1u << F_GUIDANCE))
        q->guidance = d->guidance > 1e9 ? 1e9f : (float)d->guidance;
    q->max_sequence_length = (d->seen & (1u << F_MAX_SEQ)) ? (int)d->max_seq : 0;
    q->refs = d->n_images ? dims : NULL;
    q->n_refs = d->n_images;
    q->format = d->format;
    q->compression = (d->seen & (1u << F_COMPRESSION)) ? (int)d->compression : -1;
    kiln_err err = {0};
    if (kiln_request_resolve(q, &cfg->traits, lim, &err)) {
        char param[KILN_API_PARAM_MAX];
        param_of(err.msg, param, sizeof param);
        return api_fail(e, err.code, param, "invalid_value", "%s", err.msg);
    }
    /* As the CLI: CFG runs on base checkpoints when guidance > 1. */
    int cfg_runs = cfg->traits.cfg && q->guidance > 1.0f;
    double cost = kiln_request_cost(q, &cfg->traits, cfg_runs);
    q->refs = NULL;
    if (cfg->max_cost > 0 && cost > cfg->max_cost)
        return api_fail(e, KILN_ERR_INVALID, "", "cost_limit_exceeded",
                        "the request is too large: its cost is %.3g Mtok (%dx%d, n %d, %d steps%s, "
                        "%d reference(s)) and this server's limit is %.3g Mtok per request; "
                        "ask for fewer images, fewer steps or a smaller size",
                        cost, q->width, q->height, q->n, q->steps, cfg_runs ? " with CFG" : "",
                        d->n_images, cfg->max_cost);
    out->kind = d->kind;
    out->prompt = d->prompt, d->prompt = NULL;
    out->negative_prompt = d->negative_prompt, d->negative_prompt = NULL;
    out->seed_given = (d->seen & (1u << F_SEED)) != 0;
    out->cost = cost;
    if (cfg_runs)
        out->cfg_negative = out->negative_prompt ? out->negative_prompt : "";
    out->n_images = d->n_images;
    for (int i = 0; i < d->n_images; i++)
        out->images[i] = d->images[i], d->images[i] = (kiln_buf){0};
    d->n_images = 0;
    return KILN_OK;
}

static void draft_free(api_draft *d)
{
    free(d->model);
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
    api_draft d = {.kind = kind, .format = KILN_IMAGE_PNG};
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
    for (int i = 0; i < r->n_images; i++)
        kiln_buf_free(&r->images[i]);
    memset(r, 0, sizeof *r);
}
