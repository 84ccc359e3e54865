#include "request.h"

#include <math.h>
#include <string.h>

#include "common/image.h"

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

double kiln_request_cost(const kiln_request *req, const kiln_model_traits *model, int cfg)
{
    double img = (double)(req->width / 16) * (double)(req->height / 16);
    double text = req->max_sequence_length > 0 ? req->max_sequence_length : 512;
    double refs = 0;
    /* img2img's image is the starting point, not tokens of every forward;
     * so is inpainting's where the model takes no references. */
    int conditions = !model->no_references && (!(req->strength > 0) || req->mask);
    for (int i = 0; i < req->n_refs && conditions; i++) {
        int w, h;
        if (kiln_image_flux2_ref_size(req->refs[i].width, req->refs[i].height, &w, &h, NULL) == 0)
            refs += (double)(w / 16) * (double)(h / 16);
    }
    double all = img + text + refs;
    double forward = all * (1 + all / KILN_COST_ATTN_TOKENS);
    double steps = req->steps > 0 ? req->steps : 1;
    if (req->strength > 0 && req->strength <= 1) /* the steps img2img and inpainting run */
        steps -= kiln_request_first_step((int)steps, req->strength);
    double per_row;
    if (model->kv_cache && refs > 0)
        per_row = forward + (steps - 1) * (img + text) * (1 + all / KILN_COST_ATTN_TOKENS);
    else
        per_row = steps * forward * (cfg ? 2 : 1);
    return (req->n > 0 ? req->n : 1) * per_row / 1e6;
}

kiln_status kiln_request_image_size(const kiln_model_traits *traits, int width, int height,
                                    int *out_width, int *out_height, kiln_err *err)
{
    if (traits->shrink_images)
        return kiln_image_flux2_ref_size(width, height, out_width, out_height, err);
    if (width < 16 || height < 16)
        return kiln_err_set(err, KILN_ERR_INVALID, "image is %dx%d; each side must be at least 16",
                            width, height);
    *out_width = width / 16 * 16, *out_height = height / 16 * 16;
    return KILN_OK;
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

/* Inpainting's rules before strength's (which then apply too). */
static kiln_status check_mask(kiln_request *req, const kiln_model_traits *model, kiln_err *err)
{
    if (model->kv_cache)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "mask (inpainting) is not supported on reference K/V cache checkpoints");
    if (req->n_refs != 1)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "mask (inpainting) takes exactly one image, not %d", req->n_refs);
    if (req->mask->width != req->refs[0].width || req->mask->height != req->refs[0].height)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "mask must have the image's size %dx%d (got %dx%d)",
                            req->refs[0].width, req->refs[0].height, req->mask->width,
                            req->mask->height);
    if (req->strength == 0)
        req->strength = model->inpaint_strength;
    return KILN_OK;
}

/* Image-to-image's own rules (after size and steps are resolved). */
static kiln_status check_strength(const kiln_request *req, const kiln_model_traits *model,
                                  kiln_err *err)
{
    if (!(req->strength > 0 && req->strength <= 1))
        return kiln_err_set(err, KILN_ERR_INVALID, "strength must be in (0, 1] (got %g)",
                            req->strength);
    if (req->n_refs != 1)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "strength (image-to-image) takes exactly one image, not %d",
                            req->n_refs);
    int w, h;
    if (kiln_request_image_size(model, req->refs[0].width, req->refs[0].height, &w, &h, err))
        return kiln_err_wrap(err, "image");
    if (req->width != w || req->height != h)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "size must be the image's prepared size %dx%d with strength "
                            "(image-to-image starts from the image; got %dx%d)",
                            w, h, req->width, req->height);
    return KILN_OK;
}

int kiln_request_first_step(int steps, double strength)
{
    if (!(strength > 0))
        return 0;
    double init = (double)steps * strength < steps ? (double)steps * strength : steps;
    double start = steps - init > 0 ? steps - init : 0;
    return (int)start;
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
    /* A model without references edits its one image: image-to-image at
     * its pipeline's default strength unless a strength or mask says
     * otherwise. */
    if (req->n_refs > 1 && model->no_references)
        return kiln_err_set(err, KILN_ERR_INVALID, "this model takes one image to edit "
                            "(image-to-image or inpainting), not %d references", req->n_refs);
    if (req->n_refs && model->no_references && !req->mask && req->strength == 0)
        req->strength = model->img2img_strength;
    int size_of_image = 0; /* the size was not given: it follows image 1 */
    if (!req->width && !req->height) {
        if (req->n_refs) {
            if (kiln_request_image_size(model, req->refs[0].width, req->refs[0].height,
                                        &req->width, &req->height, err))
                return kiln_err_wrap(err, "image");
            size_of_image = 1;
        } else {
            req->width = req->height = 1024;
        }
    }
    if (!req->width || !req->height)
        return kiln_err_set(err, KILN_ERR_INVALID, "size must give both width and height");
    if (check_side("width", req->width, lim, err) || check_side("height", req->height, lim, err)) {
        /* The caller sent no size: say where this one came from. */
        if (size_of_image)
            kiln_err_wrap(err, "size was not given, so the output is image 1's %dx%d (from "
                          "%dx%d)", req->width, req->height, req->refs[0].width,
                          req->refs[0].height);
        return err ? err->code : KILN_ERR_INVALID;
    }
    if (req->steps == 0)
        req->steps = model->default_steps;
    if (req->steps < 1 || req->steps > lim->max_steps)
        return kiln_err_set(err, KILN_ERR_INVALID, "num_inference_steps must be between 1 and %d",
                            lim->max_steps);
    if (req->guidance < 0)
        req->guidance = model->default_guidance;
    if (!isfinite(req->guidance) || req->guidance > 100.0f)
        return kiln_err_set(err, KILN_ERR_INVALID, "guidance_scale must be between 0 and 100");
    if (req->mask && check_mask(req, model, err))
        return err ? err->code : KILN_ERR_INVALID;
    if (req->strength != 0 && check_strength(req, model, err))
        return err ? err->code : KILN_ERR_INVALID;
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
