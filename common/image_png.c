/* PNG through libpng.  Every libpng call runs inside a *_run function that
 * holds the setjmp; all state lives in a struct owned by the caller's frame,
 * so nothing is lost or left dangling when libpng longjmps out (C11 7.13.2.1
 * makes non-volatile locals modified after setjmp indeterminate), and the
 * caller frees everything the same way on success and failure. */
#include "image_impl.h"

#include <png.h>
#include <setjmp.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

/* ---- shared ---- */

typedef struct png_coder {
    kiln_err *err;
    kiln_status st; /* first failure; libpng's own errors become INVALID/INTERNAL */
    kiln_status lib_code;
    const char *what; /* "invalid PNG" or "PNG encoder" */
} png_coder;

static void coder_error(png_structp png, png_const_charp msg)
{
    png_coder *c = png_get_error_ptr(png);
    if (c->st == KILN_OK)
        c->st = kiln_err_set(c->err, c->lib_code, "%s: %s", c->what, msg);
    png_longjmp(png, 1);
}

static void coder_warning(png_structp png, png_const_charp msg)
{
    /* Ancillary-chunk problems (bad CRC, bad iCCP, ...) are not worth a
     * rejection and must not reach stderr of a service. */
    (void)png;
    (void)msg;
}

/* ---- encoding ---- */

typedef struct png_enc {
    png_coder c;
    kiln_buf *out;
    png_structp png;
    png_infop info;
} png_enc;

static void enc_write(png_structp png, png_bytep p, png_size_t n)
{
    png_enc *e = png_get_io_ptr(png);
    if (e->c.st == KILN_OK)
        e->c.st = kiln_buf_append(e->out, p, n, e->c.err);
    if (e->c.st)
        png_error(png, "write failed");
}

static void enc_flush(png_structp png)
{
    (void)png;
}

static kiln_status png_encode_run(png_enc *e, const kiln_image *img, int level,
                                  kiln_png_filter filter, kiln_png_strategy strategy)
{
    static const int filters[] = {
        [KILN_PNG_FILTER_NONE] = PNG_FILTER_NONE, [KILN_PNG_FILTER_SUB] = PNG_FILTER_SUB,
        [KILN_PNG_FILTER_UP] = PNG_FILTER_UP,     [KILN_PNG_FILTER_AVG] = PNG_FILTER_AVG,
        [KILN_PNG_FILTER_PAETH] = PNG_FILTER_PAETH, [KILN_PNG_FILTER_ADAPTIVE] = PNG_ALL_FILTERS,
    };
    if (setjmp(png_jmpbuf(e->png)))
        return e->c.st ? e->c.st : kiln_err_set(e->c.err, KILN_ERR_INTERNAL, "PNG encoder failed");
    png_set_write_fn(e->png, e, enc_write, enc_flush);
    png_set_compression_level(e->png, level);
    if (strategy == KILN_PNG_STRATEGY_RLE)
        png_set_compression_strategy(e->png, Z_RLE);
    png_set_filter(e->png, PNG_FILTER_TYPE_BASE, filters[filter]);
    /* No tIME, text or gamma chunks: the bytes depend on the pixels only. */
    png_set_IHDR(e->png, e->info, (png_uint_32)img->width, (png_uint_32)img->height, 8,
                 PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_BASE,
                 PNG_FILTER_TYPE_BASE);
    png_write_info(e->png, e->info);
    size_t stride = (size_t)img->width * 3;
    for (int y = 0; y < img->height; y++)
        png_write_row(e->png, img->pixels + (size_t)y * stride);
    png_write_end(e->png, NULL);
    return KILN_OK;
}

kiln_status kiln_image_png_encode(const kiln_image *img, int level, kiln_png_filter filter,
                                  kiln_png_strategy strategy, kiln_buf *out, kiln_err *err)
{
    png_enc e = {.c = {.err = err, .lib_code = KILN_ERR_INTERNAL, .what = "PNG encoder"},
                 .out = out};
    size_t len0 = out->len;
    e.png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &e.c, coder_error, coder_warning);
    if (!e.png)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory creating a PNG encoder");
    e.info = png_create_info_struct(e.png);
    kiln_status st = e.info ? png_encode_run(&e, img, level, filter, strategy)
                            : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory creating a PNG encoder");
    png_destroy_write_struct(&e.png, &e.info);
    if (st)
        out->len = len0;
    return st;
}

