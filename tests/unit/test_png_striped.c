/* The striped PNG encoder (common/image_png_striped.c), the default PNG
 * path: files decode with libpng to exactly the source pixels at stripe
 * edges and odd sizes, are deterministic, hold one IDAT per stripe, and are
 * within 1% (+ a few bytes per stripe) of libpng's single stream with the
 * same filter and strategy; every filter, zlib strategy, level and stripe
 * height that kiln-pngbench measures round-trips too, whatever the thread
 * count; text entries become iTXt chunks before the image data. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "common/image.h"
#include "common/image_impl.h"
#include "tests/test.h"

/* Smooth gradients with noise in some rows, so PAETH and RLE both matter. */
static kiln_image make(int w, int h)
{
    kiln_image img = {0};
    kiln_err err = {0};
    CHECK(kiln_image_alloc(&img, w, h, &err) == KILN_OK);
    uint32_t s = 12345;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++) {
                s = s * 1664525u + 1013904223u;
                int noise = y % 7 == 3 ? (int)(s >> 28) : 0;
                img.pixels[((size_t)y * w + x) * 3 + c] = (uint8_t)(x * (c + 1) + y * 2 + noise);
            }
    return img;
}

static int count_idat(const kiln_buf *b)
{
    int n = 0;
    for (size_t p = 8; p + 8 <= b->len;) {
        uint32_t len = (uint32_t)b->data[p] << 24 | (uint32_t)b->data[p + 1] << 16 |
                       (uint32_t)b->data[p + 2] << 8 | b->data[p + 3];
        n += !memcmp(b->data + p + 4, "IDAT", 4);
        p += 12 + (size_t)len;
    }
    return n;
}

static void check_size(int w, int h)
{
    kiln_image src = make(w, h);
    kiln_buf a = {0}, b = {0}, ref = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_encode(&src, NULL, &a, &err) == KILN_OK, "%dx%d: %s", w, h, err.msg);
    CHECK(kiln_image_encode(&src, NULL, &b, &err) == KILN_OK);
    CHECKF(a.len == b.len && !memcmp(a.data, b.data, a.len), "%dx%d: not deterministic", w, h);
    int stripes = (h + 63) / 64;
    CHECKF(count_idat(&a) == stripes, "%dx%d: %d IDAT chunks for %d stripes", w, h,
           count_idat(&a), stripes);
    kiln_image back = {0};
    CHECKF(kiln_image_decode(a.data, a.len, NULL, &back, &err) == KILN_OK, "%dx%d decode: %s", w,
           h, err.msg);
    CHECKF(back.width == w && back.height == h && back.pixels &&
               !memcmp(back.pixels, src.pixels, (size_t)w * h * 3),
           "%dx%d: pixels differ after the round trip", w, h);
    CHECK(kiln_image_png_encode(&src, 1, KILN_PNG_FILTER_PAETH, KILN_PNG_STRATEGY_RLE, &ref,
                                &err) == KILN_OK);
    CHECKF(a.len <= ref.len + ref.len / 100 + 16 * (size_t)stripes,
           "%dx%d: %zu bytes against libpng's %zu", w, h, a.len, ref.len);
    kiln_image_free(&back);
    kiln_image_free(&src);
    kiln_buf_free(&a);
    kiln_buf_free(&b);
    kiln_buf_free(&ref);
}

static void test_sizes(void)
{
    static const int sizes[][2] = {{1, 1}, {1, 200}, {3000, 1}, {64, 64}, {65, 65},
                                   {97, 300}, {256, 128}, {33, 1000}};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        check_size(sizes[i][0], sizes[i][1]);
}

/* Every option kiln-pngbench measures decodes to the source pixels, and
 * the bytes do not depend on the thread count; the adaptive filter's file
 * is no larger than PAETH's by more than 1%. */
static void test_options(void)
{
    kiln_image src = make(203, 150);
    kiln_err err = {0};
    /* -1: kiln's own run-only deflate instead of zlib */
    static const int strategies[] = {Z_RLE, Z_DEFAULT_STRATEGY, Z_FILTERED, Z_HUFFMAN_ONLY, -1};
    static const int rows[] = {1, 7, 64, 1000};
    size_t paeth_len = 0, adaptive_len = 0;
    for (int f = KILN_PNG_FILTER_NONE; f <= KILN_PNG_FILTER_ADAPTIVE; f++)
        for (int si = 0; si < 5; si++)
            for (int level = 1; level <= 9; level += 4)
                for (int ri = 0; ri < 4; ri++) {
                    kiln_png_stripe_opts o = {.rows = rows[ri], .threads = 1, .level = level,
                                              .zstrategy = strategies[si] < 0 ? Z_RLE : strategies[si],
                                              .filter = (kiln_png_filter)f,
                                              .kiln_rle = strategies[si] < 0};
                    kiln_buf a = {0}, b = {0};
                    CHECK(kiln_image_png_encode_stripes(&src, &o, NULL, 0, &a, &err) == KILN_OK);
                    o.threads = 3;
                    CHECK(kiln_image_png_encode_stripes(&src, &o, NULL, 0, &b, &err) == KILN_OK);
                    CHECKF(a.len == b.len && !memcmp(a.data, b.data, a.len),
                           "filter %d strategy %d level %d rows %d: bytes depend on threads", f,
                           strategies[si], level, rows[ri]);
                    kiln_image back = {0};
                    CHECKF(kiln_image_decode(a.data, a.len, NULL, &back, &err) == KILN_OK &&
                               back.width == src.width && back.height == src.height &&
                               !memcmp(back.pixels, src.pixels, (size_t)203 * 150 * 3),
                           "filter %d strategy %d level %d rows %d: pixels differ (%s)", f,
                           strategies[si], level, rows[ri], err.msg);
                    if (strategies[si] == Z_RLE && level == 1 && rows[ri] == 64) {
                        if (f == KILN_PNG_FILTER_PAETH)
                            paeth_len = a.len;
                        if (f == KILN_PNG_FILTER_ADAPTIVE)
                            adaptive_len = a.len;
                    }
                    kiln_image_free(&back);
                    kiln_buf_free(&a);
                    kiln_buf_free(&b);
                }
    CHECKF(adaptive_len <= paeth_len + paeth_len / 100, "adaptive %zu bytes, PAETH %zu",
           adaptive_len, paeth_len);
    kiln_png_stripe_opts bad = KILN_PNG_STRIPE_DEFAULTS;
    bad.rows = 0;
    kiln_buf c = {0};
    CHECK(kiln_image_png_encode_stripes(&src, &bad, NULL, 0, &c, &err) == KILN_ERR_INVALID &&
          c.len == 0);
    kiln_image_free(&src);
}

