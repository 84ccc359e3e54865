/* LANCZOS resizing against Pillow (fixtures from
 * tests/oracle/gen_image_fixtures.py) and the FLUX.2 klein edit-reference
 * preprocessing against the diffusers oracle (ref0.image_preprocessed of
 * the edit cases), bit for bit. */
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "common/safetensors.h"
#include "tests/oracle/oracle_check.h"
#include "tests/test.h"

static char fixtures[1024];

static kiln_image load(const char *dir, const char *name)
{
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    kiln_image img = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_read_file(path, NULL, &img, &err) == KILN_OK, "%s: %s", name, err.msg);
    return img;
}

static void compare(const kiln_image *got, const kiln_image *want, const char *what)
{
    if (got->width != want->width || got->height != want->height) {
        CHECKF(0, "%s: %dx%d vs %dx%d", what, got->width, got->height, want->width,
               want->height);
        return;
    }
    size_t n = (size_t)got->width * got->height * 3, bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += got->pixels[i] != want->pixels[i];
    CHECKF(bad == 0, "%s: %zu of %zu samples differ from Pillow", what, bad, n);
}

static void check_resize(const char *src_name, int w, int h, const char *want_name)
{
    kiln_image src = load(fixtures, src_name), want = load(fixtures, want_name), got = {0};
    kiln_err err = {0};
    if (src.pixels && want.pixels) {
        CHECKF(kiln_image_resize_lanczos(&src, w, h, &got, &err) == KILN_OK, "%s", err.msg);
        if (got.pixels)
            compare(&got, &want, want_name);
    }
    kiln_image_free(&src);
    kiln_image_free(&want);
    kiln_image_free(&got);
}

static void test_lanczos_pillow(void)
{
    check_resize("lanczos_src.png", 1073, 976, "lanczos_src.1073x976.expected.png");
    check_resize("lanczos_src.png", 317, 211, "lanczos_src.317x211.expected.png");
    check_resize("lanczos_small.png", 123, 97, "lanczos_small.123x97.expected.png");
    /* 40 -> 24 rows is more than twice 50 -> 46 columns: Pillow 13 resizes
     * the rows first. */
    check_resize("lanczos_small.png", 46, 24, "lanczos_small.46x24.expected.png");
}

static void test_lanczos_edges(void)
{
    kiln_image src = load(fixtures, "lanczos_small.png"), a = {0}, b = {0};
    kiln_err err = {0};
    if (!src.pixels)
        return;
    /* Same size: an exact copy, as Pillow skips both passes. */
    CHECK(kiln_image_resize_lanczos(&src, src.width, src.height, &a, &err) == KILN_OK);
    compare(&a, &src, "identity resize");
    kiln_image_free(&a);
    /* One axis only: the other axis is untouched, so resizing the width and
     * then the height equals resizing both at once (Pillow's two passes). */
    CHECK(kiln_image_resize_lanczos(&src, 31, src.height, &a, &err) == KILN_OK);
    CHECK(a.width == 31 && a.height == src.height);
    CHECK(kiln_image_resize_lanczos(&a, 31, 17, &b, &err) == KILN_OK);
    kiln_image both = {0};
    CHECK(kiln_image_resize_lanczos(&src, 31, 17, &both, &err) == KILN_OK);
    compare(&b, &both, "width then height");
    kiln_image_free(&a);
    kiln_image_free(&b);
    kiln_image_free(&both);
    /* Down to a single pixel and up from one. */
    CHECK(kiln_image_resize_lanczos(&src, 1, 1, &a, &err) == KILN_OK);
    CHECK(kiln_image_resize_lanczos(&a, 5, 3, &b, &err) == KILN_OK);
    for (int i = 0; b.pixels && i < 15 * 3; i++)
        CHECK(b.pixels[i] == a.pixels[i % 3]);
    kiln_image_free(&a);
    kiln_image_free(&b);
    CHECK(kiln_image_resize_lanczos(&src, 0, 5, &a, &err) == KILN_ERR_INVALID);
    kiln_image empty = {0};
    CHECK(kiln_image_resize_lanczos(&empty, 5, 5, &a, &err) == KILN_ERR_INVALID);
    kiln_image_free(&src);
}

