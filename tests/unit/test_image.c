/* Image codecs: PNG/JPEG/WebP round trips and determinism, decoding to the
 * RGB that Pillow's open + convert("RGB") gives (fixtures written by
 * tests/oracle/gen_image_fixtures.py), decoding the oracle's PNGs against
 * their image_uint8 tensors, limits, and clean refusal of malformed input. */
#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "common/image.h"
#include "common/safetensors.h"
#include "tests/oracle/oracle_check.h"
#include "tests/test.h"

static char fixtures[1024];

/* --- helpers ------------------------------------------------------------- */

/* A deterministic test picture: smooth ramps plus a little hash noise. */
static kiln_image make_image(int w, int h, int noise)
{
    kiln_image img = {0};
    kiln_err err = {0};
    if (kiln_image_alloc(&img, w, h, &err)) {
        CHECKF(0, "alloc: %s", err.msg);
        return img;
    }
    uint32_t s = 12345;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++) {
            uint8_t *p = img.pixels + ((size_t)y * w + x) * 3;
            s = s * 1664525u + 1013904223u;
            int n = noise ? (int)(s >> 28) - 8 : 0;
            int v[3] = {x * 255 / (w > 1 ? w - 1 : 1) + n, y * 255 / (h > 1 ? h - 1 : 1) - n,
                        (x + y) * 255 / (w + h) + n};
            for (int c = 0; c < 3; c++)
                p[c] = (uint8_t)(v[c] < 0 ? 0 : v[c] > 255 ? 255 : v[c]);
        }
    return img;
}

static int same_image(const kiln_image *a, const kiln_image *b, const char *what)
{
    if (a->width != b->width || a->height != b->height) {
        CHECKF(0, "%s: size %dx%d vs %dx%d", what, a->width, a->height, b->width, b->height);
        return 0;
    }
    size_t n = (size_t)a->width * a->height * 3, bad = 0;
    int maxd = 0;
    for (size_t i = 0; i < n; i++) {
        int d = abs((int)a->pixels[i] - (int)b->pixels[i]);
        bad += d != 0;
        maxd = d > maxd ? d : maxd;
    }
    CHECKF(bad == 0, "%s: %zu of %zu samples differ (max %d)", what, bad, n, maxd);
    return bad == 0;
}

static double psnr(const kiln_image *a, const kiln_image *b)
{
    return oracle_psnr_u8(a->pixels, b->pixels, (size_t)a->width * a->height * 3);
}

static kiln_status decode_buf(const kiln_buf *b, kiln_image *out, kiln_err *err)
{
    return kiln_image_decode(b->data, b->len, NULL, out, err);
}

/* The PNG CRC-32, to forge headers with valid checksums. */
static uint32_t crc32_png(const uint8_t *p, size_t n)
{
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1)));
    }
    return ~c;
}

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Expects a clean KILN_ERR_INVALID with a message and a zeroed image. */
static void expect_invalid(const uint8_t *d, size_t n, const kiln_image_limits *lim,
                           const char *what, const char *msg_part)
{
    kiln_image img = {.width = 7, .height = 7};
    kiln_err err = {0};
    kiln_status st = kiln_image_decode(d, n, lim, &img, &err);
    CHECKF(st == KILN_ERR_INVALID, "%s: status %s (%s)", what, kiln_status_name(st), err.msg);
    CHECKF(err.msg[0] != '\0', "%s: empty message", what);
    CHECKF(!msg_part || strstr(err.msg, msg_part), "%s: message '%s' lacks '%s'", what, err.msg,
           msg_part);
    CHECKF(img.pixels == NULL && img.width == 0 && img.height == 0, "%s: output not zeroed", what);
    if (st == KILN_OK)
        kiln_image_free(&img);
}

/* --- encoding round trips ------------------------------------------------ */

