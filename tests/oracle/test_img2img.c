/* Image-to-image (engine/denoise_stage.h, diffusers' FluxImg2ImgPipeline
 * algorithm) on the CPU backend with the tiny klein checkpoint, checked
 * from inside (test_edit_oracle checks it against diffusers):
 * - kiln_denoise_first_step is diffusers' get_timesteps
 *   (int(max(n - n x strength, 0)) steps skipped at the start);
 * - strength 1 is text-to-image from the same seed, bit for bit (the image
 *   is noised with sigma 1: it does not count);
 * - with one step left (strength 1/steps) the result is exactly the
 *   image noised with scale_noise at the last sigma, then one Euler step
 *   with the DiT's velocity at the last timestep, computed here from the
 *   model and scheduler directly;
 * - strength must be in (0, 1], take a (1, N, C) image, and not be
 *   combined with latents_in; a small one still runs one step. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/image.h"
#include "engine/denoise_stage.h"
#include "engine/encode_stage.h"
#include "models/flux2_dit.h"
#include "models/latents.h"
#include "models/scheduler.h"
#include "oracle_util.h"
#include "tests/test.h"

#define W 64
#define H 96
#define STEPS 4

static kiln_backend *be;
static kiln_checkpoint *ck;
static kiln_encode_stage *enc;
static kiln_denoise_stage *den;
static kiln_tensor emb, img_tokens;

static float *download(const kiln_tensor *t)
{
    float *h = malloc((size_t)kiln_tensor_numel(t) * sizeof *h);
    kiln_be_download(be, t, h);
    return h;
}

/* An input image at the output size, encoded as an edit reference is. */
static void setup(void)
{
    kiln_err err = {0};
    ck = kiln_checkpoint_open(oracle_path("ckpt/klein-tiny"), &err);
    CHECKF(ck != NULL, "%s", err.msg);
    kiln_encode_opts eo = {.out_layers = {1, 2, 3}, .n_out_layers = 3, .with_references = 1};
    enc = kiln_encode_stage_create(be, ck, &eo, &err);
    CHECKF(enc != NULL, "%s", err.msg);
    den = kiln_denoise_stage_create(be, ck, &err);
    CHECKF(den != NULL, "%s", err.msg);
    const char *prompt = "a red house";
    CHECK(kiln_encode_prompts(enc, &prompt, 1, 32, &emb, NULL, NULL, &err) == KILN_OK);
    kiln_image im = {0};
    CHECK(kiln_image_alloc(&im, W, H, NULL) == KILN_OK);
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            uint8_t *p = im.pixels + 3 * (y * W + x);
            p[0] = (uint8_t)(x * 4), p[1] = (uint8_t)(y * 2), p[2] = (uint8_t)((x ^ y) * 3);
        }
    int32_t *ids = NULL;
    int64_t R = 0;
    CHECKF(kiln_encode_references(enc, &im, 1, &img_tokens, &ids, &R, &err) == KILN_OK, "%s",
           err.msg);
    CHECK(R == (W / 16) * (H / 16));
    free(ids);
    kiln_image_free(&im);
}

static kiln_denoise_job job_of(uint64_t *seed, double strength)
{
    return (kiln_denoise_job){.B = 1, .embeds = &emb, .width = W, .height = H, .steps = STEPS,
                              .guidance = 1.0f, .seeds = seed,
                              .init_tokens = strength > 0 ? &img_tokens : NULL,
                              .strength = strength};
}

/* get_timesteps of FluxImg2ImgPipeline and Flux2KleinInpaintPipeline:
 * int(max(n - min(n x strength, n), 0)) in Python floats (the values
 * below are Python's). */
