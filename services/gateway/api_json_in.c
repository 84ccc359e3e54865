/* JSON request bodies: one object; images as base64 strings or data URLs. */
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
        return INVALID(e, param, "%s must be a base64 string or a list of them", param);
    const char *s = v->valuestring;
    size_t len = strlen(s);
    if (strncasecmp(s, "http://", 7) == 0 || strncasecmp(s, "https://", 8) == 0)
        return INVALID(e, param, "image URLs are not supported: send the image as base64 or "
                                 "as a data: URL");
    if (strncasecmp(s, "data:", 5) == 0) {
        const char *comma = memchr(s, ',', len);
        if (!comma || comma - s < 12 || strncasecmp(comma - 7, ";base64", 7) != 0)
            return INVALID(e, param, "image data URLs must be base64 (data:image/png;base64,...)");
        len -= (size_t)(comma + 1 - s);
        s = comma + 1;
    }
    if (d->kind != KILN_API_EDIT)
        return INVALID(e, param, "image is accepted by /v1/images/edits only");
    if (d->n_images == KILN_MAX_REFS)
        return INVALID(e, param, "at most %d reference images are allowed", KILN_MAX_REFS);
    kiln_err err = {0};
    kiln_buf *b = &d->images[d->n_images];
    if (kiln_base64_decode(s, len, b, &err)) {
        kiln_buf_free(b);
        return api_fail(e, err.code, param, err.code == KILN_ERR_NOMEM ? "server_error"
                                                                       : "invalid_image",
                        "image %d: %s", d->n_images + 1, err.msg);
    }
    d->n_images++;
    return KILN_OK;
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
    unsigned image_keys = 0;
    cJSON_ArrayForEach(item, root)
    {
        if (st)
            break;
        const char *k = item->string;
        if (strcmp(k, "image") == 0 || strcmp(k, "image[]") == 0) {
            if (cJSON_IsNull(item))
                continue;
            if (image_keys++)
                st = INVALID(e, k, "image is given more than once");
            else if (cJSON_IsArray(item)) {
                const cJSON *el;
                cJSON_ArrayForEach(el, item) if (!st) st = add_json_image(d, k, el, e);
            } else {
                st = add_json_image(d, k, item, e);
            }
            continue;
        }
        api_value v = {.json = item};
        st = api_set(d, k, &v, e);
    }
    cJSON_Delete(root);
    return st;
}
