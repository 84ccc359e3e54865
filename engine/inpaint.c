#include "inpaint.h"

#include <stdlib.h>
#include <string.h>

kiln_status kiln_inpaint_prepare_image(kiln_image *img, const kiln_model_traits *traits,
                                       kiln_err *err)
{
    int w, h;
    kiln_status st = kiln_request_image_size(traits, img->width, img->height, &w, &h, err);
    if (!st && traits->shrink_images)
        st = kiln_image_flux2_ref_shrink(img, err);
    if (st || (img->width == w && img->height == h))
        return st;
    kiln_image resized = {0};
    if ((st = kiln_image_resize_lanczos(img, w, h, &resized, err)))
        return st;
    kiln_image_free(img);
    *img = resized;
    return KILN_OK;
}

/* torch.nn.functional.interpolate(mode="bilinear", align_corners=False)
 * source index and weight along one axis (aten's
 * area_pixel_compute_source_index, fp32). */
static void src_index(int dst, int in, int out, int *i0, int *i1, float *l1)
{
    float scale = (float)in / (float)out;
    float src = scale * ((float)dst + 0.5f) - 0.5f;
    if (src < 0)
        src = 0;
    int i = (int)src;
    *i0 = i;
    *i1 = i + (i < in - 1 ? 1 : 0);
    *l1 = src - (float)i;
}

/* The mask LANCZOS-resized to width x height, /255 and binarized at 0.5
 * (diffusers' mask processor): width x height floats, caller frees. */
static float *binarized(const kiln_image *mask, int width, int height, kiln_err *err)
{
    if (!mask || !mask->pixels || width < 16 || height < 16 || width % 16 || height % 16) {
        kiln_err_set(err, KILN_ERR_INVALID, "bad mask or size");
        return NULL;
    }
    kiln_image sized = {0};
    const kiln_image *m = mask;
    if (mask->width != width || mask->height != height) {
        if (kiln_image_resize_lanczos(mask, width, height, &sized, err))
            return NULL;
        m = &sized;
    }
    float *bin = malloc((size_t)width * height * sizeof *bin);
    if (!bin)
        kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    for (size_t i = 0; bin && i < (size_t)width * height; i++)
        bin[i] = (float)m->pixels[3 * i] / 255.0f >= 0.5f ? 1.0f : 0.0f;
    kiln_image_free(&sized);
    return bin;
}

kiln_status kiln_inpaint_mask(const kiln_image *mask, int width, int height, float *out,
                              kiln_err *err)
{
    float *bin = binarized(mask, width, height, err);
    if (!bin)
        return err ? err->code : KILN_ERR_INVALID;
    int gh = height / 16, gw = width / 16;
    for (int y = 0; y < gh; y++) {
        int y0, y1;
        float ly;
        src_index(y, height, gh, &y0, &y1, &ly);
        for (int x = 0; x < gw; x++) {
            int x0, x1;
            float lx;
            src_index(x, width, gw, &x0, &x1, &lx);
            const float *r0 = bin + (size_t)y0 * width, *r1 = bin + (size_t)y1 * width;
            out[(size_t)y * gw + x] = (1.0f - ly) * ((1.0f - lx) * r0[x0] + lx * r0[x1]) +
                                      ly * ((1.0f - lx) * r1[x0] + lx * r1[x1]);
        }
    }
    free(bin);
    return KILN_OK;
}

kiln_status kiln_inpaint_mask_latent(const kiln_image *mask, int width, int height, float *out,
                                     kiln_err *err)
{
    /* Whole multiples of 16 make the nearest source index exactly 8 x the
     * destination's (aten's nearest_idx: floor(dst * (float)in / out)). */
    float *bin = binarized(mask, width, height, err);
    if (!bin)
        return err ? err->code : KILN_ERR_INVALID;
    int gh = height / 8, gw = width / 8;
    for (int y = 0; y < gh; y++)
        for (int x = 0; x < gw; x++)
            out[(size_t)y * gw + x] = bin[(size_t)(8 * y) * width + 8 * x];
    free(bin);
    return KILN_OK;
}
