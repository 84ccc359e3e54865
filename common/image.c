/* kiln_image basics, format names and sniffing, and the dispatch from the
 * public encode/decode entry points to the per-codec files. */
#include "image.h"
#include "image_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

kiln_status kiln_image_alloc(kiln_image *img, int width, int height, kiln_err *err)
{
    if (width < 1 || height < 1 || (int64_t)width * 3 > INT32_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad image size %dx%d", width, height);
    size_t n = (size_t)width * (size_t)height * 3;
    if (n / 3 / (size_t)width != (size_t)height)
        return kiln_err_set(err, KILN_ERR_INVALID, "image size %dx%d overflows", width, height);
    uint8_t *p = malloc(n);
    if (!p)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory for a %dx%d image", width,
                            height);
    img->width = width;
    img->height = height;
    img->pixels = p;
    return KILN_OK;
}

void kiln_image_free(kiln_image *img)
{
    if (!img)
        return;
    free(img->pixels);
    img->pixels = NULL;
    img->width = 0;
    img->height = 0;
}

static const char *const format_names[KILN_IMAGE_FORMAT_COUNT] = {"png", "jpeg", "webp"};
static const char *const format_mimes[KILN_IMAGE_FORMAT_COUNT] = {"image/png", "image/jpeg",
                                                                  "image/webp"};

int kiln_image_format_parse(const char *name, kiln_image_format *out)
{
    if (!name)
        return -1;
    for (int i = 0; i < KILN_IMAGE_FORMAT_COUNT; i++) {
        if (strcasecmp(name, format_names[i]) == 0) {
            *out = (kiln_image_format)i;
            return 0;
        }
    }
    if (strcasecmp(name, "jpg") == 0) {
        *out = KILN_IMAGE_JPEG;
        return 0;
    }
    return -1;
}

const char *kiln_image_format_name(kiln_image_format fmt)
{
    return (unsigned)fmt < KILN_IMAGE_FORMAT_COUNT ? format_names[fmt] : NULL;
}

const char *kiln_image_format_mime(kiln_image_format fmt)
{
    return (unsigned)fmt < KILN_IMAGE_FORMAT_COUNT ? format_mimes[fmt] : NULL;
}

kiln_status kiln_image_encode(const kiln_image *img, const kiln_image_encode_opts *opts,
                              kiln_buf *out, kiln_err *err)
{
    kiln_image_encode_opts o = opts ? *opts : KILN_IMAGE_ENCODE_DEFAULTS;
    if (!img || !img->pixels || img->width < 1 || img->height < 1 ||
        (int64_t)img->width * 3 > INT32_MAX)
        return kiln_err_set(err, KILN_ERR_INVALID, "cannot encode an empty or oversized image");
    switch (o.format) {
    case KILN_IMAGE_PNG: {
        if (o.png_level < 0 || o.png_level > 9)
            return kiln_err_set(err, KILN_ERR_INVALID, "PNG compression level %d not in 0..9",
                                o.png_level);
        if (o.png_filter < KILN_PNG_FILTER_NONE || o.png_filter > KILN_PNG_FILTER_ADAPTIVE)
            return kiln_err_set(err, KILN_ERR_INVALID, "unknown PNG filter %d",
                                (int)o.png_filter);
        if (o.png_strategy != KILN_PNG_STRATEGY_RLE && o.png_strategy != KILN_PNG_STRATEGY_LZ77)
            return kiln_err_set(err, KILN_ERR_INVALID, "unknown PNG strategy %d",
                                (int)o.png_strategy);
        size_t start = out->len;
        if (o.png_strategy == KILN_PNG_STRATEGY_RLE && o.png_filter == KILN_PNG_FILTER_PAETH &&
            o.png_level > 0) {
            kiln_png_stripe_opts so = KILN_PNG_STRIPE_DEFAULTS;
            return kiln_image_png_encode_stripes(img, &so, o.text, o.n_text, out, err);
        }
        kiln_status st = kiln_image_png_encode(img, o.png_level, o.png_filter, o.png_strategy, out, err);
        if (!st && o.n_text && (st = kiln_image_png_add_text(out, start, o.text, o.n_text, err)))
            out->len = start;
        return st;
    }
    case KILN_IMAGE_JPEG:
    case KILN_IMAGE_WEBP:
        if (o.quality < 0 || o.quality > 100)
            return kiln_err_set(err, KILN_ERR_INVALID, "output_compression %d not in 0..100",
                                o.quality);
    {
        size_t start = out->len;
        kiln_status st = o.format == KILN_IMAGE_JPEG
                             ? kiln_image_jpeg_encode(img, o.quality, out, err)
                             : kiln_image_webp_encode(img, o.quality, out, err);
        if (!st && o.n_text)
            st = o.format == KILN_IMAGE_JPEG
                     ? kiln_image_jpeg_add_text(out, start, o.text, o.n_text, err)
                     : kiln_image_webp_add_text(out, start, img->width, img->height, o.text,
                                                o.n_text, err);
        if (st)
            out->len = start;
        return st;
    }
    default:
        return kiln_err_set(err, KILN_ERR_INVALID, "unknown output format %d", (int)o.format);
    }
}

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

