/* Inpainting (engine/inpaint.h, engine/denoise_stage.h: diffusers'
 * Flux2KleinInpaintPipeline semantics) on the CPU backend with the tiny
 * klein checkpoint.  No diffusers fixture (diffusers could not be run in
 * the session that wrote it), so it is checked from inside:
 * - masks: OpenAI's (alpha 0 repaints) and diffusers' (white repaints)
 *   PNGs decode to the right 0/255 values; the latent-grid mask is the
 *   binarized, bilinearly interpolated one (0.5 on a straddling edge);
 * - the image is resized to its multiple-of-16 size, not cropped;
 * - an all-repaint mask is the unmasked run with the same start, bit for
 *   bit (the blend is an identity), an all-keep mask returns the image's
 *   latents exactly (the last blend puts the image back), and with one
 *   step and a mixed mask each token is the one or the other;
 * - kiln_request_resolve's rules for masks. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "common/buf.h"
#include "common/image.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "engine/inpaint.h"
#include "oracle_util.h"
#include "tests/test.h"

#define W 64
#define H 96
#define STEPS 4
#define NTOK ((W / 16) * (H / 16))

static kiln_backend *be;
static kiln_encode_stage *enc;
static kiln_denoise_stage *den;
static kiln_tensor emb, img_tokens;
static int32_t *img_ids;

/* ---- a PNG writer for 8-bit RGB (3) or RGBA (4) test masks ---- */

