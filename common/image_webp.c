/* WebP through libwebp: lossy encoding at the requested quality, and
 * decoding of still images (alpha dropped by asking libwebp for RGB, which
 * leaves the colour samples as stored, like PIL's convert("RGB")). */
#include "image_impl.h"

#include <webp/decode.h>
#include <webp/encode.h>

/* libwebp's format limit (WEBP_MAX_DIMENSION in its private headers). */
#define WEBP_MAX_SIDE 16383

typedef struct webp_sink {
    kiln_buf *out;
    kiln_err *err;
    kiln_status st;
} webp_sink;

static int webp_write(const uint8_t *data, size_t size, const WebPPicture *pic)
{
    webp_sink *s = pic->custom_ptr;
    if (s->st == KILN_OK)
        s->st = kiln_buf_append(s->out, data, size, s->err);
    return s->st == KILN_OK;
}

kiln_status kiln_image_webp_encode(const kiln_image *img, int quality, kiln_buf *out,
                                   kiln_err *err)
{
    if (img->width > WEBP_MAX_SIDE || img->height > WEBP_MAX_SIDE)
        return kiln_err_set(err, KILN_ERR_INVALID, "WebP allows at most %d px a side, not %dx%d",
                            WEBP_MAX_SIDE, img->width, img->height);
    WebPConfig config;
    WebPPicture pic;
    /* thread_level stays 0 (the preset's value): output bytes then depend
     * on the pixels and quality only. */
    if (!WebPConfigPreset(&config, WEBP_PRESET_DEFAULT, (float)quality) || !WebPPictureInit(&pic))
        return kiln_err_set(err, KILN_ERR_INTERNAL, "libwebp version mismatch");
    size_t len0 = out->len;
    webp_sink sink = {.out = out, .err = err};
    pic.width = img->width;
    pic.height = img->height;
    pic.writer = webp_write;
    pic.custom_ptr = &sink;
    kiln_status st = KILN_OK;
    if (!WebPPictureImportRGB(&pic, img->pixels, img->width * 3))
        st = kiln_err_set(err, KILN_ERR_NOMEM, "out of memory encoding a WebP");
    else if (!WebPEncode(&config, &pic))
        st = sink.st ? sink.st
                     : kiln_err_set(err, KILN_ERR_INTERNAL, "WebP encoder failed (error %d)",
                                    (int)pic.error_code);
    WebPPictureFree(&pic);
    if (st)
        out->len = len0;
    return st;
}

/* The header's features, refused when not a still image within limits. */
static kiln_status webp_features(const uint8_t *data, size_t len, const kiln_image_limits *limits,
                                 WebPBitstreamFeatures *f, kiln_err *err)
{
    VP8StatusCode vs = WebPGetFeatures(data, len, f);
    if (vs != VP8_STATUS_OK)
        return kiln_err_set(err, KILN_ERR_INVALID, "invalid WebP: %s",
                            vs == VP8_STATUS_NOT_ENOUGH_DATA      ? "truncated data"
                            : vs == VP8_STATUS_UNSUPPORTED_FEATURE ? "unsupported feature"
                                                                   : "corrupt header");
    if (f->has_animation)
        return kiln_err_set(err, KILN_ERR_INVALID, "animated WebP images are not supported");
    return kiln_image_check_limits("WebP", f->width, f->height, limits, err);
}

kiln_status kiln_image_webp_probe(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, int *width, int *height,
                                  kiln_err *err)
{
    WebPBitstreamFeatures f;
    kiln_status st = webp_features(data, len, limits, &f, err);
    if (!st)
        *width = f.width, *height = f.height;
    return st;
}

kiln_status kiln_image_webp_decode(const uint8_t *data, size_t len,
                                   const kiln_image_limits *limits, kiln_image *out,
                                   kiln_err *err)
{
    WebPBitstreamFeatures f;
    kiln_status st = webp_features(data, len, limits, &f, err);
    if (st)
        return st;
    kiln_image img = {0};
    if ((st = kiln_image_alloc(&img, f.width, f.height, err)) != KILN_OK)
        return st;
    size_t size = (size_t)img.width * (size_t)img.height * 3;
    if (!WebPDecodeRGBInto(data, len, img.pixels, size, img.width * 3)) {
        kiln_image_free(&img);
        return kiln_err_set(err, KILN_ERR_INVALID, "invalid or truncated WebP");
    }
    *out = img;
    return KILN_OK;
}
