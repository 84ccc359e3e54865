/* kiln image I/O: 8-bit RGB images, PNG/JPEG/WebP encoding into memory,
 * hardened decoding of user uploads, Pillow-exact LANCZOS resizing and the
 * FLUX.2 klein edit-reference preprocessing.
 *
 *   kiln_err err = {0};
 *   kiln_image ref = {0};
 *   if (kiln_image_decode(bytes, nbytes, NULL, &ref, &err)) return err.code;  // 400
 *   kiln_tensor x = {0};                      // (1, 3, H', W') f32 in [-1, 1]
 *   if (kiln_image_flux2_ref_prepare(&ref, &x, &err)) ...
 *
 *   kiln_image out = {.width = 1024, .height = 1024, .pixels = rgb};  // a view
 *   kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;            // PNG
 *   kiln_buf png = {0};
 *   if (kiln_image_encode(&out, &o, &png, &err)) ...
 *   ... send png.data, png.len ...; kiln_buf_free(&png);
 *   kiln_image_free(&ref); kiln_tensor_host_free(&x);
 *
 * A kiln_image is a plain value: `pixels` holds height rows of width RGB
 * triples, tightly packed.  Images made by kiln_image_alloc/decode/resize own
 * their pixels (free with kiln_image_free); a caller may also point `pixels`
 * at its own memory to encode it (a view, never freed here).
 *
 * Decoding follows what the diffusers reference sees after PIL's
 * `Image.open(...).convert("RGB")`: alpha is dropped (not composited), gray
 * is replicated, palettes are expanded, 16-bit RGB(A) and gray+alpha PNGs
 * keep the high byte of each sample, and 16-bit gray PNGs (PIL mode "I;16")
 * are clamped to 255 as PIL's I;16 -> RGB conversion does (so a typical
 * 16-bit gray photo decodes almost white: we match the reference, not
 * intuition).  CMYK/YCCK JPEGs are read with Adobe (inverted) polarity and
 * converted with Pillow's cmyk2rgb.  EXIF orientation, gamma and ICC
 * profiles are ignored, as Image.open does.  Anything that is not a
 * well-formed PNG, JPEG or still WebP within the limits is KILN_ERR_INVALID,
 * including truncated data and JPEGs libjpeg only warns about.
 *
 * All functions are thread-safe on distinct arguments (no global state).
 */
#ifndef KILN_IMAGE_H
#define KILN_IMAGE_H

#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "error.h"
#include "tensor.h"

typedef struct kiln_image {
    int width;
    int height;
    uint8_t *pixels; /* height * width * 3 bytes, RGB, row-major */
} kiln_image;

/* Allocates an uninitialised width x height image (both >= 1, at most
 * 2^31-1 bytes per row).  KILN_ERR_INVALID for bad sizes, _NOMEM. */
kiln_status kiln_image_alloc(kiln_image *img, int width, int height, kiln_err *err);
/* Frees owned pixels and zeroes the struct; accepts a zeroed image.  Never
 * call it on a view of someone else's memory. */
void kiln_image_free(kiln_image *img);

typedef enum kiln_image_format {
    KILN_IMAGE_PNG = 0,
    KILN_IMAGE_JPEG,
    KILN_IMAGE_WEBP,
    KILN_IMAGE_FORMAT_COUNT
} kiln_image_format;

/* "png", "jpeg" (or "jpg"), "webp", as OpenAI's `output_format` spells
 * them; returns -1 for anything else. */
int kiln_image_format_parse(const char *name, kiln_image_format *out);
/* "png", "jpeg", "webp"; NULL for an invalid value. */
const char *kiln_image_format_name(kiln_image_format fmt);
/* "image/png", "image/jpeg", "image/webp"; NULL for an invalid value. */
const char *kiln_image_format_mime(kiln_image_format fmt);

/* ---- encoding ---- */

typedef enum kiln_png_filter {
    KILN_PNG_FILTER_NONE = 0,
    KILN_PNG_FILTER_SUB,
    KILN_PNG_FILTER_UP,
    KILN_PNG_FILTER_AVG,
    KILN_PNG_FILTER_PAETH,
    KILN_PNG_FILTER_ADAPTIVE, /* libpng picks per row among all five */
} kiln_png_filter;

/* How zlib looks for repeats in the filtered rows. */
typedef enum kiln_png_strategy {
    KILN_PNG_STRATEGY_RLE = 0, /* zlib Z_RLE: matches at distance 1 only */
    KILN_PNG_STRATEGY_LZ77,    /* zlib's full search at png_level (libpng's Z_FILTERED) */
} kiln_png_strategy;

/* A text entry stored with the image: a PNG iTXt chunk (UTF-8, not
 * compressed), as A1111, ComfyUI and Pillow's PngInfo write them.  key: 1..79
 * printable Latin-1 characters; value: any UTF-8 without NUL. */