static void test_first_step(void)
{
    CHECK(kiln_denoise_first_step(4, 0) == 0);
    CHECK(kiln_denoise_first_step(4, 1.0) == 0);
    CHECK(kiln_denoise_first_step(4, 0.5) == 2);
    CHECK(kiln_denoise_first_step(4, 0.8) == 0);  /* int(0.8): all 4 steps run */
    CHECK(kiln_denoise_first_step(4, 0.6) == 1);  /* int(1.6) */
    CHECK(kiln_denoise_first_step(4, 0.1) == 3);  /* one step for any strength > 0 */
    CHECK(kiln_denoise_first_step(4, 0.3) == 2);
    CHECK(kiln_denoise_first_step(10, 0.7) == 3); /* 10 - 7.000000000000001 */
    CHECK(kiln_denoise_first_step(10, 0.3) == 7); /* 10 - 3.0000000000000004 rounds to 7 */
    CHECK(kiln_denoise_first_step(50, 0.6) == 20);
    CHECK(kiln_denoise_first_step(50, 0.8) == 10);
    CHECK(kiln_denoise_first_step(3, 0.34) == 1);
    CHECK(kiln_denoise_first_step(5, 0.45) == 2);
}

static void test_strength_one_is_t2i(void)
{
    uint64_t seed = 7;
    kiln_err err = {0};
    kiln_denoise_job t2i = job_of(&seed, 0), i2i = job_of(&seed, 1.0);
    kiln_tensor a = {0}, b = {0};
    CHECKF(kiln_denoise_run(den, &t2i, &a, &err) == KILN_OK, "%s", err.msg);
    CHECKF(kiln_denoise_run(den, &i2i, &b, &err) == KILN_OK, "%s", err.msg);
    float *ha = download(&a), *hb = download(&b);
    size_t n = (size_t)kiln_tensor_numel(&a);
    CHECK(n == (size_t)kiln_tensor_numel(&b) && memcmp(ha, hb, n * sizeof *ha) == 0);
    free(ha), free(hb);
    kiln_be_free(be, &a), kiln_be_free(be, &b);
}

/* The last step alone, computed from the parts: scale_noise, the DiT at
 * the last timestep, one Euler step to sigma 0. */
static void test_one_step_from_parts(void)
{
    uint64_t seed = 11;
    kiln_err err = {0};
    kiln_denoise_job job = job_of(&seed, 1.0 / STEPS);
    CHECK(kiln_denoise_first_step(STEPS, job.strength) == STEPS - 1);
    kiln_tensor got = {0};
    CHECKF(kiln_denoise_run(den, &job, &got, &err) == KILN_OK, "%s", err.msg);

    int64_t N = (W / 16) * (H / 16), C = kiln_denoise_stage_channels(den), T = emb.shape[1];
    kiln_sched_config sc;
    CHECK(kiln_sched_config_load(oracle_path("ckpt/klein-tiny"), &sc, &err) == KILN_OK);
    float sigmas[STEPS + 1], timesteps[STEPS];
    double mu;
    CHECK(kiln_sched_flux2(&sc, N, STEPS, sigmas, timesteps, &mu, &err) == KILN_OK);
    float *noise = malloc((size_t)(N * C) * sizeof *noise);
    kiln_denoise_job plain = job_of(&seed, 0);
    CHECK(kiln_denoise_noise(den, &plain, noise, &err) == KILN_OK);
    float *img = download(&img_tokens), *x = malloc((size_t)(N * C) * sizeof *x);
    float s = sigmas[STEPS - 1];
    for (int64_t k = 0; k < N * C; k++)
        x[k] = s * noise[k] + (1.0f - s) * img[k];

    kiln_flux2_dit *dit = kiln_flux2_dit_load(be, ck, &err);
    CHECKF(dit != NULL, "%s", err.msg);
    int32_t *img_ids = malloc((size_t)N * 4 * sizeof *img_ids);
    int32_t *txt_ids = malloc((size_t)T * 4 * sizeof *txt_ids);
    kiln_latents_image_ids(img_ids, H / 16, W / 16);
    kiln_latents_text_ids(txt_ids, T);
    kiln_tensor xt = {0}, v = {0};
    CHECK(kiln_be_from_host(be, &xt, 3, (int64_t[]){1, N, C}, x, KILN_F32) == KILN_OK);
    CHECK(kiln_be_alloc(be, &v, be->act_dtype, 3, (int64_t[]){1, N, C}) == KILN_OK);
    float t = kiln_sched_flux2_dit_time(timesteps[STEPS - 1], be->act_dtype);
    kiln_flux2_dit_input in = {.x = &xt, .txt = &emb, .t = &t, .img_ids = img_ids,
                               .txt_ids = txt_ids};
    CHECKF(kiln_flux2_dit_forward(dit, &in, &v, &err) == KILN_OK, "%s", err.msg);
    kiln_be_euler_step(be, &xt, &v, sigmas[STEPS] - sigmas[STEPS - 1]);
    CHECK(kiln_be_check(be, &err) == KILN_OK);
    float *want = download(&xt), *have = download(&got);
    CHECK(memcmp(want, have, (size_t)(N * C) * sizeof *want) == 0);
    /* And the image shows through: the result is nearer the image than a
     * text-to-image run's is. */
    kiln_tensor full = {0};
    CHECK(kiln_denoise_run(den, &plain, &full, &err) == KILN_OK);
    float *fromnoise = download(&full);
    double d_i2i = 0, d_t2i = 0;
    for (int64_t k = 0; k < N * C; k++) {
        d_i2i += (have[k] - img[k]) * (have[k] - img[k]);
        d_t2i += (fromnoise[k] - img[k]) * (fromnoise[k] - img[k]);
    }
    CHECKF(d_i2i < d_t2i, "img2img %.3g, t2i %.3g from the image", d_i2i, d_t2i);
    free(fromnoise), free(want), free(have), free(img), free(x), free(noise), free(img_ids),
        free(txt_ids);
    kiln_be_free(be, &xt), kiln_be_free(be, &v), kiln_be_free(be, &got), kiln_be_free(be, &full);
    kiln_flux2_dit_destroy(dit);
}

