/* libFuzzer target for image decoding (built with -Dfuzz=true and clang):
 * any bytes go through kiln_image_decode under small limits.  A decoded
 * image must have a sane size and fully readable pixels; small ones are
 * also resized to a size taken from the input's last bytes, prepared as a
 * FLUX.2 reference when large enough, and round-tripped through PNG, which
 * must give the same pixels back.  libpng, libjpeg-turbo and libwebp are the
 * system builds (not coverage-instrumented): the fuzzer steers through our
 * code, the sanitizers watch both. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"

static void check_image(const kiln_image *img, const kiln_image_limits *lim)
{
    if (img->width < 1 || img->height < 1 || img->width > lim->max_side ||
        img->height > lim->max_side || (int64_t)img->width * img->height > lim->max_pixels)
        abort();
    size_t n = (size_t)img->width * img->height * 3;
    unsigned sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += img->pixels[i];
    if (sum == 0xdeadbeefu) /* keeps the reads from being optimised away */
        abort();
}

static void exercise(const kiln_image *img, const uint8_t *data, size_t len)
{
    kiln_err err = {0};
    kiln_image r = {0};
    int w = 1 + data[len - 1] % 97, h = 1 + data[len - 2] % 97;
    if (kiln_image_resize_lanczos(img, w, h, &r, &err) != KILN_OK)
        abort();
    if (r.width != w || r.height != h)
        abort();
    kiln_image_free(&r);

    kiln_tensor t = {0};
    kiln_status st = kiln_image_flux2_ref_prepare(img, &t, &err);
    if (st != KILN_OK && st != KILN_ERR_INVALID)
        abort();
    kiln_tensor_host_free(&t);

    kiln_buf b = {0};
    kiln_image back = {0};
    if (kiln_image_encode(img, NULL, &b, &err) != KILN_OK ||
        kiln_image_decode(b.data, b.len, NULL, &back, &err) != KILN_OK ||
        back.width != img->width || back.height != img->height ||
        memcmp(back.pixels, img->pixels, (size_t)img->width * img->height * 3) != 0)
        abort();
    kiln_image_free(&back);
    kiln_buf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t len)
{
    const kiln_image_limits lim = {.max_side = 4096, .max_pixels = 1 << 21};
    kiln_err err = {0};
    kiln_image img = {0};
    kiln_status st = kiln_image_decode(data, len, &lim, &img, &err);
    if (st != KILN_OK) {
        /* Refusals are clean: INVALID (or NOMEM) with a message and no image. */
        if ((st != KILN_ERR_INVALID && st != KILN_ERR_NOMEM) || !err.msg[0] || img.pixels)
            abort();
        return 0;
    }
    check_image(&img, &lim);
    if ((int64_t)img.width * img.height <= 256 * 256 && len >= 2)
        exercise(&img, data, len);
    kiln_image_free(&img);
    return 0;
}
