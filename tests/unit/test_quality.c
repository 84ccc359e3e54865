/* kiln-quality's metrics (tools/bench/quality.c): PSNR and SSIM against
 * values worked out by hand, the median/worst summary, and the contact
 * sheet's layout. */
#include <string.h>

#include "tests/test.h"
#include "tools/bench/quality.h"

static kiln_image solid(int w, int h, uint8_t r, uint8_t g, uint8_t b)
{
    kiln_image im = {0};
    kiln_err err = {0};
    if (kiln_image_alloc(&im, w, h, &err))
        abort();
    for (int i = 0; i < w * h; i++)
        im.pixels[3 * i] = r, im.pixels[3 * i + 1] = g, im.pixels[3 * i + 2] = b;
    return im;
}

static void test_psnr(void)
{
    kiln_image a = solid(16, 16, 100, 100, 100), b = solid(16, 16, 101, 99, 101);
    CHECK(kiln_quality_psnr(&a, &a) == INFINITY);
    /* every value off by one: MSE 1, 10 log10(255^2) */
    CHECK_NEAR(kiln_quality_psnr(&a, &b), 20 * log10(255.0), 1e-9);
    kiln_image c = solid(8, 16, 0, 0, 0);
    CHECK(kiln_quality_psnr(&a, &c) < 0);
    kiln_image_free(&a), kiln_image_free(&b), kiln_image_free(&c);
}

static void test_ssim(void)
{
    /* Flat images: no variance, so SSIM is the luminance term alone,
     * (2 mx my + C1) / (mx^2 + my^2 + C1) with C1 = (0.01 * 255)^2. */
    kiln_image a = solid(32, 24, 100, 100, 100), b = solid(32, 24, 110, 110, 110);
    double c1 = 2.55 * 2.55;
    CHECK_NEAR(kiln_quality_ssim(&a, &b), (2 * 100.0 * 110 + c1) / (100.0 * 100 + 110.0 * 110 + c1),
               1e-9);
    /* A pattern against itself is 1; against its negative, whose
     * covariance is minus its variance, below 0. */
    kiln_image p = solid(40, 40, 0, 0, 0), q = solid(40, 40, 0, 0, 0);
    uint32_t s = 1;
    for (int i = 0; i < 40 * 40 * 3; i++) {
        s = s * 1664525u + 1013904223u;
        p.pixels[i] = (uint8_t)(s >> 24);
        q.pixels[i] = (uint8_t)(255 - p.pixels[i]);
    }
    CHECK_NEAR(kiln_quality_ssim(&p, &p), 1.0, 1e-12);
    CHECK(kiln_quality_ssim(&p, &q) < 0);
    /* Noise of +-8 levels on the pattern: close to 1 but below. */
    kiln_image r = solid(40, 40, 0, 0, 0);
    for (int i = 0; i < 40 * 40 * 3; i++) {
        s = s * 1664525u + 1013904223u;
        int v = p.pixels[i] + (int)(s >> 28) - 8;
        r.pixels[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    double sr = kiln_quality_ssim(&r, &p);
    CHECKF(sr > 0.9 && sr < 1.0, "SSIM %.5f", sr);
    kiln_image tiny = solid(10, 10, 1, 1, 1); /* smaller than one window */
    CHECK(isnan(kiln_quality_ssim(&tiny, &tiny)));
    kiln_image *all[] = {&a, &b, &p, &q, &r, &tiny};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        kiln_image_free(all[i]);
}

static void test_summary(void)
{
    double v[] = {3, 1, 2}, w[] = {4, 1, 3, 2}, med, worst;
    kiln_quality_summary(v, 3, &med, &worst);
    CHECK(med == 2 && worst == 1);
    kiln_quality_summary(w, 4, &med, &worst);
    CHECK(med == 2.5 && worst == 1);
}

static void test_sheet(void)
{
    kiln_image red = solid(32, 16, 255, 0, 0), blue = solid(32, 16, 0, 0, 255);
    const kiln_image *pairs[3][2] = {{&red, &blue}, {&blue, &red}, {&red, &red}};
    kiln_image sheet;
    kiln_err err = {0};
    CHECK(!kiln_quality_sheet(pairs, 3, 16, 2, &sheet, &err));
    /* 2 cells per row of 2 x 16 px, 8 px gaps; rows of 8 px (16 x 16/32). */
    CHECK(sheet.width == 2 * 32 + 3 * 8 && sheet.height == 2 * 8 + 3 * 8);
    const uint8_t *px = sheet.pixels;
#define AT(x, y) (px + ((size_t)(y) * sheet.width + (x)) * 3)
    CHECK(AT(8, 8)[0] == 255 && AT(8, 8)[2] == 0);         /* pair 0 left: red */
    CHECK(AT(8 + 16, 8)[0] == 0 && AT(8 + 16, 8)[2] == 255); /* pair 0 right: blue */
    CHECK(AT(8 + 32 + 8, 8)[2] == 255);                      /* pair 1 left: blue */
    CHECK(AT(8, 8 + 8 + 8)[0] == 255);                       /* pair 2, next row */
    CHECK(AT(0, 0)[0] == 255 && AT(0, 0)[1] == 255);         /* the gap: white */
#undef AT
    kiln_image_free(&sheet);
    kiln_image odd = solid(16, 16, 0, 0, 0);
    const kiln_image *bad[1][2] = {{&red, &odd}};
    CHECK(kiln_quality_sheet(bad, 1, 16, 1, &sheet, &err) == KILN_ERR_INVALID);
    kiln_image_free(&red), kiln_image_free(&blue), kiln_image_free(&odd);
}

int main(void)
{
    RUN(test_psnr);
    RUN(test_ssim);
    RUN(test_summary);
    RUN(test_sheet);
    return test_finish();
}