static void chunk(kiln_buf *b, const char *type, const uint8_t *data, uint32_t len)
{
    uint8_t be32[4] = {(uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len};
    kiln_buf_append(b, be32, 4, NULL);
    size_t at = b->len;
    kiln_buf_append(b, type, 4, NULL);
    if (len)
        kiln_buf_append(b, data, len, NULL);
    uint32_t crc = (uint32_t)crc32(0L, b->data + at, len + 4);
    uint8_t c[4] = {(uint8_t)(crc >> 24), (uint8_t)(crc >> 16), (uint8_t)(crc >> 8), (uint8_t)crc};
    kiln_buf_append(b, c, 4, NULL);
}

static kiln_buf png_of(const uint8_t *px, int w, int h, int channels)
{
    kiln_buf b = {0};
    static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
    kiln_buf_append(&b, sig, 8, NULL);
    uint8_t ihdr[13] = {0, 0, (uint8_t)(w >> 8), (uint8_t)w, 0, 0, (uint8_t)(h >> 8), (uint8_t)h,
                        8, channels == 4 ? 6 : 2, 0, 0, 0};
    chunk(&b, "IHDR", ihdr, 13);
    size_t row = (size_t)w * channels, raw_len = (row + 1) * h;
    uint8_t *raw = malloc(raw_len);
    for (int y = 0; y < h; y++) {
        raw[y * (row + 1)] = 0;
        memcpy(raw + y * (row + 1) + 1, px + y * row, row);
    }
    uLongf zlen = compressBound(raw_len);
    uint8_t *z = malloc(zlen);
    compress(z, &zlen, raw, raw_len);
    chunk(&b, "IDAT", z, (uint32_t)zlen);
    chunk(&b, "IEND", NULL, 0);
    free(raw), free(z);
    return b;
}

static void test_mask_decode(void)
{
    enum { MW = 32, MH = 16 };
    uint8_t rgba[MW * MH * 4], rgb[MW * MH * 3];
    for (int i = 0; i < MW * MH; i++) {
        int x = i % MW;
        rgba[4 * i] = 200, rgba[4 * i + 1] = 10, rgba[4 * i + 2] = 10;
        rgba[4 * i + 3] = x < 8 ? 0 : x < 16 ? 128 : 255; /* only alpha 0 repaints */
        rgb[3 * i] = rgb[3 * i + 1] = rgb[3 * i + 2] = x < 8 ? 255 : 0;
        if (x >= 24)
            rgb[3 * i] = 255, rgb[3 * i + 1] = 0, rgb[3 * i + 2] = 0; /* L = 76 */
    }
    kiln_buf a = png_of(rgba, MW, MH, 4), b = png_of(rgb, MW, MH, 3);
    kiln_image m = {0};
    kiln_err err = {0};
    CHECKF(kiln_image_decode_mask(a.data, a.len, NULL, &m, &err) == KILN_OK, "%s", err.msg);
    CHECK(m.width == MW && m.height == MH);
    for (int x = 0; x < MW; x++)
        CHECKF(m.pixels[3 * x] == (x < 8 ? 255 : 0) && m.pixels[3 * x + 2] == m.pixels[3 * x],
               "alpha mask x %d: %d", x, m.pixels[3 * x]);
    kiln_image_free(&m);
    CHECK(kiln_image_decode_mask(b.data, b.len, NULL, &m, &err) == KILN_OK);
    CHECK(m.pixels[0] == 255 && m.pixels[3 * 10] == 0 && m.pixels[3 * 30] == 76);
    kiln_image_free(&m);
    /* Not a PNG. */
    CHECK(kiln_image_decode_mask("\xff\xd8\xff\xe0", 4, NULL, &m, &err) == KILN_ERR_INVALID);
    kiln_buf_free(&a), kiln_buf_free(&b);
}

static void test_mask_grid(void)
{
    kiln_image m = {0};
    CHECK(kiln_image_alloc(&m, 64, 32, NULL) == KILN_OK);
    /* Columns below 40 repaint: the edge straddles grid column 2 (source
     * pixels 39 and 40 at bilinear weight 1/2 each). */
    for (int y = 0; y < 32; y++)
        for (int x = 0; x < 64; x++)
            memset(m.pixels + 3 * (y * 64 + x), x < 40 ? 255 : (x < 48 ? 127 : 0), 3);
    float g[4 * 2];
    kiln_err err = {0};
    CHECKF(kiln_inpaint_mask(&m, 64, 32, g, &err) == KILN_OK, "%s", err.msg);
    for (int y = 0; y < 2; y++) {
        CHECK(g[y * 4 + 0] == 1.0f && g[y * 4 + 1] == 1.0f);
        CHECK(g[y * 4 + 2] == 0.5f && g[y * 4 + 3] == 0.0f); /* 127/255 < 0.5: kept */
    }
    /* A mask of another size is resized to the image first. */
    float g2[8 * 4];
    CHECK(kiln_inpaint_mask(&m, 128, 64, g2, &err) == KILN_OK);
    CHECK(g2[0] == 1.0f && g2[7] == 0.0f);
    kiln_image_free(&m);
}

static void test_prepare_image(void)
{
    kiln_image im = {0};
    CHECK(kiln_image_alloc(&im, 200, 136, NULL) == KILN_OK);
    for (int i = 0; i < 200 * 136 * 3; i++)
        im.pixels[i] = (uint8_t)(i % 251);
    kiln_image want = {0};
    CHECK(kiln_image_resize_lanczos(&im, 192, 128, &want, NULL) == KILN_OK);
    kiln_err err = {0};
    kiln_model_traits klein = {.shrink_images = 1};
    CHECKF(kiln_inpaint_prepare_image(&im, &klein, &err) == KILN_OK, "%s", err.msg);
    CHECK(im.width == 192 && im.height == 128);
    CHECK(memcmp(im.pixels, want.pixels, 192 * 128 * 3) == 0);
    kiln_image_free(&im), kiln_image_free(&want);
}

static void setup(void)
{
    kiln_err err = {0};
    kiln_checkpoint *ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    kiln_encode_opts eo = {.out_layers = {1, 2, 3}, .n_out_layers = 3, .with_references = 1};
    enc = kiln_encode_stage_create(be, ck, &eo, &err);
    den = kiln_denoise_stage_create(be, ck, &err);
    kiln_checkpoint_close(ck);
    CHECKF(enc && den, "%s", err.msg);
    const char *prompt = "a red door";
    CHECK(kiln_encode_prompts(enc, &prompt, 1, 32, &emb, NULL, NULL, &err) == KILN_OK);
    kiln_image im = {0};
    CHECK(kiln_image_alloc(&im, W, H, NULL) == KILN_OK);
    for (int i = 0; i < W * H * 3; i++)
        im.pixels[i] = (uint8_t)((i * 37) % 256);
    kiln_model_traits tr = kiln_encode_stage_traits(enc);
    CHECK(kiln_inpaint_prepare_image(&im, &tr, &err) == KILN_OK);
    int64_t R = 0;
    CHECKF(kiln_encode_references(enc, &im, 1, &img_tokens, &img_ids, &R, &err) == KILN_OK, "%s",
           err.msg);
    CHECK(R == NTOK);
    kiln_image_free(&im);
}

static float *run(const float *mask, double strength)
{
    static uint64_t seed = 21;
    kiln_denoise_job j = {.B = 1, .embeds = &emb, .width = W, .height = H, .steps = STEPS,
                          .guidance = 1.0f, .seeds = &seed, .init_tokens = &img_tokens,
                          .strength = strength, .mask = mask, .ref_tokens = &img_tokens,
                          .ref_ids = img_ids, .R = NTOK};
    kiln_tensor out = {0};
    kiln_err err = {0};
    CHECKF(kiln_denoise_run(den, &j, &out, &err) == KILN_OK, "%s", err.msg);
    float *h = malloc((size_t)kiln_tensor_numel(&out) * sizeof *h);
    kiln_be_download(be, &out, h);
    kiln_be_free(be, &out);
    return h;
}

static void test_blends(void)
{
    int64_t C = kiln_denoise_stage_channels(den);
    size_t n = (size_t)(NTOK * C);
    float ones[NTOK], zeros[NTOK], mixed[NTOK];
    for (int t = 0; t < NTOK; t++)
        ones[t] = 1, zeros[t] = 0, mixed[t] = (t % 3 == 0) ? 1.0f : 0.0f;
    float *img = malloc(n * sizeof *img);
    kiln_be_download(be, &img_tokens, img);
    /* strength 0.5, 4 steps: both arithmetics start at step 2. */
    float *all = run(ones, 0.5), *plain = run(NULL, 0.5);
    CHECK(memcmp(all, plain, n * sizeof *all) == 0);
    float *kept = run(zeros, 0.5);
    CHECK(memcmp(kept, img, n * sizeof *img) == 0);
    /* One step (strength 0.1): the repainted tokens are the all-repaint
     * run's, the kept ones the image's. */
    float *one_all = run(ones, 0.1), *one_mixed = run(mixed, 0.1);
    int ok = 1;
    for (int t = 0; t < NTOK; t++)
        ok &= memcmp(one_mixed + t * C, mixed[t] ? one_all + t * C : img + t * C,
                     (size_t)C * sizeof *img) == 0;
    CHECK(ok);
    double moved = 0;
    for (size_t k = 0; k < n; k++)
        moved += fabs(one_all[k] - img[k]);
    CHECK(moved > 0);
    free(all), free(plain), free(kept), free(one_all), free(one_mixed), free(img);
}

static void test_request_rules(void)
{
    kiln_model_traits tr = {.default_steps = 4, .default_guidance = 1.0f, .shrink_images = 1,
                            .inpaint_strength = 0.8};
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_image ref = {.width = 200, .height = 136}, mask = ref, small = {.width = 100, .height = 68};
    kiln_request q;
    kiln_err err = {0};
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.mask = &mask;
    CHECKF(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_OK, "%s", err.msg);
    CHECK(q.strength == 0.8 && q.width == 192 && q.height == 128);
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.mask = &small;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_ERR_INVALID && strstr(err.msg, "size"));
    kiln_image two[2] = {ref, ref};
    kiln_request_init(&q);
    q.prompt = "x", q.refs = two, q.n_refs = 2, q.mask = &mask;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_ERR_INVALID);
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.mask = &mask, q.strength = 0.1;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_OK); /* one step runs */
    kiln_model_traits kv = tr;
    kv.kv_cache = 1;
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.mask = &mask;
    CHECK(kiln_request_resolve(&q, &kv, &lim, &err) == KILN_ERR_INVALID);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    RUN(test_mask_decode);
    RUN(test_mask_grid);
    RUN(test_prepare_image);
    setup();
    RUN(test_blends);
    RUN(test_request_rules);
    kiln_be_free(be, &emb), kiln_be_free(be, &img_tokens);
    free(img_ids);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
    kiln_backend_destroy(be);
    return test_finish();
}