/* ---- text chunks ---- */

static void be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8), p[3] = (uint8_t)v;
}

/* iTXt (PNG 1.2, 11.3.4.5): keyword, NUL, compression flag 0, method 0,
 * empty language tag, NUL, empty translated keyword, NUL, UTF-8 text. */
kiln_status kiln_image_png_add_text(kiln_buf *png, size_t start, const kiln_image_text *text,
                                    int n, kiln_err *err)
{
    const size_t ihdr_end = start + 8 + 12 + 13; /* signature, IHDR chunk */
    if (png->len < ihdr_end || memcmp(png->data + start + 12, "IHDR", 4))
        return kiln_err_set(err, KILN_ERR_INTERNAL, "PNG text: no IHDR chunk");
    size_t add = 0;
    for (int i = 0; i < n; i++) {
        size_t kl = text[i].key ? strlen(text[i].key) : 0;
        if (kl < 1 || kl > 79 || !text[i].value)
            return kiln_err_set(err, KILN_ERR_INVALID, "PNG text: bad key '%s'",
                                text[i].key ? text[i].key : "");
        for (size_t k = 0; k < kl; k++)
            if ((unsigned char)text[i].key[k] < 32 || (unsigned char)text[i].key[k] > 126)
                return kiln_err_set(err, KILN_ERR_INVALID, "PNG text: bad key '%s'", text[i].key);
        size_t vl = strlen(text[i].value);
        if (vl > (1u << 30))
            return kiln_err_set(err, KILN_ERR_INVALID, "PNG text: '%s' is too long", text[i].key);
        add += 12 + kl + 5 + vl;
    }
    if (!add)
        return KILN_OK;
    size_t tail = png->len - ihdr_end;
    /* grow by `add`, move everything after IHDR up, fill the gap */
    uint8_t *zero = calloc(1, add);
    if (!zero)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory");
    kiln_status st = kiln_buf_append(png, zero, add, err);
    free(zero);
    if (st)
        return st;
    memmove(png->data + ihdr_end + add, png->data + ihdr_end, tail);
    uint8_t *p = png->data + ihdr_end;
    for (int i = 0; i < n; i++) {
        size_t kl = strlen(text[i].key), vl = strlen(text[i].value);
        uint32_t dl = (uint32_t)(kl + 5 + vl);
        be32(p, dl);
        memcpy(p + 4, "iTXt", 4);
        uint8_t *d = p + 8;
        memcpy(d, text[i].key, kl);
        memcpy(d + kl, "\0\0\0\0\0", 5);
        memcpy(d + kl + 5, text[i].value, vl);
        be32(d + dl, (uint32_t)crc32(crc32(0L, Z_NULL, 0), p + 4, dl + 4));
        p += 12 + dl;
    }
    return KILN_OK;
}

/* ---- decoding ---- */

typedef struct png_dec {
    png_coder c;
    const uint8_t *data;
    size_t len, pos;
    png_structp png;
    png_infop info;
    kiln_image img;
    uint8_t *gray16;  /* raw big-endian 16-bit gray samples */
    png_bytep *rows;
    int mask;         /* kiln_image_png_decode_mask */
    uint8_t *rgba;    /* mask mode: the RGBA rows */
} png_dec;

static void dec_read(png_structp png, png_bytep p, png_size_t n)
{
    png_dec *d = png_get_io_ptr(png);
    if (n > d->len - d->pos)
        png_error(png, "truncated data");
    memcpy(p, d->data + d->pos, n);
    d->pos += n;
}

/* Chunks we never use; skipping them avoids inflating attacker-controlled
 * metadata (zTXt, iCCP) for nothing. */
static const png_byte ignored_chunks[] = "iCCP\0iTXt\0tEXt\0zTXt\0eXIf\0sPLT\0";

/* Mask mode (kiln_image_png_decode_mask): every pixel becomes 255 (repaint)
 * or 0 (keep) in all three channels: with an alpha channel (or tRNS) as
 * OpenAI reads masks, 255 where alpha is 0; without, PIL's convert("L")
 * luminance as diffusers reads masks.  16-bit samples keep their high
 * byte. */