static void test_refusals(void)
{
    uint64_t seed = 1;
    kiln_err err = {0};
    kiln_tensor out = {0};
    kiln_denoise_job j = job_of(&seed, 1.5);
    CHECK(kiln_denoise_run(den, &j, &out, &err) == KILN_ERR_INVALID);
    j = job_of(&seed, 0.5);
    j.init_tokens = NULL;
    CHECK(kiln_denoise_run(den, &j, &out, &err) == KILN_ERR_INVALID);
    j = job_of(&seed, 0.5);
    j.width = W + 16; /* the image's tokens are of another size */
    CHECK(kiln_denoise_run(den, &j, &out, &err) == KILN_ERR_INVALID);
    CHECK(out.data == NULL);
}

/* kiln_request_resolve: the CLI's and the service's rules. */
static void test_request_rules(void)
{
    kiln_model_traits tr = {.default_steps = 4, .default_guidance = 1.0f, .shrink_images = 1,
                            .inpaint_strength = 0.8};
    kiln_limits lim = KILN_LIMITS_CLI;
    kiln_image ref = {.width = 200, .height = 136}; /* prepared: 192x128 */
    kiln_request q;
    kiln_err err = {0};
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.strength = 0.5;
    CHECKF(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_OK, "%s", err.msg);
    CHECK(q.width == 192 && q.height == 128);
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.strength = 0.5, q.width = 128, q.height = 128;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_ERR_INVALID && strstr(err.msg, "192x128"));
    kiln_image two[2] = {ref, ref};
    kiln_request_init(&q);
    q.prompt = "x", q.refs = two, q.n_refs = 2, q.strength = 0.5;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_ERR_INVALID);
    kiln_request_init(&q);
    q.prompt = "x", q.refs = &ref, q.n_refs = 1, q.strength = 0.05; /* int(4 - 0.2): one step */
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_OK);
    kiln_request_init(&q);
    q.prompt = "x", q.strength = 0.5;
    CHECK(kiln_request_resolve(&q, &tr, &lim, &err) == KILN_ERR_INVALID);
}

int main(void)
{
    kiln_err err = {0};
    be = kiln_backend_create("cpu", 0, &err);
    if (!be) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    setup();
    RUN(test_first_step);
    RUN(test_strength_one_is_t2i);
    RUN(test_one_step_from_parts);
    RUN(test_refusals);
    RUN(test_request_rules);
    kiln_be_free(be, &emb), kiln_be_free(be, &img_tokens);
    kiln_denoise_stage_destroy(den);
    kiln_encode_stage_destroy(enc);
    kiln_checkpoint_close(ck);
    kiln_backend_destroy(be);
    return test_finish();
}
