/* The request fields: their names, types and routes, read one by one into
 * a draft with OpenAI's error codes and wording (invalid_type,
 * unknown_parameter, invalid_value with the supported values), so that a
 * client written against OpenAI's API gets the answers it expects. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api_impl.h"

typedef enum field_type { T_STR, T_INT, T_NUM, T_SEED, T_BOOL, T_ENUM, T_IMAGE, T_MASK } field_type;

enum { ON_GEN = 1, ON_EDIT = 2, ON_BOTH = 3 };

static const char *const quality_values[] = {"auto", "standard", "low", "medium", "high", "hd", NULL};
static const char *const background_values[] = {"auto", "opaque", "transparent", NULL};
static const char *const moderation_values[] = {"auto", "low", NULL};
static const char *const style_values[] = {"vivid", "natural", NULL};
static const char *const fidelity_values[] = {"low", "high", NULL};
static const char *const response_values[] = {"b64_json", "url", NULL};
static const char *const format_values[] = {"png", "jpeg", "webp", NULL};

static const struct {
    const char *name;
    field_type type;
    int routes;
    const char *const *values; /* T_ENUM */
} fields[F_COUNT] = {
    [F_MODEL] = {"model", T_STR, ON_BOTH, NULL},
    [F_PROMPT] = {"prompt", T_STR, ON_BOTH, NULL},
    [F_NEGATIVE] = {"negative_prompt", T_STR, ON_BOTH, NULL},
    [F_N] = {"n", T_INT, ON_BOTH, NULL},
    [F_SIZE] = {"size", T_STR, ON_BOTH, NULL},
    [F_SEED] = {"seed", T_SEED, ON_BOTH, NULL},
    [F_STEPS] = {"num_inference_steps", T_INT, ON_BOTH, NULL},
    [F_GUIDANCE] = {"guidance_scale", T_NUM, ON_BOTH, NULL},
    [F_RESPONSE_FORMAT] = {"response_format", T_ENUM, ON_BOTH, response_values},
    [F_OUTPUT_FORMAT] = {"output_format", T_STR, ON_BOTH, NULL},
    [F_COMPRESSION] = {"output_compression", T_INT, ON_BOTH, NULL},
    [F_MAX_SEQ] = {"max_sequence_length", T_INT, ON_BOTH, NULL},
    [F_STREAM] = {"stream", T_BOOL, ON_BOTH, NULL},
    [F_PARTIAL_IMAGES] = {"partial_images", T_INT, ON_BOTH, NULL},
    [F_QUALITY] = {"quality", T_ENUM, ON_BOTH, quality_values},
    [F_BACKGROUND] = {"background", T_ENUM, ON_BOTH, background_values},
    [F_MODERATION] = {"moderation", T_ENUM, ON_BOTH, moderation_values},
    [F_STYLE] = {"style", T_ENUM, ON_GEN, style_values},
    [F_USER] = {"user", T_STR, ON_BOTH, NULL},
    [F_INPUT_FIDELITY] = {"input_fidelity", T_ENUM, ON_EDIT, fidelity_values},
    [F_IMAGE] = {"image", T_IMAGE, ON_EDIT, NULL},
    [F_IMAGE_ARRAY] = {"image[]", T_IMAGE, ON_EDIT, NULL},
    [F_IMAGES] = {"images", T_IMAGE, ON_EDIT, NULL},
    [F_MASK] = {"mask", T_MASK, ON_EDIT, NULL},
    [F_STRENGTH] = {"strength", T_NUM, ON_EDIT, NULL},
};

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

/* OpenAI's names for JSON types in its messages. */
static const char *json_type(const cJSON *v)
{
    if (!v)
        return "a string"; /* form fields are text */
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsNumber(v))
        return isfinite(v->valuedouble) && v->valuedouble == floor(v->valuedouble)
                   ? "an integer" : "a decimal";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsArray(v))
        return "an array";
    if (cJSON_IsObject(v))
        return "an object";
    return "null";
}

kiln_status api_bad_type(kiln_api_error *e, const char *param, const char *want,
                         const cJSON *got)
{
    return api_fail(e, KILN_ERR_INVALID, param, "invalid_type",
                    "Invalid type for '%s': expected %s, but got %s instead.", param, want,
                    json_type(got));
}