typedef struct kiln_image_text {
    const char *key, *value;
} kiln_image_text;

typedef struct kiln_image_encode_opts {
    kiln_image_format format;
    /* Text entries, in order: PNG iTXt chunks after the header; JPEG a COM
     * segment and WebP an XMP packet (dc:description), each holding
     * "key: value" lines.  None by default, so that the bytes depend on
     * the pixels alone. */
    const kiln_image_text *text;
    int n_text;
    /* JPEG and WebP quality 0..100, OpenAI's `output_compression` taken
     * as-is (its default is 100).  JPEG treats 0 as 1 (libjpeg's floor). */
    int quality;
    /* PNG: zlib level 0..9 (0 stores; under RLE the other levels give the
     * same bytes), row filter and match strategy.  The default, PAETH + RLE,
     * measured on 1024x1024 images (a photo, an upscaled generated image, a
     * flat graphic; one core of the build machine): 44 / 39 / 9.5 ms for
     * 1.56 / 1.29 / 0.034 MB, against Pillow's default (level 6, adaptive
     * filter) at 373 / 466 / 43 ms for 1.56 / 1.32 / 0.034 MB, and against
     * PAETH + LZ77 level 2 at 56 / 56 / 11 ms for 1.71 / 1.53 / 0.047 MB.
     * Huffman-only would be 20% faster on photos but 12x larger on flat
     * images.  The default (PAETH + RLE, level >= 1) is encoded in stripes
     * of 64 rows on up to 16 threads (image_png_striped.c) by kiln's own
     * run-only deflate (image_png_deflate.c, zlib's Z_RLE parse at 44% less
     * CPU): the same pixels in a file within a few bytes of the single
     * stream's size, 1024x1024 in 7.9 ms on 16 cores before kiln's deflate
     * (docs/PERFORMANCE.md, PNG encoder options, for the option sweep); the
     * bytes do not depend on the thread count.  Every level >= 1 gives the
     * same bytes on this path. */
    int png_level;
    kiln_png_filter png_filter;
    kiln_png_strategy png_strategy;
} kiln_image_encode_opts;

#define KILN_IMAGE_ENCODE_DEFAULTS                                                      \
    ((kiln_image_encode_opts){.format = KILN_IMAGE_PNG, .quality = 100, .png_level = 1, \
                              .png_filter = KILN_PNG_FILTER_PAETH,                       \
                              .png_strategy = KILN_PNG_STRATEGY_RLE})

/* Encodes `img` and APPENDS the file bytes to `out` (which the caller owns
 * and frees).  opts NULL means KILN_IMAGE_ENCODE_DEFAULTS.  Deterministic:
 * the same pixels and options give the same bytes (no timestamps, no
 * threads).  WebP is lossy at every quality and limited to 16383 px a side.
 * KILN_ERR_INVALID for bad options or sizes, _NOMEM, _INTERNAL for a codec
 * failure; on failure `out` keeps its previous length. */
kiln_status kiln_image_encode(const kiln_image *img, const kiln_image_encode_opts *opts,
                              kiln_buf *out, kiln_err *err);

/* Encodes and writes a file (created or truncated, written fully, then
 * closed).  Errors as kiln_image_encode, plus KILN_ERR_IO naming the file's
 * base name only. */
kiln_status kiln_image_write_file(const char *path, const kiln_image *img,
                                  const kiln_image_encode_opts *opts, kiln_err *err);

/* ---- decoding ---- */

typedef struct kiln_image_limits {
    int max_side;       /* largest width or height accepted */
    int64_t max_pixels; /* largest width * height accepted */
} kiln_image_limits;

/* 16384 a side and 64 megapixels: a decompression bomb is refused from its
 * header, before any pixel memory is allocated. */
#define KILN_IMAGE_LIMITS_DEFAULT ((kiln_image_limits){.max_side = 16384, .max_pixels = 1LL << 26})

/* Decodes a PNG, JPEG or WebP held in memory (format from its magic bytes)
 * into a new 8-bit RGB image owned by the caller.  limits NULL means
 * KILN_IMAGE_LIMITS_DEFAULT.  Fails with KILN_ERR_INVALID (unknown or
 * malformed data, animated WebP, sizes out of limits; the message is safe to
 * show a client) or KILN_ERR_NOMEM; `out` is zeroed on failure. */
kiln_status kiln_image_decode(const void *data, size_t len, const kiln_image_limits *limits,
                              kiln_image *out, kiln_err *err);

/* The size of a PNG, JPEG or WebP held in memory from its header alone,
 * without decoding or allocating pixels (a decompression bomb costs
 * nothing here), checked against `limits` (NULL: the defaults) as
 * kiln_image_decode checks it.  The rest of the data is not looked at:
 * decoding may still refuse it.  Errors as kiln_image_decode's (the same
 * messages for sizes and formats); *width and *height are 0 on failure.
 * Thread-safe. */