static void test_ref_size(void)
{
    static const struct {
        int w, h, ok, ow, oh;
    } cases[] = {
        {200, 136, 1, 192, 128},   /* the oracle's reference */
        {64, 64, 1, 64, 64},       {63, 100, 0, 0, 0},      {100, 63, 0, 0, 0},
        {512, 64, 1, 512, 64},     {513, 64, 0, 0, 0},      {64, 513, 0, 0, 0},
        {1024, 1024, 1, 1024, 1024}, /* not resized: only w*h > 1024^2 is */
        {1025, 1024, 1, 1024, 1008}, /* int(1025*s) = 1024, int(1024*s) = 1023 */
        {1100, 1000, 1, 1072, 976}, {4000, 3000, 1, 1168, 880}, {2896, 362, 1, 2896, 352},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int ow = -1, oh = -1;
        kiln_err err = {0};
        kiln_status st = kiln_image_flux2_ref_size(cases[i].w, cases[i].h, &ow, &oh, &err);
        if (cases[i].ok)
            CHECKF(st == KILN_OK && ow == cases[i].ow && oh == cases[i].oh,
                   "%dx%d -> %dx%d (%s)", cases[i].w, cases[i].h, ow, oh, err.msg);
        else
            CHECKF(st == KILN_ERR_INVALID && err.msg[0], "%dx%d accepted", cases[i].w,
                   cases[i].h);
    }
}

/* Preprocesses a case's input_ref0.png and compares with the oracle's
 * ref0.image_preprocessed bit for bit. */
static void check_case(const char *cs)
{
    char dir[1200];
    snprintf(dir, sizeof dir, "%s/%s", oracle_path("cases"), cs);
    kiln_image ref = load(dir, "input_ref0.png");
    kiln_err err = {0};
    kiln_st *st = oracle_check_open(cs, "ref_fp32.safetensors");
    int64_t shape[4] = {1, 3, 128, 192};
    const kiln_st_tensor *want =
        st ? kiln_st_expect(st, "ref0.image_preprocessed", 4, shape, &err) : NULL;
    CHECKF(want && want->dtype == KILN_F32, "%s: %s", cs, err.msg);
    kiln_tensor got = {0};
    if (ref.pixels && want) {
        CHECKF(kiln_image_flux2_ref_prepare(&ref, &got, &err) == KILN_OK, "%s", err.msg);
        CHECK(got.dtype == KILN_F32 && got.ndim == 4 && !got.on_device);
        CHECK(memcmp(got.shape, shape, sizeof shape) == 0);
        if (got.data && memcmp(got.shape, shape, sizeof shape) == 0) {
            const float *g = got.data, *w = want->data;
            size_t n = (size_t)kiln_tensor_numel(&got), bad = 0;
            for (size_t i = 0; i < n; i++)
                bad += memcmp(&g[i], &w[i], sizeof(float)) != 0;
            CHECKF(bad == 0, "%s: %zu of %zu values differ from diffusers", cs, bad, n);
        }
        int ow, oh;
        CHECK(kiln_image_flux2_ref_size(ref.width, ref.height, &ow, &oh, &err) == KILN_OK);
        CHECK(ow == 192 && oh == 128);
    }
    kiln_tensor_host_free(&got);
    kiln_st_close(st);
    kiln_image_free(&ref);
}

static void test_oracle_edit_refs(void)
{
    check_case("klein_edit_1ref");
    check_case("klein_kv_edit_1ref");
}

static void test_prepare_resized(void)
{
    /* The >1024^2 path end to end: the Pillow resize, then the crop of
     * 1073x976 to 1072x976 (left = 0, top = 0), then the scaling. */
    kiln_image src = load(fixtures, "lanczos_src.png");
    kiln_image want = load(fixtures, "lanczos_src.1073x976.expected.png");
    kiln_tensor t = {0};
    kiln_err err = {0};
    if (src.pixels && want.pixels) {
        CHECKF(kiln_image_flux2_ref_prepare(&src, &t, &err) == KILN_OK, "%s", err.msg);
        CHECK(t.shape[0] == 1 && t.shape[1] == 3 && t.shape[2] == 976 && t.shape[3] == 1072);
        size_t bad = 0, plane = 976 * 1072;
        const float *p = t.data;
        for (int y = 0; p && y < 976; y++)
            for (int x = 0; x < 1072; x++)
                for (int c = 0; c < 3; c++) {
                    float v = 2.0f * ((float)want.pixels[((size_t)y * 1073 + x) * 3 + c] / 255.0f) - 1.0f;
                    bad += p[c * plane + (size_t)y * 1072 + x] != v;
                }
        CHECKF(bad == 0, "%zu values differ", bad);
    }
    kiln_tensor_host_free(&t);
    /* Invalid references are refused before any work. */
    kiln_image small = {0};
    CHECK(kiln_image_alloc(&small, 63, 80, &err) == KILN_OK);
    CHECK(kiln_image_flux2_ref_prepare(&small, &t, &err) == KILN_ERR_INVALID);
    CHECKF(strstr(err.msg, "64"), "%s", err.msg);
    CHECK(t.data == NULL);
    CHECK(kiln_image_flux2_ref_prepare(NULL, &t, &err) == KILN_ERR_INVALID);
    kiln_image_free(&small);
    kiln_image_free(&src);
    kiln_image_free(&want);
}

