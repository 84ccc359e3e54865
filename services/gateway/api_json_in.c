/* JSON request bodies: one object; images as base64 strings or data URLs. */
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "api_impl.h"
#include "base64.h"
#include "json_guard.h"

#define INVALID(e, param, ...) api_fail(e, KILN_ERR_INVALID, param, "invalid_value", __VA_ARGS__)

/* Decodes one image string (base64, or a base64 data URL) straight into the
 * draft's next image buffer. */
static kiln_status add_json_image(api_draft *d, const char *param, const cJSON *v,
                                  kiln_api_error *e)
{
    if (!cJSON_IsString(v))
        return api_bad_type(e, param, "a string", v);
    const char *s = v->valuestring;
    size_t len = strlen(s);
    if (strncasecmp(s, "http://", 7) == 0 || strncasecmp(s, "https://", 8) == 0)
        return api_fail(e, KILN_ERR_INVALID, param, "unsupported_value",
                        "image URLs are not supported: send the image as base64 or as a "
                        "data: URL");
    if (strncasecmp(s, "data:", 5) == 0) {
        const char *comma = memchr(s, ',', len);
        if (!comma || comma - s < 12 || strncasecmp(comma - 7, ";base64", 7) != 0)
            return INVALID(e, param, "image data URLs must be base64 (data:image/png;base64,...)");
        len -= (size_t)(comma + 1 - s);
        s = comma + 1;
    }
    int mask = strcmp(param, "mask") == 0 || strcmp(param, "mask.image_url") == 0;
    if (!mask && d->n_images == KILN_MAX_REFS)
        return api_fail(e, KILN_ERR_INVALID, param, "array_above_max_length",
                        "Invalid '%s': array too long. Expected an array with maximum length %d, "
                        "but got more images instead.", param, KILN_MAX_REFS);
    kiln_err err = {0};
    kiln_buf *b = mask ? &d->mask : &d->images[d->n_images];
    if (kiln_base64_decode(s, len, b, &err)) {
        kiln_buf_free(b);
        if (mask)
            return api_fail(e, err.code, param, err.code == KILN_ERR_NOMEM ? "server_error"
                                                                           : "invalid_image",
                            "mask: %s", err.msg);
        return api_fail(e, err.code, param, err.code == KILN_ERR_NOMEM ? "server_error"
                                                                       : "invalid_image",
                        "image %d: %s", d->n_images + 1, err.msg);
    }
    if (mask)
        d->has_mask = 1;
    else
        d->n_images++;
    return KILN_OK;
}

/* OpenAI's image object {"image_url": "data:..."} at `param` ("mask",
 * "images[2]"): decoded as the image at param.image_url.  {"file_id": ...}
 * names a file uploaded to OpenAI, which kiln does not have. */
static kiln_status add_json_image_object(api_draft *d, const char *param, const cJSON *obj,
                                         kiln_api_error *e)
{
    const cJSON *url = NULL, *f;
    char sub[48]; /* api_fail keeps KILN_API_PARAM_MAX - 1 of it */
    cJSON_ArrayForEach(f, obj)
    {
        snprintf(sub, sizeof sub, "%s.%.16s", param, f->string);
        if (strcmp(f->string, "image_url") == 0)
            url = f;
        else if (strcmp(f->string, "file_id") == 0)
            return api_fail(e, KILN_ERR_INVALID, sub, "unsupported_value",
                            "file_id is not supported: kiln stores no files; send image_url "
                            "as a data: URL");
        else
            return api_unknown(e, sub);
    }
    snprintf(sub, sizeof sub, "%s.image_url", param);
    if (!url || cJSON_IsNull(url))
        return api_fail(e, KILN_ERR_INVALID, sub, "missing_required_parameter",
                        "Missing required parameter: '%s'.", sub);
    return add_json_image(d, sub, url, e);
}

/* "mask": a base64 string or data URL, or OpenAI's image object. */
static kiln_status read_mask(api_draft *d, const cJSON *item, kiln_api_error *e)
{
    if (d->has_mask)
        return INVALID(e, "mask", "mask is given more than once");
    if (!cJSON_IsObject(item))
        return add_json_image(d, "mask", item, e);
    return add_json_image_object(d, "mask", item, e);
}

/* OpenAI's JSON edit form: "images": [{"image_url": "data:..."}, ...]. */
static kiln_status add_json_image_ref(api_draft *d, const cJSON *el, int k, kiln_api_error *e)
{
    char param[KILN_API_PARAM_MAX];
    snprintf(param, sizeof param, "images[%d]", k);
    if (!cJSON_IsObject(el))
        return api_bad_type(e, param, "an object", el);
    return add_json_image_object(d, param, el, e);
}

/* "image", "image[]" or "images": one of them, once. */
static kiln_status read_images(api_draft *d, const cJSON *item, kiln_api_error *e)
{
    const char *k = item->string;
    if (d->n_images)
        return INVALID(e, k, "images are given more than once (image, image[] and images "
                             "are one field)");
    kiln_status st = KILN_OK;
    int images = strcmp(k, "images") == 0;
    if (images && !cJSON_IsArray(item))
        return api_bad_type(e, k, "an array", item);
    if (cJSON_IsArray(item)) {
        const cJSON *el;
        int i = 0;
        cJSON_ArrayForEach(el, item)
        {
            if (!st)
                st = images ? add_json_image_ref(d, el, i, e) : add_json_image(d, k, el, e);
            i++;
        }
        return st;
    }
    return add_json_image(d, k, item, e);
}

kiln_status api_read_json(api_draft *d, const void *body, size_t len, kiln_api_error *e)
{
    static const kiln_json_guard_limits lim = {.max_nodes = KILN_API_JSON_MAX_NODES,
                                               .max_depth = KILN_API_JSON_MAX_DEPTH};
    char field[KILN_API_PARAM_MAX];
    kiln_err gerr = {0};
    kiln_status gst = kiln_json_guard(body, len, &lim, field, sizeof field, &gerr);
    if (gst)
        return api_fail(e, KILN_ERR_INVALID, field,
                        gst == KILN_ERR_INVALID ? "invalid_value" : "invalid_json", "%s",
                        gerr.msg);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        size_t at = end && end >= (const char *)body ? (size_t)(end - (const char *)body) : 0;
        return api_fail(e, KILN_ERR_INVALID, "", "invalid_json",
                        "request body is not valid JSON (near byte %zu)", at);
    }
    kiln_status st = KILN_OK;
    for (const char *p = end; p < (const char *)body + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n' && *p != '\0') {
            st = api_fail(e, KILN_ERR_INVALID, "", "invalid_json",
                          "request body has data after its JSON value");
            break;
        }
    if (!st && !cJSON_IsObject(root))
        st = api_fail(e, KILN_ERR_INVALID, "", "invalid_json",
                      "request body must be a JSON object");
    const cJSON *item;
    cJSON_ArrayForEach(item, root)
    {
        if (st)
            break;
        const char *k = item->string;
        int id = api_field_find(d, k);
        if ((id == F_IMAGE || id == F_IMAGE_ARRAY || id == F_IMAGES) && !cJSON_IsNull(item)) {
            st = read_images(d, item, e);
            d->images_field = id;
            continue;
        }
        if (id == F_MASK && !cJSON_IsNull(item)) {
            st = read_mask(d, item, e);
            continue;
        }
        api_value v = {.json = item};
        st = api_set(d, k, &v, e);
    }
    cJSON_Delete(root);
    return st;
}
