/* Internal to the image module: one encoder and one decoder per codec
 * (image_png.c, image_jpeg.c, image_webp.c), dispatched from image.c.
 * Arguments are already validated by the public entry points: images have
 * pixels and positive sizes, options are in range, limits are non-NULL.
 * Decoders check the header size against the limits before allocating and
 * leave `out` zeroed on failure; encoders append to `out` and restore its
 * length on failure.
 */
#ifndef KILN_IMAGE_IMPL_H
#define KILN_IMAGE_IMPL_H

#include "image.h"

kiln_status kiln_image_png_encode(const kiln_image *img, int level, kiln_png_filter filter,
                                  kiln_png_strategy strategy, kiln_buf *out, kiln_err *err);
/* The default combination (PAETH, Z_RLE, level >= 1) in parallel stripes
 * (image_png_striped.c). */
/* Inserts an iTXt chunk per entry after the IHDR chunk of the PNG that
 * starts at png->data + start.  KILN_ERR_INVALID for a bad key or value. */
kiln_status kiln_image_png_add_text(kiln_buf *png, size_t start, const kiln_image_text *text,
                                    int n, kiln_err *err);
/* The same entries as "key: value" lines: a COM segment after the SOI of
 * the JPEG at jpeg->data + start (cut to 64 KiB), or an XMP packet
 * (dc:description) in the WebP at webp->data + start, made an extended
 * (VP8X) file of that canvas size (image_meta.c). */
kiln_status kiln_image_jpeg_add_text(kiln_buf *jpeg, size_t start, const kiln_image_text *t, int n,
                                     kiln_err *err);
kiln_status kiln_image_webp_add_text(kiln_buf *webp, size_t start, int width, int height,
                                     const kiln_image_text *t, int n, kiln_err *err);
kiln_status kiln_image_png_encode_striped(const kiln_image *img, kiln_buf *out, kiln_err *err);
kiln_status kiln_image_jpeg_encode(const kiln_image *img, int quality, kiln_buf *out,
                                   kiln_err *err);
kiln_status kiln_image_webp_encode(const kiln_image *img, int quality, kiln_buf *out,
                                   kiln_err *err);

/* Mask mode: see kiln_image_decode_mask. */
kiln_status kiln_image_png_decode_mask(const uint8_t *data, size_t len,
                                       const kiln_image_limits *limits, kiln_image *out,
                                       kiln_err *err);
kiln_status kiln_image_png_decode(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, kiln_image *out,
                                  kiln_err *err);
kiln_status kiln_image_jpeg_decode(const uint8_t *data, size_t len,
                                   const kiln_image_limits *limits, kiln_image *out,
                                   kiln_err *err);
kiln_status kiln_image_webp_decode(const uint8_t *data, size_t len,
                                   const kiln_image_limits *limits, kiln_image *out,
                                   kiln_err *err);

/* Header-only readers for kiln_image_probe: the size, checked against the
 * limits, without decoding or allocating pixels. */
kiln_status kiln_image_png_probe(const uint8_t *data, size_t len, const kiln_image_limits *limits,
                                 int *width, int *height, kiln_err *err);
kiln_status kiln_image_jpeg_probe(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, int *width, int *height,
                                  kiln_err *err);
kiln_status kiln_image_webp_probe(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, int *width, int *height,
                                  kiln_err *err);

/* KILN_ERR_INVALID ("<format> image of WxH ...") unless 1 <= width, height
 * <= limits->max_side and width * height <= limits->max_pixels. */
kiln_status kiln_image_check_limits(const char *format, int64_t width, int64_t height,
                                    const kiln_image_limits *limits, kiln_err *err);

#endif