static void test_png_roundtrip(void)
{
    kiln_image src = make_image(37, 23, 1);
    /* Every strategy x filter x level 0, 3, 6, 9. */
    for (int i = 0; i < 2 * 6 * 4; i++) {
        int strategy = i / 24, f = i / 4 % 6, level = i % 4 * 3;
        kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
        o.png_strategy = (kiln_png_strategy)strategy;
        o.png_filter = (kiln_png_filter)f;
        o.png_level = level;
        kiln_buf a = {0}, b = {0};
        kiln_err err = {0};
        CHECKF(kiln_image_encode(&src, &o, &a, &err) == KILN_OK, "encode: %s", err.msg);
        CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_OK);
        CHECKF(a.len == b.len && memcmp(a.data, b.data, a.len) == 0,
               "strategy %d filter %d level %d: not deterministic", strategy, f, level);
        CHECK(!memmem(a.data, a.len, "tIME", 4) && !memmem(a.data, a.len, "tEXt", 4));
        kiln_image back = {0};
        CHECKF(decode_buf(&a, &back, &err) == KILN_OK, "decode: %s", err.msg);
        same_image(&back, &src, "png round trip");
        kiln_image_free(&back);
        kiln_buf_free(&a);
        kiln_buf_free(&b);
    }
    /* Appends after what the buffer already holds. */
    kiln_buf b = {0};
    kiln_err err = {0};
    CHECK(kiln_buf_append(&b, "xyz", 3, &err) == KILN_OK);
    CHECK(kiln_image_encode(&src, NULL, &b, &err) == KILN_OK);
    CHECK(b.len > 11 && memcmp(b.data, "xyz\x89PNG", 7) == 0);
    kiln_buf_free(&b);
    kiln_image_free(&src);
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Text entries become iTXt chunks right after IHDR, each with a valid CRC
 * (checked with zlib's crc32, as every PNG reader does), the pixels are
 * unchanged, and bad keys are refused. */
static void test_png_text(void)
{
    kiln_image src = make_image(40, 24, 1);
    const kiln_image_text text[] = {{"prompt", "a caf\xc3\xa9 at dusk"}, {"seed", "42"}};
    for (int striped = 0; striped < 2; striped++) {
        kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
        o.png_strategy = striped ? KILN_PNG_STRATEGY_RLE : KILN_PNG_STRATEGY_LZ77;
        o.text = text, o.n_text = 2;
        kiln_buf a = {0};
        kiln_err err = {0};
        CHECK(kiln_buf_append(&a, "xy", 2, &err) == KILN_OK); /* appends after this */
        CHECKF(kiln_image_encode(&src, &o, &a, &err) == KILN_OK, "encode: %s", err.msg);
        const uint8_t *p = a.data + 2;
        size_t len = a.len - 2, off = 8;
        int n_itxt = 0, order_ok = 1, crc_ok = 1, found = 0;
        while (off + 12 <= len) {
            uint32_t dl = rd32(p + off);
            if (off + 12 + dl > len)
                break;
            const uint8_t *type = p + off + 4;
            crc_ok &= (uint32_t)crc32(crc32(0L, Z_NULL, 0), type, dl + 4) == rd32(type + 4 + dl);
            if (!memcmp(type, "iTXt", 4)) {
                if (!n_itxt)
                    order_ok &= off == 33; /* right after the signature and IHDR */
                static const char want[] = "prompt\0\0\0\0\0a caf\xc3\xa9 at dusk";
                found |= dl == sizeof want - 1 && !memcmp(type + 4, want, dl);
                n_itxt++;
            } else if (!memcmp(type, "IDAT", 4)) {
                order_ok &= n_itxt == 2; /* both before the pixels */
            }
            off += 12 + dl;
        }
        CHECKF(off == len && crc_ok && order_ok && found && n_itxt == 2,
               "striped %d: off %zu/%zu crc %d order %d found %d itxt %d", striped, off, len,
               crc_ok, order_ok, found, n_itxt);
        kiln_buf png = {.data = a.data + 2, .len = a.len - 2};
        kiln_image back = {0};
        CHECKF(decode_buf(&png, &back, &err) == KILN_OK, "decode: %s", err.msg);
        same_image(&back, &src, "png with text");
        kiln_image_free(&back);
        kiln_buf_free(&a);
    }
    const kiln_image_text bad[] = {{"", "x"}};
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.text = bad, o.n_text = 1;
    kiln_buf a = {0};
    kiln_err err = {0};
    CHECK(kiln_image_encode(&src, &o, &a, &err) == KILN_ERR_INVALID && a.len == 0);
    kiln_buf_free(&a);
    kiln_image_free(&src);
}

/* JPEG: one COM segment right after SOI, the rest the plain file's bytes;
 * WebP: an extended file (VP8X with the XMP flag and the canvas size), the
 * plain file's image chunk, and an XMP chunk with the text escaped; both
 * decode to the plain file's pixels.  A long text is cut to fit a JPEG
 * segment. */
static void test_jpeg_webp_text(void)
{
    kiln_image src = make_image(40, 24, 1);
    const kiln_image_text text[] = {{"prompt", "a <caf\xc3\xa9> & co"}, {"seed", "42"}};
    static const char lines[] = "prompt: a <caf\xc3\xa9> & co\nseed: 42\n";
    const size_t tl = sizeof lines - 1;
    for (int f = 0; f < 2; f++) {
        kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
        o.format = f ? KILN_IMAGE_WEBP : KILN_IMAGE_JPEG;
        o.quality = 90;
        kiln_buf a = {0}, b = {0};
        kiln_err err = {0};
        CHECK(kiln_image_encode(&src, &o, &a, &err) == KILN_OK);
        o.text = text, o.n_text = 2;
        CHECKF(kiln_image_encode(&src, &o, &b, &err) == KILN_OK, "%s", err.msg);
        if (!f) {
            CHECK(b.len == a.len + 4 + tl && !memcmp(b.data, "\xff\xd8\xff\xfe", 4) &&
                  (size_t)(b.data[4] << 8 | b.data[5]) == tl + 2 &&
                  !memcmp(b.data + 6, lines, tl) && !memcmp(b.data + 6 + tl, a.data + 2, a.len - 2));
        } else {
            uint32_t riff = b.data[4] | b.data[5] << 8 | b.data[6] << 16 | (uint32_t)b.data[7] << 24;
            CHECK(riff == b.len - 8 && !memcmp(b.data + 12, "VP8X", 4) && (b.data[20] & 0x04) &&
                  (b.data[24] | b.data[25] << 8 | b.data[26] << 16) == 39 &&
                  (b.data[27] | b.data[28] << 8 | b.data[29] << 16) == 23);
            CHECK(!memcmp(b.data + 30, a.data + 12, a.len - 12)); /* the image chunk as it was */
            CHECK(!memcmp(b.data + 30 + a.len - 12, "XMP ", 4) &&
                  memmem(b.data, b.len, "prompt: a &lt;caf\xc3\xa9&gt; &amp; co", 32));
        }
        kiln_image pa = {0}, pb = {0};
        CHECKF(decode_buf(&a, &pa, &err) == KILN_OK && decode_buf(&b, &pb, &err) == KILN_OK,
               "%s", err.msg);
        same_image(&pb, &pa, f ? "webp with text" : "jpeg with text");
        kiln_image_free(&pa), kiln_image_free(&pb);
        kiln_buf_free(&a), kiln_buf_free(&b);
    }
    char *big = malloc(70000);
    if (big) {
        memset(big, 'x', 69999);
        big[69999] = '\0';
        const kiln_image_text t1[] = {{"prompt", big}};
        kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
        o.format = KILN_IMAGE_JPEG, o.text = t1, o.n_text = 1;
        kiln_buf b = {0};
        kiln_err err = {0};
        CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_OK);
        size_t seg = (size_t)(b.data[4] << 8 | b.data[5]);
        CHECK(seg == 65535 && !memcmp(b.data + 4 + seg - 3, "...", 3));
        kiln_image back = {0};
        CHECK(decode_buf(&b, &back, &err) == KILN_OK);
        kiln_image_free(&back);
        kiln_buf_free(&b);
        free(big);
    }
    kiln_image_free(&src);
}

