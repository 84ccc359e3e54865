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

#include <zlib.h>

#include "image.h"

kiln_status kiln_image_png_encode(const kiln_image *img, int level, kiln_png_filter filter,
                                  kiln_png_strategy strategy, kiln_buf *out, kiln_err *err);
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
/* The striped encoder (image_png_striped.c): stripes of `rows` rows, each
 * filtered and deflated on its own on up to `threads` threads (0: up to 16;
 * never more than the CPUs online), joined into one zlib stream.  The bytes
 * depend on everything but `threads` and `stripe_ms`.  zstrategy is zlib's
 * (Z_RLE, Z_DEFAULT_STRATEGY, Z_FILTERED, Z_HUFFMAN_ONLY), level 1..9;
 * kiln_rle set deflates with kiln_image_png_deflate_rle instead of zlib
 * (level and zstrategy then only set the zlib header's level field).
 * stripe_ms, when not NULL, receives each stripe's filter + deflate CPU
 * time (one entry per stripe; for tools/bench/png_bench.c).  The text entries
 * become iTXt chunks after IHDR, as kiln_image_png_add_text writes them.
 * kiln_image_encode's default PNG is KILN_PNG_STRIPE_DEFAULTS. */
typedef struct kiln_png_stripe_opts {
    int rows;
    int threads;
    int level;
    int zstrategy;
    kiln_png_filter filter;
    int kiln_rle;
    double *stripe_ms;
} kiln_png_stripe_opts;

#define KILN_PNG_STRIPE_DEFAULTS                                                        \
    ((kiln_png_stripe_opts){.rows = 64, .level = 1, .zstrategy = Z_RLE,                \
                            .filter = KILN_PNG_FILTER_PAETH, .kiln_rle = 1})

kiln_status kiln_image_png_encode_stripes(const kiln_image *img, const kiln_png_stripe_opts *o,
                                          const kiln_image_text *text, int n_text, kiln_buf *out,
                                          kiln_err *err);
/* Raw deflate of in[0..n) finding runs only (image_png_deflate.c), into
 * `out` of at least kiln_image_png_deflate_bound(n) bytes; ends on a byte
 * boundary with a final block when `last`, else with a sync flush, so that
 * consecutive calls' outputs concatenate into one stream.  Returns the
 * bytes written.  Thread-safe (about 35 KiB of stack). */
size_t kiln_image_png_deflate_bound(size_t n);
size_t kiln_image_png_deflate_rle(const uint8_t *in, size_t n, int last, uint8_t *out);
/* Writes one filtered row: the filter type byte, then the n bytes of `cur`
 * filtered against `up` (NULL for the image's first row).  ADAPTIVE picks
 * per row as libpng does and needs n bytes of scratch (image_png_filter.c). */
void kiln_image_png_filter_row(kiln_png_filter filter, uint8_t *o, const uint8_t *cur,
                               const uint8_t *up, size_t n, uint8_t *scratch);
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