static kiln_status png_decode_mask(png_dec *d, png_uint_32 w, png_uint_32 h, int color)
{
    int has_alpha = (color & PNG_COLOR_MASK_ALPHA) || png_get_valid(d->png, d->info, PNG_INFO_tRNS);
    if (color == PNG_COLOR_TYPE_PALETTE)
        png_set_palette_to_rgb(d->png);
    if ((color & ~PNG_COLOR_MASK_ALPHA) == PNG_COLOR_TYPE_GRAY)
        png_set_expand_gray_1_2_4_to_8(d->png);
    if (png_get_valid(d->png, d->info, PNG_INFO_tRNS))
        png_set_tRNS_to_alpha(d->png);
    png_set_strip_16(d->png);
    if ((color & ~PNG_COLOR_MASK_ALPHA) == PNG_COLOR_TYPE_GRAY)
        png_set_gray_to_rgb(d->png);
    if (!has_alpha)
        png_set_add_alpha(d->png, 0xff, PNG_FILLER_AFTER);
    png_set_interlace_handling(d->png);
    png_read_update_info(d->png, d->info);
    size_t row_bytes = (size_t)w * 4;
    if (png_get_channels(d->png, d->info) != 4 || png_get_bit_depth(d->png, d->info) != 8 ||
        png_get_rowbytes(d->png, d->info) != row_bytes)
        return kiln_err_set(d->c.err, KILN_ERR_INVALID, "invalid PNG: unsupported sample layout");
    kiln_status st = kiln_image_alloc(&d->img, (int)w, (int)h, d->c.err);
    if (st)
        return st;
    d->rgba = malloc(row_bytes * h);
    d->rows = malloc(sizeof *d->rows * h);
    if (!d->rgba || !d->rows)
        return kiln_err_set(d->c.err, KILN_ERR_NOMEM, "out of memory decoding a PNG");
    for (png_uint_32 y = 0; y < h; y++)
        d->rows[y] = d->rgba + (size_t)y * row_bytes;
    png_read_image(d->png, d->rows);
    size_t n = (size_t)w * h;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *p = d->rgba + 4 * i;
        /* PIL's L = R 299/1000 + G 587/1000 + B 114/1000 (Convert.c L24). */
        uint8_t v = has_alpha ? (p[3] == 0 ? 255 : 0)
                              : (uint8_t)((p[0] * 19595u + p[1] * 38470u + p[2] * 7471u + 0x8000u) >> 16);
        d->img.pixels[3 * i] = d->img.pixels[3 * i + 1] = d->img.pixels[3 * i + 2] = v;
    }
    return KILN_OK;
}

static kiln_status png_decode_run(png_dec *d, const kiln_image_limits *limits)
{
    if (setjmp(png_jmpbuf(d->png)))
        return d->c.st ? d->c.st : kiln_err_set(d->c.err, KILN_ERR_INVALID, "invalid PNG");
    png_set_read_fn(d->png, d, dec_read);
    png_set_keep_unknown_chunks(d->png, PNG_HANDLE_CHUNK_NEVER, ignored_chunks,
                                (int)(sizeof ignored_chunks / 5));
    png_read_info(d->png, d->info);

    png_uint_32 w, h;
    int depth, color, interlace;
    png_get_IHDR(d->png, d->info, &w, &h, &depth, &color, &interlace, NULL, NULL);
    kiln_status st = kiln_image_check_limits("PNG", w, h, limits, d->c.err);
    if (st)
        return st;

    if (d->mask)
        return png_decode_mask(d, w, h, color);
    /* The transforms below reproduce PIL's open + convert("RGB"); see
     * image.h.  16-bit gray is PIL mode "I;16", which convert("RGB")
     * clamps to 255 instead of scaling, so it is read raw and clamped here. */
    int gray16 = color == PNG_COLOR_TYPE_GRAY && depth == 16;
    if (color == PNG_COLOR_TYPE_PALETTE)
        png_set_palette_to_rgb(d->png);
    if (color == PNG_COLOR_TYPE_GRAY && depth < 8)
        png_set_expand_gray_1_2_4_to_8(d->png);
    if (depth == 16 && !gray16)
        png_set_strip_16(d->png); /* keeps the high byte, like PIL's "RGB;16B" unpacker */
    /* Also for palettes, whose tRNS chunk the expansion turns into alpha. */
    png_set_strip_alpha(d->png);
    if ((color == PNG_COLOR_TYPE_GRAY && !gray16) || color == PNG_COLOR_TYPE_GRAY_ALPHA)
        png_set_gray_to_rgb(d->png);
    png_set_interlace_handling(d->png);
    png_read_update_info(d->png, d->info);

    size_t out_channels = gray16 ? 1 : 3, out_depth = gray16 ? 16 : 8;
    size_t row_bytes = (size_t)w * out_channels * (out_depth / 8);
    if (png_get_channels(d->png, d->info) != out_channels ||
        png_get_bit_depth(d->png, d->info) != out_depth ||
        png_get_rowbytes(d->png, d->info) != row_bytes)
        return kiln_err_set(d->c.err, KILN_ERR_INVALID, "invalid PNG: unsupported sample layout");

    if ((st = kiln_image_alloc(&d->img, (int)w, (int)h, d->c.err)) != KILN_OK)
        return st;
    uint8_t *base = d->img.pixels;
    if (gray16) {
        d->gray16 = malloc(row_bytes * h);
        if (!d->gray16)
            return kiln_err_set(d->c.err, KILN_ERR_NOMEM, "out of memory decoding a PNG");
        base = d->gray16;
    }
    d->rows = malloc(sizeof *d->rows * h);
    if (!d->rows)
        return kiln_err_set(d->c.err, KILN_ERR_NOMEM, "out of memory decoding a PNG");
    for (png_uint_32 y = 0; y < h; y++)
        d->rows[y] = base + (size_t)y * row_bytes;
    png_read_image(d->png, d->rows);

    if (gray16) {
        size_t n = (size_t)w * h;
        for (size_t i = 0; i < n; i++) {
            unsigned v = (unsigned)d->gray16[2 * i] << 8 | d->gray16[2 * i + 1];
            uint8_t g = v > 255 ? 255 : (uint8_t)v;
            d->img.pixels[3 * i] = d->img.pixels[3 * i + 1] = d->img.pixels[3 * i + 2] = g;
        }
    }
    return KILN_OK;
}

