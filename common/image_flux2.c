/* FLUX.2 klein edit-reference preprocessing, spec/pipeline.md section 8:
 * diffusers' Flux2ImageProcessor.check_image_input, _resize_to_target_area
 * and _resize_and_crop, then VaeImageProcessor's pil_to_numpy (x / 255 in
 * fp32) and normalize (2x - 1 in fp32). */
#include "image.h"

#include <math.h>
#include <string.h>

#define REF_MIN_SIDE 64
#define REF_MAX_ASPECT 8.0
#define REF_TARGET_AREA (1024.0 * 1024.0)

/* Size after the optional LANCZOS downscale (before the crop). */
static kiln_status scaled_size(int w, int h, int *sw, int *sh, kiln_err *err)
{
    if (w < REF_MIN_SIDE || h < REF_MIN_SIDE)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "reference image %dx%d is too small (both sides must be at least %d px)",
                            w, h, REF_MIN_SIDE);
    double aspect = fmax((double)w / h, (double)h / w);
    if (aspect > REF_MAX_ASPECT)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "reference image %dx%d has an aspect ratio over %.0f:1", w, h,
                            REF_MAX_ASPECT);
    *sw = w;
    *sh = h;
    if ((double)w * h > REF_TARGET_AREA) {
        double s = sqrt(REF_TARGET_AREA / ((double)w * h));
        *sw = (int)(w * s);
        *sh = (int)(h * s);
    }
    return KILN_OK;
}

kiln_status kiln_image_flux2_ref_size(int width, int height, int *out_width, int *out_height,
                                      kiln_err *err)
{
    int sw = 0, sh = 0; /* gcc -O3 cannot see that scaled_size sets both */
    kiln_status st = scaled_size(width, height, &sw, &sh, err);
    if (st)
        return st;
    *out_width = sw / 16 * 16;
    *out_height = sh / 16 * 16;
    return KILN_OK;
}

kiln_status kiln_image_flux2_ref_shrink(kiln_image *img, kiln_err *err)
{
    if (!img || !img->pixels)
        return kiln_err_set(err, KILN_ERR_INVALID, "missing reference image");
    int sw = 0, sh = 0; /* gcc -O3 cannot see that scaled_size sets both */
    kiln_status st = scaled_size(img->width, img->height, &sw, &sh, err);
    if (st || (sw == img->width && sh == img->height))
        return st;
    kiln_image resized = {0};
    if ((st = kiln_image_resize_lanczos(img, sw, sh, &resized, err)))
        return st;
    kiln_image_free(img);
    *img = resized;
    return KILN_OK;
}

/* The cw x ch window at (left, top) of src as (1, 3, ch, cw) in [-1, 1]. */
static kiln_status unit_tensor(const kiln_image *src, int left, int top, int cw, int ch,
                               kiln_tensor *out, kiln_err *err)
{
    kiln_tensor t;
    int64_t shape[4] = {1, 3, ch, cw};
    kiln_status st = kiln_tensor_host_alloc(&t, KILN_F32, 4, shape, err);
    if (st)
        return st;
    float *dst = t.data;
    size_t plane = (size_t)ch * (size_t)cw;
    for (int y = 0; y < ch; y++) {
        const uint8_t *row =
            src->pixels + ((size_t)(y + top) * (size_t)src->width + (size_t)left) * 3;
        for (int x = 0; x < cw; x++) {
            for (int c = 0; c < 3; c++) {
                /* Two fp32 roundings as in diffusers: numpy's float32
                 * x / 255, then torch's 2x - 1 (2x is exact, so a fused
                 * multiply-add would round the same way). */
                float v = (float)row[3 * x + c] / 255.0f;
                dst[(size_t)c * plane + (size_t)y * cw + x] = 2.0f * v - 1.0f;
            }
        }
    }
    *out = t;
    return KILN_OK;
}

kiln_status kiln_image_flux2_ref_prepare(const kiln_image *img, kiln_tensor *out, kiln_err *err)
{
    if (!img || !img->pixels)
        return kiln_err_set(err, KILN_ERR_INVALID, "missing reference image");
    int sw = 0, sh = 0; /* gcc -O3 cannot see that scaled_size sets both */
    kiln_status st = scaled_size(img->width, img->height, &sw, &sh, err);
    if (st)
        return st;
    kiln_image resized = {0};
    const kiln_image *src = img;
    if (sw != img->width || sh != img->height) {
        if ((st = kiln_image_resize_lanczos(img, sw, sh, &resized, err)))
            return st;
        src = &resized;
    }
    int cw = sw / 16 * 16, ch = sh / 16 * 16;
    st = unit_tensor(src, (sw - cw) / 2, (sh - ch) / 2, cw, ch, out, err);
    kiln_image_free(&resized);
    return st;
}

kiln_status kiln_image_to_unit_tensor(const kiln_image *img, kiln_tensor *out, kiln_err *err)
{
    if (!img || !img->pixels || img->width < 1 || img->height < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "missing image");
    return unit_tensor(img, 0, 0, img->width, img->height, out, err);
}