static void test_jpeg_roundtrip(void)
{
    kiln_image src = make_image(64, 48, 0);
    size_t prev = 0;
    int qualities[] = {0, 10, 50, 90, 100};
    for (int i = 0; i < 5; i++) {
        kiln_image_encode_opts o = {.format = KILN_IMAGE_JPEG, .quality = qualities[i]};
        kiln_buf a = {0}, b = {0};
        kiln_err err = {0};
        CHECKF(kiln_image_encode(&src, &o, &a, &err) == KILN_OK, "encode: %s", err.msg);
        CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_OK);
        CHECK(a.len == b.len && memcmp(a.data, b.data, a.len) == 0);
        CHECKF(a.len > prev, "quality %d gives %zu bytes, not more than %zu", qualities[i], a.len,
               prev);
        prev = a.len;
        kiln_image back = {0};
        CHECKF(decode_buf(&a, &back, &err) == KILN_OK, "decode: %s", err.msg);
        if (back.pixels) {
            double p = psnr(&back, &src);
            double need = qualities[i] >= 90 ? 38 : qualities[i] >= 50 ? 30 : 15;
            CHECKF(p >= need, "quality %d: PSNR %.1f dB < %.0f", qualities[i], p, need);
        }
        kiln_image_free(&back);
        kiln_buf_free(&a);
        kiln_buf_free(&b);
    }
    kiln_image_free(&src);
}