static kiln_status png_decode(const uint8_t *data, size_t len, const kiln_image_limits *limits,
                              kiln_image *out, kiln_err *err, int mask)
{
    png_dec d = {.c = {.err = err, .lib_code = KILN_ERR_INVALID, .what = "invalid PNG"},
                 .data = data, .len = len, .mask = mask};
    d.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &d.c, coder_error, coder_warning);
    if (!d.png)
        return kiln_err_set(err, KILN_ERR_NOMEM, "out of memory creating a PNG decoder");
    d.info = png_create_info_struct(d.png);
    kiln_status st = d.info ? png_decode_run(&d, limits)
                            : kiln_err_set(err, KILN_ERR_NOMEM, "out of memory creating a PNG decoder");
    png_destroy_read_struct(&d.png, &d.info, NULL);
    free(d.rows);
    free(d.gray16);
    free(d.rgba);
    if (st)
        kiln_image_free(&d.img);
    else
        *out = d.img;
    return st;
}

kiln_status kiln_image_png_probe(const uint8_t *data, size_t len, const kiln_image_limits *limits,
                                 int *width, int *height, kiln_err *err)
{
    /* The signature (8 bytes), then the IHDR chunk, which PNG requires
     * first: its length (13), its type, width and height (big-endian). */
    if (len < 8 + 8 + 13 || memcmp(data + 12, "IHDR", 4) != 0 ||
        (data[8] | data[9] | data[10]) != 0 || data[11] != 13)
        return kiln_err_set(err, KILN_ERR_INVALID, "invalid PNG: no image header");
    uint32_t w = (uint32_t)data[16] << 24 | (uint32_t)data[17] << 16 | (uint32_t)data[18] << 8 |
                 data[19];
    uint32_t h = (uint32_t)data[20] << 24 | (uint32_t)data[21] << 16 | (uint32_t)data[22] << 8 |
                 data[23];
    kiln_status st = kiln_image_check_limits("PNG", w, h, limits, err);
    if (!st)
        *width = (int)w, *height = (int)h;
    return st;
}

kiln_status kiln_image_png_decode(const uint8_t *data, size_t len,
                                  const kiln_image_limits *limits, kiln_image *out,
                                  kiln_err *err)
{
    return png_decode(data, len, limits, out, err, 0);
}

kiln_status kiln_image_png_decode_mask(const uint8_t *data, size_t len,
                                       const kiln_image_limits *limits, kiln_image *out,
                                       kiln_err *err)
{
    return png_decode(data, len, limits, out, err, 1);
}
