#include "request.h"

#include <math.h>
#include <string.h>

kiln_model_traits kiln_model_traits_of(const kiln_checkpoint *ck)
{
    kiln_model_traits t = {0};
    t.kv_cache = kiln_checkpoint_pipeline(ck) == KILN_PIPE_FLUX2_KLEIN_KV;
    t.cfg = !t.kv_cache && !kiln_checkpoint_is_distilled(ck);
    t.default_steps = t.cfg ? 50 : 4;
    t.default_guidance = t.cfg ? 4.0f : 1.0f;
    return t;
}

void kiln_request_init(kiln_request *req)
{
    memset(req, 0, sizeof *req);
    req->guidance = -1.0f;
    req->compression = -1;
}

int kiln_utf8_valid(const char *s, size_t len)
{
    const unsigned char *p = (const unsigned char *)s, *end = p + len;
    while (p < end) {
        unsigned c = *p;
        size_t n;
        uint32_t cp, min;
        if (c < 0x80) {
            p++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            n = 2, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            n = 3, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            n = 4, cp = c & 0x07, min = 0x10000;
        } else {
            return 0;
        }
        if ((size_t)(end - p) < n)
            return 0;
        for (size_t i = 1; i < n; i++) {
            if ((p[i] & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (p[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        p += n;
    }
    return 1;
}

static kiln_status check_side(const char *name, int v, const kiln_limits *lim, kiln_err *err)
{
    if (v % 16)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s must be a multiple of 16 (got %d)", name, v);
    if (v < lim->min_side || v > lim->max_side)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s must be between %d and %d (got %d)", name,
                            lim->min_side, lim->max_side, v);
    return KILN_OK;
}

kiln_status kiln_request_resolve(kiln_request *req, const kiln_model_traits *model,
                                 const kiln_limits *lim, kiln_err *err)
{
    if (!req->prompt)
        return kiln_err_set(err, KILN_ERR_INVALID, "prompt is required");
    size_t plen = strlen(req->prompt);
    if (plen > lim->max_prompt_bytes)
        return kiln_err_set(err, KILN_ERR_INVALID, "prompt is longer than %zu bytes",
                            lim->max_prompt_bytes);
    if (!kiln_utf8_valid(req->prompt, plen))
        return kiln_err_set(err, KILN_ERR_INVALID, "prompt is not valid UTF-8");
    if (req->negative_prompt) {
        size_t nlen = strlen(req->negative_prompt);
        if (nlen > lim->max_prompt_bytes)
            return kiln_err_set(err, KILN_ERR_INVALID, "negative_prompt is longer than %zu bytes",
                                lim->max_prompt_bytes);
        if (!kiln_utf8_valid(req->negative_prompt, nlen))
            return kiln_err_set(err, KILN_ERR_INVALID, "negative_prompt is not valid UTF-8");
        if (!model->cfg)
            return kiln_err_set(err, KILN_ERR_INVALID,
                                "negative_prompt needs a base (non-distilled) checkpoint");
    }
    if (req->n == 0)
        req->n = 1;
    if (req->n < 1 || req->n > lim->max_n)
        return kiln_err_set(err, KILN_ERR_INVALID, "n must be between 1 and %d", lim->max_n);
    if (req->n_refs < 0 || req->n_refs > lim->max_refs)
        return kiln_err_set(err, KILN_ERR_INVALID, "at most %d reference images are allowed",
                            lim->max_refs);
    if (!req->width && !req->height) {
        if (req->n_refs) {
            if (kiln_image_flux2_ref_size(req->refs[0].width, req->refs[0].height, &req->width,
                                          &req->height, err))
                return kiln_err_wrap(err, "image");
        } else {
            req->width = req->height = 1024;
        }
    }
    if (!req->width || !req->height)
        return kiln_err_set(err, KILN_ERR_INVALID, "size must give both width and height");
    if (check_side("width", req->width, lim, err) || check_side("height", req->height, lim, err))
        return err ? err->code : KILN_ERR_INVALID;
    if (req->steps == 0)
        req->steps = model->default_steps;
    if (req->steps < 1 || req->steps > lim->max_steps)
        return kiln_err_set(err, KILN_ERR_INVALID, "num_inference_steps must be between 1 and %d",
                            lim->max_steps);
    if (req->guidance < 0)
        req->guidance = model->default_guidance;
    if (!isfinite(req->guidance) || req->guidance > 100.0f)
        return kiln_err_set(err, KILN_ERR_INVALID, "guidance_scale must be between 0 and 100");
    if (req->max_sequence_length == 0)
        req->max_sequence_length = 512;
    /* diffusers' klein pipeline refuses more than 512 text tokens too. */
    if (req->max_sequence_length < 1 || req->max_sequence_length > 512)
        return kiln_err_set(err, KILN_ERR_INVALID, "max_sequence_length must be between 1 and 512");
    if (req->compression < 0)
        req->compression = req->format == KILN_IMAGE_PNG ? 0 : 100;
    if (req->compression > 100)
        return kiln_err_set(err, KILN_ERR_INVALID, "output_compression must be between 0 and 100");
    return KILN_OK;
}