/* Shrinking a reference first (what kiln-encoder does right after decoding
 * each one, to hold at most ~1 MP per reference) changes nothing: its
 * prepared tensor is bit-identical to the original's, over sizes that are
 * downscaled on either axis's rounding and ones that are not. */
static void test_shrink_then_prepare(void)
{
    static const int sizes[][2] = {{1500, 1100}, {2100, 700}, {1025, 1024}, {700, 2050},
                                   {3001, 2999}, {900, 900},  {1024, 1024}, {64, 512}};
    kiln_err err = {0};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int w = sizes[k][0], h = sizes[k][1];
        kiln_image img = {0};
        CHECK(kiln_image_alloc(&img, w, h, &err) == KILN_OK);
        uint32_t x = 2463534242u + (uint32_t)k;
        for (size_t i = 0; img.pixels && i < (size_t)w * h * 3; i++) {
            x ^= x << 13, x ^= x >> 17, x ^= x << 5; /* xorshift32: texture, not flat */
            img.pixels[i] = (uint8_t)(i % 3 == 0 ? x : (x >> 8) / 2 + (i / 3 % (size_t)w) / 8);
        }
        kiln_tensor want = {0}, got = {0};
        CHECKF(kiln_image_flux2_ref_prepare(&img, &want, &err) == KILN_OK, "%s", err.msg);
        const uint8_t *before = img.pixels;
        CHECKF(kiln_image_flux2_ref_shrink(&img, &err) == KILN_OK, "%s", err.msg);
        int over = (double)w * h > 1024.0 * 1024.0;
        CHECKF(over ? img.pixels != before && (double)img.width * img.height <= 1024.0 * 1024.0
                    : img.pixels == before && img.width == w && img.height == h,
               "%dx%d shrunk to %dx%d", w, h, img.width, img.height);
        CHECKF(kiln_image_flux2_ref_prepare(&img, &got, &err) == KILN_OK, "%s", err.msg);
        CHECKF(want.data && got.data && !memcmp(want.shape, got.shape, sizeof want.shape) &&
                   !memcmp(want.data, got.data, kiln_tensor_nbytes(&want)),
               "%dx%d: the prepared tensors differ", w, h);
        kiln_tensor_host_free(&want), kiln_tensor_host_free(&got);
        kiln_image_free(&img);
    }
    /* A reference prepare refuses is refused, and left as it was. */
    kiln_image small = {0};
    CHECK(kiln_image_alloc(&small, 63, 80, &err) == KILN_OK);
    const uint8_t *px = small.pixels;
    CHECK(kiln_image_flux2_ref_shrink(&small, &err) == KILN_ERR_INVALID);
    CHECK(small.pixels == px && small.width == 63 && small.height == 80);
    kiln_image_free(&small);
}

int main(void)
{
    const char *shared = getenv("KILN_SHARED"), *src = getenv("KILN_SOURCE_ROOT");
    if (!shared || !src) {
        fprintf(stderr, "KILN_SHARED and KILN_SOURCE_ROOT must be set\n");
        return 1;
    }
    snprintf(fixtures, sizeof fixtures, "%s/tests/data/image", src);
    RUN(test_lanczos_pillow);
    RUN(test_lanczos_edges);
    RUN(test_ref_size);
    RUN(test_oracle_edit_refs);
    RUN(test_prepare_resized);
    RUN(test_shrink_then_prepare);
    return test_finish();
}
