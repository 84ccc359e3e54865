/* JPEG through libjpeg-turbo's TurboJPEG 2.x API.  Decoding matches
 * Pillow's JPEG plugin: the same libjpeg defaults (accurate integer IDCT,
 * fancy upsampling), gray replicated by libjpeg, and 4-component images
 * read as Adobe-inverted CMYK ("CMYK;I", which Pillow assumes for every
 * CMYK JPEG) then converted with Pillow's cmyk2rgb. */
#include "image_impl.h"

#include <stdlib.h>
#include <turbojpeg.h>

kiln_status kiln_image_jpeg_encode(const kiln_image *img, int quality, kiln_buf *out,
                                   kiln_err *err)
{
    tjhandle tj = tjInitCompress();
    if (!tj)
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot create a JPEG encoder: %s",
                            tjGetErrorStr2(NULL));
    unsigned char *jpeg = NULL;
    unsigned long size = 0;
    kiln_status st = KILN_OK;
    /* 4:2:0 is Pillow's and libjpeg's default; quality 0 is raised to 1,
     * the lowest libjpeg accepts. */
    if (tjCompress2(tj, img->pixels, img->width, 0, img->height, TJPF_RGB, &jpeg, &size,
                    TJSAMP_420, quality < 1 ? 1 : quality, 0) != 0)
        st = kiln_err_set(err, KILN_ERR_INTERNAL, "JPEG encoder: %s", tjGetErrorStr2(tj));
    else
        st = kiln_buf_append(out, jpeg, size, err);
    tjFree(jpeg);
    tjDestroy(tj);
    return st;
}

/* Pillow's MULDIV255: a*b/255 rounded, without a division. */
static inline int muldiv255(int a, int b)
{
    int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
}

static inline uint8_t clip8(int v)
{
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* Inverting libjpeg's CMYK gives Pillow's, whose conversion is
 * rgb = (255 - k) - c * (255 - k) / 255, and 255 - k is the stored k. */
static void cmyk_to_rgb(uint8_t *rgb, const uint8_t *cmyk, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const uint8_t *s = cmyk + 4 * i;
        int nk = s[3];
        for (int c = 0; c < 3; c++)
            rgb[3 * i + c] = clip8(nk - muldiv255(255 - s[c], nk));
    }
}

kiln_status kiln_image_jpeg_decode(const uint8_t *data, size_t len,
                                   const kiln_image_limits *limits, kiln_image *out,
                                   kiln_err *err)
{
    tjhandle tj = tjInitDecompress();
    if (!tj)
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot create a JPEG decoder: %s",
                            tjGetErrorStr2(NULL));
    kiln_status st = KILN_OK;
    int w = 0, h = 0, subsamp = 0, colorspace = 0;
    kiln_image img = {0};
    uint8_t *cmyk = NULL;
    if (tjDecompressHeader3(tj, data, (unsigned long)len, &w, &h, &subsamp, &colorspace) != 0) {
        st = kiln_err_set(err, KILN_ERR_INVALID, "invalid JPEG: %s", tjGetErrorStr2(tj));
        goto done;
    }
    if ((st = kiln_image_check_limits("JPEG", w, h, limits, err)) != KILN_OK)
        goto done;
    if ((st = kiln_image_alloc(&img, w, h, err)) != KILN_OK)
        goto done;
    int is_cmyk = colorspace == TJCS_CMYK || colorspace == TJCS_YCCK;
    uint8_t *dst = img.pixels;
    if (is_cmyk) {
        cmyk = malloc((size_t)w * (size_t)h * 4);
        if (!cmyk) {
            st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory decoding a JPEG");
            goto done;
        }
        dst = cmyk;
    }
    /* Warnings (truncated or corrupt entropy data) are errors: Pillow also
     * refuses a truncated file, and a half-grey reference helps nobody.
     * LIMITSCANS refuses progressive files built to burn CPU. */
    int flags = TJFLAG_ACCURATEDCT | TJFLAG_STOPONWARNING | TJFLAG_LIMITSCANS;
    if (tjDecompress2(tj, data, (unsigned long)len, dst, w, 0, h,
                      is_cmyk ? TJPF_CMYK : TJPF_RGB, flags) != 0) {
        st = kiln_err_set(err, KILN_ERR_INVALID, "invalid JPEG: %s", tjGetErrorStr2(tj));
        goto done;
    }
    if (is_cmyk)
        cmyk_to_rgb(img.pixels, cmyk, (size_t)w * (size_t)h);
done:
    free(cmyk);
    tjDestroy(tj);
    if (st)
        kiln_image_free(&img);
    else
        *out = img;
    return st;
}

kiln_status kiln_image_jpeg_probe(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, int *width, int *height,
                                  kiln_err *err)
{
    tjhandle tj = tjInitDecompress();
    if (!tj)
        return kiln_err_set(err, KILN_ERR_NOMEM, "cannot create a JPEG decoder: %s",
                            tjGetErrorStr2(NULL));
    int w = 0, h = 0, subsamp = 0, colorspace = 0;
    kiln_status st = KILN_OK;
    if (tjDecompressHeader3(tj, data, (unsigned long)len, &w, &h, &subsamp, &colorspace) != 0)
        st = kiln_err_set(err, KILN_ERR_INVALID, "invalid JPEG: %s", tjGetErrorStr2(tj));
    else if ((st = kiln_image_check_limits("JPEG", w, h, limits, err)) == KILN_OK)
        *width = w, *height = h;
    tjDestroy(tj);
    return st;
}