static void test_webp_roundtrip(void)
{
    kiln_image src = make_image(64, 48, 0);
    kiln_image_encode_opts o = {.format = KILN_IMAGE_WEBP, .quality = 90};
    kiln_buf a = {0}, b = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_encode(&src, &o, &a, &err) == KILN_OK, "encode: %s", err.msg);
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_OK);
    CHECK(a.len == b.len && memcmp(a.data, b.data, a.len) == 0);
    CHECK(a.len > 12 && memcmp(a.data, "RIFF", 4) == 0 && memcmp(a.data + 8, "WEBP", 4) == 0);
    kiln_image back = {0};
    CHECKF(decode_buf(&a, &back, &err) == KILN_OK, "decode: %s", err.msg);
    if (back.pixels)
        CHECKF(psnr(&back, &src) >= 35, "PSNR %.1f dB", psnr(&back, &src));
    kiln_image_free(&back);
    kiln_buf_free(&a);
    kiln_buf_free(&b);
    kiln_image_free(&src);
}

static void test_encode_errors(void)
{
    kiln_image src = make_image(8, 8, 0);
    kiln_buf b = {0};
    kiln_err err = {0};
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.png_level = 10;
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.png_filter = (kiln_png_filter)99;
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.png_strategy = (kiln_png_strategy)2;
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    o = (kiln_image_encode_opts){.format = KILN_IMAGE_JPEG, .quality = 101};
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    o = (kiln_image_encode_opts){.format = KILN_IMAGE_WEBP, .quality = -1};
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    o = (kiln_image_encode_opts){.format = KILN_IMAGE_FORMAT_COUNT, .quality = 50};
    CHECK(kiln_image_encode(&src, &o, &b, &err) == KILN_ERR_INVALID);
    kiln_image empty = {0};
    CHECK(kiln_image_encode(&empty, NULL, &b, &err) == KILN_ERR_INVALID);
    CHECK(b.len == 0);
    kiln_image wide = make_image(16384, 1, 0);
    o = (kiln_image_encode_opts){.format = KILN_IMAGE_WEBP, .quality = 50};
    CHECK(kiln_image_encode(&wide, &o, &b, &err) == KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "16383"), "%s", err.msg);
    CHECK(b.len == 0);
    kiln_image_free(&wide);
    kiln_image_free(&src);
}

static void test_formats(void)
{
    kiln_image_format f;
    CHECK(kiln_image_format_parse("png", &f) == 0 && f == KILN_IMAGE_PNG);
    CHECK(kiln_image_format_parse("JPEG", &f) == 0 && f == KILN_IMAGE_JPEG);
    CHECK(kiln_image_format_parse("jpg", &f) == 0 && f == KILN_IMAGE_JPEG);
    CHECK(kiln_image_format_parse("webp", &f) == 0 && f == KILN_IMAGE_WEBP);
    CHECK(kiln_image_format_parse("gif", &f) == -1);
    CHECK(kiln_image_format_parse(NULL, &f) == -1);
    CHECK(strcmp(kiln_image_format_mime(KILN_IMAGE_WEBP), "image/webp") == 0);
    CHECK(strcmp(kiln_image_format_name(KILN_IMAGE_JPEG), "jpeg") == 0);
    CHECK(kiln_image_format_name(KILN_IMAGE_FORMAT_COUNT) == NULL);
}