kiln_status api_unknown(kiln_api_error *e, const char *name)
{
    return api_fail(e, KILN_ERR_INVALID, name, "unknown_parameter", "Unknown parameter: '%.*s'.",
                    KILN_API_PARAM_MAX, name);
}

int api_field_find(const api_draft *d, const char *name)
{
    int route = d->kind == KILN_API_EDIT ? ON_EDIT : ON_GEN;
    for (int id = 0; id < F_COUNT; id++)
        if (strcmp(fields[id].name, name) == 0)
            return (fields[id].routes & route) ? id : -1;
    return -1;
}

/* ---- typed values: JSON values must have the JSON type; form text is
 * parsed strictly (the whole field, no blanks). ---- */

static kiln_status get_string(const api_value *v, const char *name, char **out,
                              kiln_api_error *e)
{
    const char *s = v->text;
    size_t len = v->len;
    if (v->json) {
        if (!cJSON_IsString(v->json))
            return api_bad_type(e, name, "a string", v->json);
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

/* A whole number, kept as a double: finish range-checks it and quotes it
 * in the error. */
static kiln_status get_int(const api_value *v, const char *name, double *out, kiln_api_error *e)
{
    if (v->json) {
        if (!cJSON_IsNumber(v->json) || !isfinite(v->json->valuedouble) ||
            v->json->valuedouble != floor(v->json->valuedouble))
            return api_bad_type(e, name, "an integer", v->json);
        *out = v->json->valuedouble;
        return KILN_OK;
    }
    uint64_t mag;
    int neg;
    if (parse_decimal(v->text, v->len, 1, &mag, &neg))
        return api_bad_type(e, name, "an integer", NULL);
    *out = neg ? -(double)mag : (double)mag;
    return KILN_OK;
}

static kiln_status get_num(const api_value *v, const char *name, double *out, kiln_api_error *e)
{
    if (v->json) {
        if (!cJSON_IsNumber(v->json))
            return api_bad_type(e, name, "a decimal", v->json);
        *out = v->json->valuedouble;
        return KILN_OK;
    }
    char buf[64];
    if (v->len == 0 || v->len >= sizeof buf)
        return api_bad_type(e, name, "a decimal", NULL);
    memcpy(buf, v->text, v->len);
    buf[v->len] = '\0';
    char *end;
    errno = 0;
    *out = strtod(buf, &end);
    /* strtod also reads "nan", "inf" and hex floats, which JSON never has. */
    if (*end || errno || !isfinite(*out) || strpbrk(buf, "xXnN"))
        return api_bad_type(e, name, "a decimal", NULL);
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
            return api_fail(e, KILN_ERR_INVALID, "seed", "invalid_type", "%s", msg);
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
            return api_bad_type(e, name, "a boolean", v->json);
        *out = cJSON_IsTrue(v->json);
        return KILN_OK;
    }
    if (v->len == 4 && memcmp(v->text, "true", 4) == 0)
        *out = 1;
    else if (v->len == 5 && memcmp(v->text, "false", 5) == 0)
        *out = 0;
    else
        return api_bad_type(e, name, "a boolean", NULL);
    return KILN_OK;
}

/* "Invalid value: 'x'. Supported values are: 'a', 'b', and 'c'." as
 * OpenAI words it. */
static kiln_status bad_enum(kiln_api_error *e, const char *name, const char *s,
                            const char *const *values)
{
    char list[160] = "";
    size_t n = 0, k = 0;
    while (values[n])
        n++;
    for (size_t i = 0; i < n; i++)
        k += (size_t)snprintf(list + k, k < sizeof list ? sizeof list - k : 0,
                              "%s'%s'", i == 0 ? "" : i + 1 < n ? ", " : n > 2 ? ", and " : " and ",
                              values[i]);
    return INVALID(e, name, "Invalid value: '%.64s'. Supported values are: %s.", s, list);
}

static kiln_status get_enum(const api_value *v, int id, int *out, kiln_api_error *e)
{
    const char *name = fields[id].name;
    char *s = NULL;
    if (get_string(v, name, &s, e))
        return e->err.code;
    const char *const *values = fields[id].values;
    int k = 0;
    while (values[k] && strcmp(values[k], s) != 0)
        k++;
    kiln_status st = values[k] ? KILN_OK : bad_enum(e, name, s, values);
    *out = k;
    free(s);
    return st;
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

static kiln_status set_string_field(api_draft *d, int id, const api_value *v, kiln_api_error *e)
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
    case F_USER: d->user = s, s = NULL; break;
    case F_SIZE: st = parse_size(s, &d->width, &d->height, e); break;
    case F_OUTPUT_FORMAT:
        /* kiln also reads "jpg"; OpenAI's three are the ones it names. */
        if (kiln_image_format_parse(s, &d->format))
            st = bad_enum(e, name, s, format_values);
        break;
    default: break;
    }
    free(s);
    return st;
}