/* ADAPTIVE picks, per row, the filter with the smallest sum of its bytes
 * read as signed (libpng's heuristic), ties to the lower type, and on this
 * image (smooth rows and noisy rows) more than one kind. */
static void test_adaptive(void)
{
    kiln_image src = make(61, 40);
    size_t n = 61 * 3;
    uint8_t o[5][61 * 3 + 1], pick[61 * 3 + 1], scratch[61 * 3];
    int used[5] = {0};
    for (int y = 0; y < src.height; y++) {
        const uint8_t *cur = src.pixels + (size_t)y * n, *up = y ? cur - n : NULL;
        long best = -1;
        int best_t = 0;
        for (int t = 0; t < 5; t++) {
            kiln_image_png_filter_row((kiln_png_filter)t, o[t], cur, up, n, scratch);
            CHECK(o[t][0] == t);
            long sum = 0;
            for (size_t i = 1; i <= n; i++)
                sum += labs((long)(int8_t)o[t][i]);
            if (best < 0 || sum < best)
                best = sum, best_t = t;
        }
        kiln_image_png_filter_row(KILN_PNG_FILTER_ADAPTIVE, pick, cur, up, n, scratch);
        CHECKF(pick[0] == best_t && !memcmp(pick, o[best_t], n + 1), "row %d: type %d, want %d",
               y, pick[0], best_t);
        used[best_t] = 1;
    }
    CHECK(used[0] + used[1] + used[2] + used[3] + used[4] >= 2);
    kiln_image_free(&src);
}

/* The default path with text: iTXt chunks right after IHDR and before the
 * first IDAT, the pixels unchanged, and the file larger than the plain one
 * by exactly the chunks' bytes. */
static void test_text(void)
{
    kiln_image src = make(100, 130);
    kiln_err err = {0};
    const kiln_image_text text[] = {{"prompt", "a fox"}, {"seed", "7"}};
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    kiln_buf plain = {0}, with = {0};
    CHECK(kiln_image_encode(&src, &o, &plain, &err) == KILN_OK);
    o.text = text, o.n_text = 2;
    CHECK(kiln_image_encode(&src, &o, &with, &err) == KILN_OK);
    CHECKF(with.len == plain.len + (12 + 6 + 5 + 5) + (12 + 4 + 5 + 1), "%zu vs %zu", with.len,
           plain.len);
    CHECK(!memcmp(with.data + 33 + 4, "iTXt", 4));
    CHECK(!memcmp(with.data + 33 + 28 + 4, "iTXt", 4));
    CHECK(!memcmp(with.data + 33 + 28 + 22 + 4, "IDAT", 4));
    CHECK(!memcmp(with.data + 33 + 28 + 22, plain.data + 33, plain.len - 33));
    kiln_image back = {0};
    CHECK(kiln_image_decode(with.data, with.len, NULL, &back, &err) == KILN_OK &&
          !memcmp(back.pixels, src.pixels, (size_t)100 * 130 * 3));
    kiln_image_free(&back);
    kiln_buf_free(&plain);
    kiln_buf_free(&with);
    kiln_image_free(&src);
}

/* Another filter or strategy still takes libpng's single stream. */
static void test_other_options(void)
{
    kiln_image src = make(40, 200);
    kiln_image_encode_opts o = KILN_IMAGE_ENCODE_DEFAULTS;
    o.png_filter = KILN_PNG_FILTER_SUB;
    kiln_buf a = {0}, ref = {0};
    kiln_err err = {0};
    CHECK(kiln_image_encode(&src, &o, &a, &err) == KILN_OK);
    CHECK(kiln_image_png_encode(&src, o.png_level, o.png_filter, o.png_strategy, &ref, &err) ==
          KILN_OK);
    CHECK(a.len == ref.len && !memcmp(a.data, ref.data, a.len));
    kiln_buf_free(&a);
    kiln_buf_free(&ref);
    kiln_image_free(&src);
}

int main(void)
{
    RUN(test_sizes);
    RUN(test_options);
    RUN(test_adaptive);
    RUN(test_text);
    RUN(test_other_options);
    return test_finish();
}