static void test_file_io(void)
{
    char path[] = "/tmp/kiln_test_image_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0)
        return;
    close(fd);
    kiln_image src = make_image(20, 10, 1), back = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_write_file(path, &src, NULL, &err) == KILN_OK, "%s", err.msg);
    CHECKF(kiln_image_read_file(path, NULL, &back, &err) == KILN_OK, "%s", err.msg);
    same_image(&back, &src, "file round trip");
    kiln_image_free(&back);
    unlink(path);
    CHECK(kiln_image_read_file(path, NULL, &back, &err) == KILN_ERR_NOT_FOUND);
    CHECKF(!strstr(err.msg, "/tmp"), "message leaks the folder: %s", err.msg);
    CHECK(kiln_image_write_file("/nonexistent-dir/x.png", &src, NULL, &err) == KILN_ERR_IO);
    CHECKF(!strstr(err.msg, "nonexistent-dir"), "message leaks the folder: %s", err.msg);
    kiln_image_free(&src);
}

/* --- decoding against Pillow and the oracle ------------------------------ */

static void test_pil_fixtures(void)
{
    static const char *names[] = {
        "png_gray1.png",      "png_gray2.png",    "png_gray4.png",    "png_gray8.png",
        "png_gray8_trns.png", "png_gray16.png",   "png_rgb8_trns.png", "png_rgb16.png",
        "png_ga8.png",        "png_ga16.png",     "png_rgba8.png",    "png_rgba16.png",
        "png_pal1.png",       "png_pal2.png",     "png_pal4.png",     "png_pal8.png",
        "png_rgb8_adam7.png", "png_rgba16_adam7.png",
        "jpeg_420.jpg",       "jpeg_444.jpg",     "jpeg_422_progressive.jpg",
        "jpeg_gray.jpg",      "jpeg_cmyk.jpg",    "webp_lossy.webp",  "webp_lossless_alpha.webp",
    };
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char path[1200], exp_path[1300];
        snprintf(path, sizeof path, "%s/%s", fixtures, names[i]);
        snprintf(exp_path, sizeof exp_path, "%s.expected.png", path);
        kiln_image got = {0}, want = {0};
        kiln_err err = {0};
        CHECKF(kiln_image_read_file(path, NULL, &got, &err) == KILN_OK, "%s: %s", names[i],
               err.msg);
        CHECKF(kiln_image_read_file(exp_path, NULL, &want, &err) == KILN_OK, "%s: %s", names[i],
               err.msg);
        if (got.pixels && want.pixels)
            same_image(&got, &want, names[i]);
        kiln_image_free(&got);
        kiln_image_free(&want);
    }
}

static void test_oracle_pngs(void)
{
    DIR *d = opendir(oracle_path("cases"));
    CHECKF(d, "cannot list %s", oracle_path("cases"));
    if (!d)
        return;
    int images = 0, refs = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char name[64];
        kiln_err err = {0};
        kiln_st *st = oracle_check_open(e->d_name, "ref_fp32.safetensors");
        const kiln_st_tensor *t = st ? kiln_st_find(st, "image_uint8") : NULL;
        CHECKF(t && t->dtype == KILN_U8 && t->ndim == 4 && t->shape[3] == 3,
               "%s: no (B,H,W,3) uint8 image", e->d_name);
        for (int64_t b = 0; t && b < t->shape[0]; b++) {
            snprintf(name, sizeof name, "image_fp32_%lld.png", (long long)b);
            const char *png = oracle_case_path(e->d_name, name);
            kiln_image img = {0};
            CHECKF(kiln_image_read_file(png, NULL, &img, &err) == KILN_OK, "%s: %s", e->d_name,
                   err.msg);
            kiln_image want = {.width = (int)t->shape[2], .height = (int)t->shape[1],
                               .pixels = (uint8_t *)t->data + b * t->shape[1] * t->shape[2] * 3};
            if (img.pixels && same_image(&img, &want, e->d_name))
                images++;
            kiln_image_free(&img);
        }
        const char *ref0 = oracle_case_path(e->d_name, "input_ref0.png");
        if (access(ref0, R_OK) == 0) {
            kiln_image img = {0};
            CHECKF(kiln_image_read_file(ref0, NULL, &img, &err) == KILN_OK, "%s", err.msg);
            CHECKF(img.width == 200 && img.height == 136, "%s ref: %dx%d", e->d_name, img.width,
                   img.height);
            refs += img.pixels != NULL;
            kiln_image_free(&img);
        }
        kiln_st_close(st);
    }
    closedir(d);
    CHECKF(images >= 9 && refs >= 2, "matched %d images and %d references", images, refs);
}