kiln_status kiln_image_write_file(const char *path, const kiln_image *img,
                                  const kiln_image_encode_opts *opts, kiln_err *err)
{
    kiln_buf b = {0};
    kiln_status st = kiln_image_encode(img, opts, &b, err);
    if (st)
        return st;
    FILE *f = fopen(path, "wb");
    if (!f) {
        st = kiln_err_set(err, KILN_ERR_IO, "cannot create %s: %s", base_name(path),
                          strerror(errno));
    } else {
        size_t wrote = fwrite(b.data, 1, b.len, f);
        int werr = wrote != b.len ? errno : 0;
        if (fclose(f) != 0 && !werr)
            werr = errno ? errno : EIO;
        if (wrote != b.len || werr)
            st = kiln_err_set(err, KILN_ERR_IO, "cannot write %s: %s", base_name(path),
                              strerror(werr ? werr : EIO));
    }
    kiln_buf_free(&b);
    return st;
}

kiln_status kiln_image_check_limits(const char *format, int64_t width, int64_t height,
                                    const kiln_image_limits *limits, kiln_err *err)
{
    if (width < 1 || height < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "%s image has an empty size %lldx%lld",
                            format, (long long)width, (long long)height);
    if (width > limits->max_side || height > limits->max_side)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "%s image of %lldx%lld px is too large (at most %d px a side)",
                            format, (long long)width, (long long)height, limits->max_side);
    if (width * height > limits->max_pixels)
        return kiln_err_set(err, KILN_ERR_INVALID,
                            "%s image of %lldx%lld px is too large (at most %lld pixels)", format,
                            (long long)width, (long long)height, (long long)limits->max_pixels);
    return KILN_OK;
}

/* Names formats we recognise but do not accept, so a client learns why. */
static const char *other_format(const uint8_t *d, size_t len)
{
    if (len >= 6 && (memcmp(d, "GIF87a", 6) == 0 || memcmp(d, "GIF89a", 6) == 0))
        return "GIF";
    if (len >= 2 && d[0] == 'B' && d[1] == 'M')
        return "BMP";
    if (len >= 4 && (memcmp(d, "II*\0", 4) == 0 || memcmp(d, "MM\0*", 4) == 0))
        return "TIFF";
    if (len >= 12 && memcmp(d + 4, "ftyp", 4) == 0)
        return "HEIF/AVIF";
    return NULL;
}

/* The format from the magic bytes: KILN_IMAGE_PNG/JPEG/WEBP, or -1 with
 * the client's error set (empty, another or no known format). */
static int sniff(const uint8_t *d, size_t len, kiln_err *err)
{
    if (!d || len == 0) {
        kiln_err_set(err, KILN_ERR_INVALID, "empty image data");
        return -1;
    }
    static const uint8_t png_magic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (len >= 8 && memcmp(d, png_magic, 8) == 0)
        return KILN_IMAGE_PNG;
    if (len >= 3 && d[0] == 0xff && d[1] == 0xd8 && d[2] == 0xff)
        return KILN_IMAGE_JPEG;
    if (len >= 12 && memcmp(d, "RIFF", 4) == 0 && memcmp(d + 8, "WEBP", 4) == 0)
        return KILN_IMAGE_WEBP;
    const char *other = other_format(d, len);
    if (other)
        kiln_err_set(err, KILN_ERR_INVALID, "unsupported image format %s (send PNG, JPEG or WebP)",
                     other);
    else
        kiln_err_set(err, KILN_ERR_INVALID, "not a PNG, JPEG or WebP image");
    return -1;
}

