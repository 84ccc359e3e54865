/* The striped PNG encoder (common/image_png_striped.c), the default PNG
 * path: files decode with libpng to exactly the source pixels at stripe
 * edges and odd sizes, are deterministic, hold one IDAT per stripe, and are
 * within 1% (+ a few bytes per stripe) of libpng's single stream with the
 * same filter and strategy. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    RUN(test_other_options);
    return test_finish();
}