/* --- limits and malformed input ------------------------------------------ */

static kiln_buf encode(const kiln_image *img, kiln_image_format fmt)
{
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.format = fmt;
    o.quality = 80;
    kiln_buf b = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_encode(img, &o, &b, &err) == KILN_OK, "encode: %s", err.msg);
    return b;
}

static void test_limits(void)
{
    kiln_image src = make_image(200, 136, 0);
    for (int f = 0; f < KILN_IMAGE_FORMAT_COUNT; f++) {
        kiln_buf b = encode(&src, (kiln_image_format)f);
        kiln_image_limits side = {.max_side = 199, .max_pixels = 1 << 20};
        kiln_image_limits area = {.max_side = 1000, .max_pixels = 200 * 136 - 1};
        expect_invalid(b.data, b.len, &side, "max_side", "too large");
        expect_invalid(b.data, b.len, &area, "max_pixels", "too large");
        kiln_image_limits exact = {.max_side = 200, .max_pixels = 200 * 136};
        kiln_image img = {0};
        kiln_err err = {0};
        CHECKF(kiln_image_decode(b.data, b.len, &exact, &img, &err) == KILN_OK, "%s", err.msg);
        kiln_image_free(&img);
        kiln_image_limits bad = {.max_side = 0, .max_pixels = 10};
        expect_invalid(b.data, b.len, &bad, "zero limits", "limits");
        kiln_buf_free(&b);
    }
    kiln_image_free(&src);
}

/* Rewrites a PNG's IHDR size and its CRC. */
static void png_set_size(kiln_buf *b, uint32_t w, uint32_t h)
{
    put_be32(b->data + 16, w);
    put_be32(b->data + 20, h);
    put_be32(b->data + 29, crc32_png(b->data + 12, 17));
}

static void test_malformed_png(void)
{
    kiln_image src = make_image(16, 16, 1);
    kiln_buf b = encode(&src, KILN_IMAGE_PNG);
    kiln_err err = {0};
    kiln_image img = {0};

    /* Every truncation before the end of the last IDAT is refused; a file
     * cut in IEND still decodes, as Pillow accepts it. */
    size_t iend = b.len - 12;
    for (size_t n = 0; n < iend; n++)
        expect_invalid(b.data, n, NULL, "truncated PNG", NULL);
    CHECK(kiln_image_decode(b.data, iend, NULL, &img, &err) == KILN_OK);
    kiln_image_free(&img);

    kiln_buf c = {0};
    kiln_buf_append(&c, b.data, b.len, &err);
    c.data[29] ^= 1; /* IHDR CRC */
    expect_invalid(c.data, c.len, NULL, "IHDR CRC", "CRC");
    memcpy(c.data, b.data, b.len);
    c.data[b.len - 13] ^= 0x40; /* last IDAT CRC */
    expect_invalid(c.data, c.len, NULL, "IDAT CRC", "CRC");
    memcpy(c.data, b.data, b.len);
    c.data[1] = 'X';
    expect_invalid(c.data, c.len, NULL, "wrong magic", "not a PNG, JPEG or WebP");
    memcpy(c.data, b.data, b.len);
    png_set_size(&c, 0, 16);
    expect_invalid(c.data, c.len, NULL, "zero width", NULL);
    png_set_size(&c, 100000, 100000);
    expect_invalid(c.data, c.len, NULL, "100000x100000", "too large");
    png_set_size(&c, 16384, 16384); /* within max_side, over 64 Mpx */
    expect_invalid(c.data, c.len, NULL, "16384x16384", "pixels");
    png_set_size(&c, 32, 16); /* more rows claimed than the data holds */
    expect_invalid(c.data, c.len, NULL, "short IDAT", NULL);

    /* Every single-byte corruption decodes or fails cleanly. */
    int refused = 0;
    for (size_t i = 8; i < b.len; i++) {
        memcpy(c.data, b.data, b.len);
        c.data[i] ^= 0xa5;
        kiln_status st = kiln_image_decode(c.data, c.len, NULL, &img, &err);
        CHECKF(st == KILN_OK || st == KILN_ERR_INVALID, "byte %zu: %s", i, kiln_status_name(st));
        refused += st != KILN_OK;
        kiln_image_free(&img);
    }
    CHECKF(refused > (int)(b.len - 8) / 2, "only %d corruptions refused", refused);
    kiln_buf_free(&c);
    kiln_buf_free(&b);
    kiln_image_free(&src);
}