kiln_status kiln_image_decode(const void *data, size_t len, const kiln_image_limits *limits,
                              kiln_image *out, kiln_err *err)
{
    kiln_image_limits lim = limits ? *limits : KILN_IMAGE_LIMITS_DEFAULT;
    memset(out, 0, sizeof *out);
    if (lim.max_side < 1 || lim.max_pixels < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad image limits");
    const uint8_t *d = data;
    switch (sniff(d, len, err)) {
    case KILN_IMAGE_PNG: return kiln_image_png_decode(d, len, &lim, out, err);
    case KILN_IMAGE_JPEG: return kiln_image_jpeg_decode(d, len, &lim, out, err);
    case KILN_IMAGE_WEBP: return kiln_image_webp_decode(d, len, &lim, out, err);
    default: return KILN_ERR_INVALID;
    }
}

kiln_status kiln_image_probe(const void *data, size_t len, const kiln_image_limits *limits,
                             int *width, int *height, kiln_err *err)
{
    kiln_image_limits lim = limits ? *limits : KILN_IMAGE_LIMITS_DEFAULT;
    *width = *height = 0;
    if (lim.max_side < 1 || lim.max_pixels < 1)
        return kiln_err_set(err, KILN_ERR_INVALID, "bad image limits");
    const uint8_t *d = data;
    switch (sniff(d, len, err)) {
    case KILN_IMAGE_PNG: return kiln_image_png_probe(d, len, &lim, width, height, err);
    case KILN_IMAGE_JPEG: return kiln_image_jpeg_probe(d, len, &lim, width, height, err);
    case KILN_IMAGE_WEBP: return kiln_image_webp_probe(d, len, &lim, width, height, err);
    default: return KILN_ERR_INVALID;
    }
}

kiln_status kiln_image_decode_mask(const void *data, size_t len, const kiln_image_limits *limits,
                                   kiln_image *out, kiln_err *err)
{
    kiln_image_limits lim = limits ? *limits : KILN_IMAGE_LIMITS_DEFAULT;
    memset(out, 0, sizeof *out);
    static const uint8_t png_magic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    if (!data || len < 8 || memcmp(data, png_magic, 8) != 0)
        return kiln_err_set(err, KILN_ERR_INVALID, "the mask must be a PNG");
    return kiln_image_png_decode_mask(data, len, &lim, out, err);
}

static kiln_status read_file(const char *path, const kiln_image_limits *limits, kiln_image *out,
                             kiln_err *err, int mask);

kiln_status kiln_image_read_mask_file(const char *path, const kiln_image_limits *limits,
                                      kiln_image *out, kiln_err *err)
{
    return read_file(path, limits, out, err, 1);
}

kiln_status kiln_image_read_file(const char *path, const kiln_image_limits *limits,
                                 kiln_image *out, kiln_err *err)
{
    return read_file(path, limits, out, err, 0);
}

static kiln_status read_file(const char *path, const kiln_image_limits *limits, kiln_image *out,
                             kiln_err *err, int mask)
{
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f)
        return kiln_err_set(err, errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "cannot open %s: %s", base_name(path), strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return kiln_err_set(err, KILN_ERR_IO, "%s is not a readable file", base_name(path));
    }
    size_t len = (size_t)sb.st_size;
    uint8_t *data = malloc(len ? len : 1);
    if (!data) {
        fclose(f);
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory reading %s", base_name(path));
    }
    size_t got = fread(data, 1, len, f);
    int rerr = ferror(f);
    fclose(f);
    kiln_status st;
    if (got != len || rerr)
        st = kiln_err_set(err, KILN_ERR_IO, "cannot read %s", base_name(path));
    else if ((st = mask ? kiln_image_decode_mask(data, len, limits, out, err)
                        : kiln_image_decode(data, len, limits, out, err)) != KILN_OK)
        kiln_err_wrap(err, "%s", base_name(path));
    free(data);
    return st;
}