kiln_status api_add_image(api_draft *d, const char *param, const void *data, size_t len,
                          kiln_api_error *e)
{
    if (d->n_images == KILN_MAX_REFS)
        return api_fail(e, KILN_ERR_INVALID, param, "array_above_max_length",
                        "Invalid '%s': array too long. Expected an array with maximum length %d, "
                        "but got more images instead.", param, KILN_MAX_REFS);
    kiln_buf *b = &d->images[d->n_images];
    if (kiln_buf_append(b, data, len, NULL))
        return NOMEM(e);
    d->n_images++;
    return KILN_OK;
}

kiln_status api_set_mask(api_draft *d, const void *data, size_t len, kiln_api_error *e)
{
    if (d->has_mask)
        return INVALID(e, "mask", "mask is given more than once");
    if (kiln_buf_append(&d->mask, data, len, NULL))
        return NOMEM(e);
    d->has_mask = 1;
    return KILN_OK;
}

kiln_status api_set(api_draft *d, const char *name, const api_value *v, kiln_api_error *e)
{
    int id = api_field_find(d, name);
    if (id < 0)
        return d->ignore_unknown ? KILN_OK : api_unknown(e, name);
    if (v->json && cJSON_IsNull(v->json))
        return KILN_OK; /* clients send null for "not given" */
    field_type t = fields[id].type;
    if (t == T_MASK) {
        if (v->json)
            return INVALID(e, name, "internal: JSON masks go through api_read_json");
        return api_set_mask(d, v->text, v->len, e);
    }
    if (t == T_IMAGE) {
        if (v->json)
            return INVALID(e, name, "internal: JSON images go through api_read_json");
        return api_add_image(d, name, v->text, v->len, e);
    }
    if (d->seen & (1ull << id))
        return INVALID(e, name, "%s is given more than once", name);
    d->seen |= 1ull << id;
    switch (t) {
    case T_STR: return set_string_field(d, id, v, e);
    case T_INT:
        return get_int(v, name, id == F_N ? &d->n : id == F_STEPS ? &d->steps
                               : id == F_COMPRESSION ? &d->compression
                               : id == F_PARTIAL_IMAGES ? &d->partial_images : &d->max_seq, e);
    case T_NUM: return get_num(v, name, id == F_STRENGTH ? &d->strength : &d->guidance, e);
    case T_SEED: return get_seed(v, &d->seed, e);
    case T_BOOL: return get_bool(v, name, &d->stream, e);
    case T_ENUM: {
        int k = -1;
        kiln_status st = get_enum(v, id, &k, e);
        switch (id) {
        case F_QUALITY: d->quality = k; break;
        case F_BACKGROUND: d->background = k; break;
        case F_MODERATION: d->moderation = k; break;
        case F_STYLE: d->style = k; break;
        case F_INPUT_FIDELITY: d->input_fidelity = k; break;
        case F_RESPONSE_FORMAT:
            if (!st && k == 1)
                st = api_fail(e, KILN_ERR_INVALID, name, "unsupported_value",
                              "response_format \"url\" is not supported: kiln does not store "
                              "images, it returns them inline; use \"b64_json\"");
            break;
        default: break;
        }
        return st;
    }
    default: return KILN_OK;
    }
}

const char *api_quality_name(int q)
{
    return q >= 0 && q < (int)(sizeof quality_values / sizeof *quality_values) - 1
               ? quality_values[q] : "auto";
}