static void test_malformed_jpeg_webp(void)
{
    kiln_image src = make_image(40, 24, 1);
    kiln_buf j = encode(&src, KILN_IMAGE_JPEG);
    for (size_t n = 0; n < j.len; n++)
        expect_invalid(j.data, n, NULL, "truncated JPEG", NULL);
    /* A SOF0 frame header claiming 60000x60000. */
    uint8_t *sof = memmem(j.data, j.len, "\xff\xc0", 2);
    CHECK(sof != NULL);
    if (sof) {
        sof[5] = sof[7] = 60000 >> 8;
        sof[6] = sof[8] = 60000 & 255;
        expect_invalid(j.data, j.len, NULL, "60000x60000 JPEG", "too large");
        sof[5] = sof[6] = 0;
        expect_invalid(j.data, j.len, NULL, "zero-height JPEG", NULL);
    }
    kiln_buf_free(&j);

    kiln_buf w = encode(&src, KILN_IMAGE_WEBP);
    for (size_t n = 0; n < w.len; n++)
        expect_invalid(w.data, n, NULL, "truncated WebP", NULL);
    memset(w.data + 12, 'x', w.len - 12);
    expect_invalid(w.data, w.len, NULL, "garbage WebP", "WebP");
    kiln_buf_free(&w);
    kiln_image_free(&src);

    static const char text[] = "this is not an image, just a text file\n";
    expect_invalid((const uint8_t *)text, sizeof text - 1, NULL, "text", "not a PNG");
    expect_invalid((const uint8_t *)"GIF89a\1\0\1\0\0\0\0", 13, NULL, "GIF", "GIF");
    expect_invalid((const uint8_t *)"BM\0\0\0\0\0\0\0\0\0\0\0\0", 14, NULL, "BMP", "BMP");
    expect_invalid((const uint8_t *)"", 0, NULL, "empty", "empty");
    expect_invalid(NULL, 10, NULL, "NULL data", "empty");
    expect_invalid((const uint8_t *)"\xff\xd8\xff", 3, NULL, "JPEG magic only", "JPEG");
    expect_invalid((const uint8_t *)"\x89PNG\r\n\x1a\n", 8, NULL, "PNG magic only", "PNG");
}

/* kiln_image_probe reads the size from the header alone: the same size
 * and the same refusals (limits, formats) as decoding, for every format;
 * a forged 8192x8192 PNG header is sized without its pixels, and every
 * prefix of a file is either sized right or refused cleanly. */