kiln_status kiln_image_probe(const void *data, size_t len, const kiln_image_limits *limits,
                             int *width, int *height, kiln_err *err);

/* Reads a whole file and decodes it; KILN_ERR_IO/_NOT_FOUND for the file
 * (naming its base name only), then as kiln_image_decode. */
/* An inpainting mask (a PNG, as OpenAI requires) as an image whose three
 * channels hold the mask value (255 repaints, 0 keeps): when the PNG has
 * alpha (or tRNS), read as OpenAI means it: 255 where alpha is 0, else 0;
 * without alpha, as diffusers' mask processor reads it: PIL's "L"
 * luminance (white repaints).  16-bit samples keep their high byte.  Not a
 * PNG: KILN_ERR_INVALID.  read_mask_file: the same from a file. */
kiln_status kiln_image_decode_mask(const void *data, size_t len, const kiln_image_limits *limits,
                                   kiln_image *out, kiln_err *err);
kiln_status kiln_image_read_mask_file(const char *path, const kiln_image_limits *limits,
                                      kiln_image *out, kiln_err *err);

kiln_status kiln_image_read_file(const char *path, const kiln_image_limits *limits,
                                 kiln_image *out, kiln_err *err);

/* ---- resampling ---- */

/* Resizes with Pillow's LANCZOS filter, bit-exact with Pillow's
 * `Image.resize(size, LANCZOS)` on an RGB image: per-axis coefficients in
 * double rounded to 22-bit fixed point, horizontal pass first (over only
 * the rows the vertical pass reads) into a uint8 intermediate, then the
 * vertical pass; an axis whose size does not change is not resampled.
 * Allocates `dst` (caller frees).  KILN_ERR_INVALID for bad sizes, _NOMEM. */
kiln_status kiln_image_resize_lanczos(const kiln_image *src, int width, int height,
                                      kiln_image *dst, kiln_err *err);

/* The whole image as the VAE takes it: pixel/255 then 2x - 1 in fp32 (two
 * roundings, as numpy's x / 255 then torch's 2x - 1), into a new host
 * tensor F32 (1, 3, H, W) (caller frees with kiln_tensor_host_free).
 * KILN_ERR_INVALID for an empty image, _NOMEM. */
kiln_status kiln_image_to_unit_tensor(const kiln_image *img, kiln_tensor *out, kiln_err *err);

/* ---- FLUX.2 klein edit references (spec/pipeline.md section 8) ---- */

/* The size a reference of width x height has after preprocessing: rejected
 * (KILN_ERR_INVALID) if a side is under 64 px or the aspect ratio exceeds 8;
 * scaled to (int(w*s), int(h*s)), s = sqrt(1024^2 / (w*h)), when w*h >
 * 1024^2; then floored to multiples of 16.  This is also the output size of
 * an edit request without a size: the first reference's prepared size. */
kiln_status kiln_image_flux2_ref_size(int width, int height, int *out_width, int *out_height,
                                      kiln_err *err);

/* Preprocesses one reference as Flux2KleinPipeline does: the size check and
 * LANCZOS downscale of kiln_image_flux2_ref_size, a center crop to the
 * multiple-of-16 size (left = floor((w - W')/2), top likewise), then
 * pixel/255 and 2x - 1 in fp32 into a new host tensor `out`, F32 of shape
 * (1, 3, H', W') (caller frees with kiln_tensor_host_free).  Bit-exact with
 * diffusers for RGB and gray inputs of any size, and for every input of at
 * most 1024^2 pixels.  Larger RGBA/LA, palette, CMYK and 16-bit gray inputs
 * differ: diffusers resizes them in their own mode (premultiplied alpha,
 * NEAREST, CMYK channels, float) before converting, we convert first.
 * Errors: KILN_ERR_INVALID, _NOMEM; `out` is untouched on failure. */
kiln_status kiln_image_flux2_ref_prepare(const kiln_image *img, kiln_tensor *out, kiln_err *err);

/* The LANCZOS downscale of kiln_image_flux2_ref_prepare alone, in place:
 * `img` (which must own its pixels) is replaced by its downscaled copy when
 * it is over 1024^2 pixels, else left as it is.  Preparing the result gives
 * the same tensor, bit for bit, as preparing the original (its area is
 * within the target, so prepare does not resize it again, and the crop is
 * the same), so a caller holding several references can keep each at most
 * ~1 MP instead of as uploaded (a 64 MP reference is 192 MiB).  Errors as
 * prepare's; `img` is unchanged on failure. */
kiln_status kiln_image_flux2_ref_shrink(kiln_image *img, kiln_err *err);

#endif