static void test_probe(void)
{
    kiln_image src = make_image(200, 136, 0);
    for (int f = 0; f < KILN_IMAGE_FORMAT_COUNT; f++) {
        kiln_buf b = encode(&src, (kiln_image_format)f);
        int w = 0, h = 0;
        kiln_err err = {0}, derr = {0};
        CHECKF(kiln_image_probe(b.data, b.len, NULL, &w, &h, &err) == KILN_OK && w == 200 &&
                   h == 136, "format %d: %s, %dx%d", f, err.msg, w, h);
        kiln_image_limits side = {.max_side = 199, .max_pixels = 1 << 20};
        kiln_image_limits area = {.max_side = 1000, .max_pixels = 200 * 136 - 1};
        const kiln_image_limits *lims[2] = {&side, &area};
        for (int l = 0; l < 2; l++) {
            kiln_image img = {0};
            err = derr = (kiln_err){0};
            CHECK(kiln_image_probe(b.data, b.len, lims[l], &w, &h, &err) == KILN_ERR_INVALID &&
                  w == 0 && h == 0);
            CHECK(kiln_image_decode(b.data, b.len, lims[l], &img, &derr) == KILN_ERR_INVALID);
            CHECKF(strcmp(err.msg, derr.msg) == 0, "probe '%s', decode '%s'", err.msg, derr.msg);
        }
        for (size_t n = 0; n < b.len; n++) {
            err = (kiln_err){0};
            kiln_status st = kiln_image_probe(b.data, n, NULL, &w, &h, &err);
            CHECKF((st == KILN_OK && w == 200 && h == 136) ||
                       (st == KILN_ERR_INVALID && err.msg[0] && w == 0),
                   "format %d, %zu bytes: %s %dx%d", f, n, kiln_status_name(st), w, h);
        }
        kiln_buf_free(&b);
    }
    kiln_image_free(&src);

    /* A PNG header claiming 8192x8192 over 16x16 pixels of data: sized at
     * once (decoding it would allocate 192 MiB, then fail). */
    kiln_image small = make_image(16, 16, 1);
    kiln_buf c = encode(&small, KILN_IMAGE_PNG);
    int w, h;
    kiln_err err = {0};
    png_set_size(&c, 8192, 8192);
    CHECK(kiln_image_probe(c.data, c.len, NULL, &w, &h, &err) == KILN_OK && w == 8192 &&
          h == 8192);
    png_set_size(&c, 16384, 16384);
    CHECK(kiln_image_probe(c.data, c.len, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "pixels"));
    png_set_size(&c, 100000, 16);
    CHECK(kiln_image_probe(c.data, c.len, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "too large"));
    png_set_size(&c, 0, 16);
    CHECK(kiln_image_probe(c.data, c.len, NULL, &w, &h, &err) == KILN_ERR_INVALID);
    memcpy(c.data + 12, "IDAT", 4); /* IHDR must come first */
    CHECK(kiln_image_probe(c.data, c.len, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "PNG"));
    kiln_buf_free(&c);
    kiln_buf j = encode(&small, KILN_IMAGE_JPEG);
    uint8_t *sof = memmem(j.data, j.len, "\xff\xc0", 2);
    CHECK(sof != NULL);
    if (sof) {
        sof[5] = sof[7] = 60000 >> 8;
        sof[6] = sof[8] = 60000 & 255;
        CHECK(kiln_image_probe(j.data, j.len, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
              strstr(err.msg, "too large"));
    }
    kiln_buf_free(&j);
    kiln_image_free(&small);
    static const char text[] = "this is not an image, just a text file\n";
    CHECK(kiln_image_probe(text, sizeof text - 1, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "not a PNG"));
    CHECK(kiln_image_probe("GIF89a\1\0\1\0\0\0\0", 13, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "GIF"));
    CHECK(kiln_image_probe(NULL, 0, NULL, &w, &h, &err) == KILN_ERR_INVALID &&
          strstr(err.msg, "empty"));
}

int main(void)
{
    const char *shared = getenv("KILN_SHARED"), *src = getenv("KILN_SOURCE_ROOT");
    if (!shared || !src) {
        fprintf(stderr, "KILN_SHARED and KILN_SOURCE_ROOT must be set\n");
        return 1;
    }
    snprintf(fixtures, sizeof fixtures, "%s/tests/data/image", src);
    RUN(test_formats);
    RUN(test_png_roundtrip);
    RUN(test_png_text);
    RUN(test_jpeg_webp_text);
    RUN(test_jpeg_roundtrip);
    RUN(test_webp_roundtrip);
    RUN(test_encode_errors);
    RUN(test_file_io);
    RUN(test_pil_fixtures);
    RUN(test_oracle_pngs);
    RUN(test_limits);
    RUN(test_malformed_png);
    RUN(test_malformed_jpeg_webp);
    RUN(test_probe);
    return test_finish();
}
